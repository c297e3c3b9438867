"""Arrows one way: a scheme file run as a program runs once, and parsing flags loads no
scheme."""

import subprocess
import sys

import pytest
from conftest import ROOT

SCHEMES = {"serial": [], "data_parallel": [], "tensor_parallel": [],
           "pipeline": ["--timeline", "none"], "hybrid": []}
SCHEME_MODULES = {f"mpipar.{s}" for s in SCHEMES} | {
    "mpipar.zero", "mpipar.parts.tp_models", "mpipar.parts.tp_layers",
    "mpipar.parts.sequence_parallel"}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_scheme_file_run_as_a_program_runs_once(scheme):
    """``python -m mpipar.X`` runs the file as __main__; the runner's import of mpipar.X must
    find that copy, not execute the file a second time (-X importtime lists every import)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", f"mpipar.{scheme}",
                           "--model", "mlp", "--steps", "1", "--quiet", *SCHEMES[scheme]],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")]
    assert "mpipar.train" in imported  # the check sees the runner's imports
    assert f"mpipar.{scheme}" not in imported


def test_parsing_flags_loads_no_scheme():
    code = ("import sys, mpipar.runner.cli; "
            "print(' '.join(m for m in sys.modules if m.startswith('mpipar')))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                cwd=ROOT, check=True).stdout.split())
    assert "mpipar.runner.cli" in loaded and not loaded & SCHEME_MODULES, loaded
