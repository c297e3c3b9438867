"""Arrows one way: a scheme file run as a program runs once, parsing flags loads no scheme, and
no module of mpipar imports one that imports it back (an import inside a function counts too;
the one exception is the runner's hand-over, mpipar.runner.hand_over)."""

import ast
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


def module_files():
    out = {}
    for path in (ROOT / "mpipar").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path, modules):
    """The mpipar modules ``path`` imports anywhere (in functions too), but not under
    ``if __name__ == "__main__"`` and not in the hand-over."""
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "__main__" in ast.unparse(child.test) or \
                    isinstance(child, ast.FunctionDef) and child.name == "hand_over":
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.update(f"{child.module}.{a.name}" if f"{child.module}.{a.name}" in modules
                             else child.module for a in child.names)
            visit(child)
    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules}


def test_no_module_imports_one_that_imports_it_back():
    modules = module_files()
    graph = {m: imports_of(path, modules) - {m} for m, path in modules.items()}
    circles = []
    for start in graph:
        stack = [[start]]
        while stack:
            path = stack.pop()
            for nxt in graph[path[-1]]:
                if nxt == start:
                    circles.append(" -> ".join(path + [start]))
                elif nxt not in path:
                    stack.append(path + [nxt])
    assert not circles, circles
