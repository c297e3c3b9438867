"""Shared test helpers: float64 everywhere, and ``mpirun`` as a fixture.

Distributed tests start ``mpirun -n N python tests/mpi/<script>.py`` as a subprocess. A
script asserts on every rank; one failing assert aborts the job (comm.install_excepthook), so
the return code tells. A timeout fails with "deadlock?" and every rank's output; a missing
mpirun is an error, not a skip.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPI_SCRIPTS = ROOT / "tests" / "mpi"


def find_mpirun():
    for candidate in (Path(sys.executable).parent / "mpirun", shutil.which("mpirun")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise RuntimeError("mpirun not found: run `make install` (the mpich wheel provides it)")


def run_mpi(n, args, timeout=120, env=None, check=True):
    """Run ``mpirun -n n python ARGS`` and return the CompletedProcess.

    ``args`` is a script path (str/Path) plus arguments, or ["-m", "mpipar.x", ...]."""
    cmd = [find_mpirun(), "-n", str(n), sys.executable, *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                    PYTHONPATH=str(ROOT), **(env or {}))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=full_env, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        out, errout = (s.decode() if isinstance(s, bytes) else (s or "")
                       for s in (err.stdout, err.stderr))
        pytest.fail(f"deadlock? `{' '.join(cmd)}` did not finish in {timeout} s\n"
                    f"--- stdout (all ranks)\n{out}\n--- stderr (all ranks)\n{errout}")
    if check and proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)}` exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                    f"--- stderr\n{proc.stderr}")
    return proc


def assert_matches_serial(out, flags, saved, tmp_path, capsys):
    """A scheme's command-line run against the serial trainer with the same ``flags``: the
    same final report line in ``out`` (its stdout), and every parameter it saved to ``saved``
    equal to the serial one (the same names, relative error at most 1e-10)."""
    import numpy as np

    from mpipar import train

    reference = tmp_path / "serial.npz"
    train.main("serial", [*flags, "--save-params", str(reference)])
    want = [line for line in capsys.readouterr().out.splitlines() if "final" in line]
    assert want and [line for line in out.splitlines() if "final" in line] == want
    ref, got = train.load_params(reference), train.load_params(saved)
    assert sorted(got) == sorted(ref)
    for name, value in got.items():
        np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-14, err_msg=name)


def assert_params_close(got, want, what=""):
    """The same parameter names, and each parameter within a relative error of 1e-10 (its
    largest difference over its largest value)."""
    import numpy as np

    assert sorted(got) == sorted(want), what
    for name in want:
        err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
        assert err <= 1e-10, (what, name, err)


def assert_refused(n, module, flags, message):
    """``mpirun -n n python -m mpipar.<module> FLAGS`` is refused: exit code 2, ``message``
    said once (by one rank, not once per rank), no traceback, and no rank left waiting (a job
    that hangs fails as a deadlock, whatever the machine's speed)."""
    proc = run_mpi(n, ["-m", f"mpipar.{module}", "--quiet", *flags], timeout=90, check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert message in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def mpirun():
    return run_mpi


@pytest.fixture(autouse=True)
def float64():
    from mpipar.engine import backend as B

    B.use("numpy", "float64")
    yield
    B.use("numpy", "float32")
