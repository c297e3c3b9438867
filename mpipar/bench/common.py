"""What every benchmark shares: the environment of a row, CSV output, timing, and running a
worker under ``mpirun`` from a plain ``python -m mpipar.bench ...``."""

import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# where CSVs and pictures go: the project's plots/, or MPIPAR_PLOTS (the tests use a scratch
# folder, so that running a lesson's benchmark command never overwrites the committed results)
PLOTS = Path(os.environ.get("MPIPAR_PLOTS") or Path(__file__).resolve().parents[2] / "plots")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cores():
    from mpipar.backend import cores as backend_cores  # NumPy only: no MPI in the launcher

    return backend_cores()


def environment(ranks=1, threads=1):
    """The columns every CSV row carries: versions, cores, ranks, threads."""
    import mpi4py
    import numpy
    from mpi4py import MPI

    return {
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "cores": cores(),
        "ranks": ranks,
        "threads": threads,
        "oversubscribed": ranks * threads > cores(),
    }


def write_csv(name, rows):
    """Write rows (dicts) to plots/<name>, columns in first-seen order; return the path."""
    PLOTS.mkdir(exist_ok=True)
    path = PLOTS / name
    fields = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return path


def read_csv(name):
    with open(PLOTS / name, newline="") as f:
        return list(csv.DictReader(f))


def csv_float(row, key):
    """A field of a row from :func:`read_csv` as a number."""
    return float(row[key])


def median_time(fn, repeats=7, warmup=2):
    """Median wall time of fn() over repeats, after warm-up calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mpirun_path():
    for candidate in (Path(sys.executable).parent / "mpirun", shutil.which("mpirun")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise SystemExit("mpirun not found: run `make install` (the mpich wheel provides it)")


def run_ranks(n, module, args=(), timeout=600):
    """Run ``mpirun -n n python -m module args`` with one BLAS thread per rank and return the
    JSON objects its rank 0 printed on lines starting with ``RESULT ``."""
    cmd = [mpirun_path(), "-n", str(n), sys.executable, "-m", module, *map(str, args)]
    env = dict(os.environ, **ONE_THREAD)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def emit(obj):
    """Print one result line for :func:`run_ranks` to collect."""
    print("RESULT " + json.dumps(obj), flush=True)


def pyplot():
    """matplotlib's pyplot on the Agg backend: pictures go to files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path):
    """Lay out, write as PNG and close a figure; return its path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def bench_parser(name, quick_help="fewer sizes and repeats", worker=True):
    """The command line every benchmark starts from: ``--quick``, and (unless it has its own)
    the hidden ``--worker`` flag with which its mpirun ranks run the timed part."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m mpipar.bench {name}")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    if worker:
        ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def wrote(*paths):
    """Say where a benchmark wrote its CSV and pictures."""
    print("-> " + ", ".join(map(str, paths)), flush=True)
