"""What every benchmark shares: the command line, the environment of a row, CSV output, timing,
and running a worker under ``mpirun`` from a plain ``python -m mpipar.tools.bench ...``."""

import argparse
import csv
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The results: the project's committed plots/, or MPIPAR_PLOTS (the tests use a scratch folder).
# ``make report`` (mpipar.tools.report) runs every benchmark with ``--out PLOTS`` and reads
# them back.
PLOTS = Path(os.environ.get("MPIPAR_PLOTS") or Path(__file__).resolve().parents[3] / "plots")
# where a benchmark run from the command line writes unless given --out: never over the
# committed plots/ (trying a benchmark, or a lesson's command, must not replace the results
# the lessons quote); with MPIPAR_PLOTS set, that folder, which is not the committed one
SCRATCH = Path(tempfile.gettempdir()) / "mpipar-plots"
WAIT_BARE = "dp allreduce in bare NumPy and mpi4py"  # bench wait's floor, as the report names it
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cores():
    from mpipar.engine.backend import cores as backend_cores  # NumPy only: no MPI in the launcher

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


def write_atomically(path, text):
    """Write ``text`` to ``path`` whole or not at all: into a temporary file beside it, then
    renamed over it (an interrupted run leaves the old file, never half of a new one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, newline="")
    os.replace(tmp, path)
    return path


def write_csv(name, rows, folder=PLOTS):
    """Write rows (dicts) to folder/name (plots/ unless told), columns in first-seen order,
    atomically; return the path."""
    folder.mkdir(parents=True, exist_ok=True)
    fields = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
    return write_atomically(folder / name, text.getvalue())


def read_csv(name, folder=PLOTS):
    with open(folder / name, newline="") as f:
        return list(csv.DictReader(f))


def csv_rows(folder, name):
    """The rows of the CSV ``name`` in ``folder``, or none if it is not there."""
    return read_csv(name, folder) if (folder / name).exists() else []


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


def run_ranks(n, module, args=(), timeout=600, env=None):
    """Run ``mpirun -n n python -m module args`` with one BLAS thread per rank and return the
    JSON objects its rank 0 printed on lines starting with ``RESULT ``. ``env``: variables to
    set for this launch (a value of None unsets the variable)."""
    cmd = [mpirun_path(), "-n", str(n), sys.executable, "-m", module, *map(str, args)]
    env = {k: v for k, v in dict(os.environ, **ONE_THREAD, **(env or {})).items()
           if v is not None}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return emitted(proc.stdout)


def emitted(stdout):
    """The JSON objects of the ``RESULT `` lines (:func:`emit`) in a launch's output."""
    return [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def emit(obj):
    """Print one result line for :func:`run_ranks` to collect, in one write (so that no
    other rank's output lands between the line and its newline)."""
    sys.stdout.write("RESULT " + json.dumps(obj) + "\n")
    sys.stdout.flush()


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


class BenchParser(argparse.ArgumentParser):
    """A benchmark's command line. A flag added with :meth:`sized` has two defaults, one for a
    normal run and one for ``--quick``, filled in after parsing where the flag was not given:
    a flag given on the command line always wins (``--quick --steps 20`` times 20 steps)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sized_defaults = {}  # dest -> (normal, quick)

    def sized(self, flag, normal, quick, help=None, **kwargs):
        if help != argparse.SUPPRESS:
            shown = [",".join(map(str, v)) if isinstance(v, list) else v for v in (normal, quick)]
            help = f"{help + ' ' if help else ''}(default {shown[0]}; with --quick {shown[1]})"
        action = self.add_argument(flag, default=None, help=help, **kwargs)
        self.sized_defaults[action.dest] = (normal, quick)

    def parse_known_args(self, args=None, namespace=None):  # parse_args calls this too
        args, rest = super().parse_known_args(args, namespace)
        for dest, (normal, quick) in self.sized_defaults.items():
            if getattr(args, dest) is None:
                setattr(args, dest, quick if args.quick else normal)
        return args, rest


def bench_parser(name, quick_help="fewer sizes and repeats", worker=True):
    """The command line every benchmark starts from: ``--quick``, ``--out`` and (unless it has
    its own) the hidden ``--worker`` flag with which its mpirun ranks run the timed part."""
    ap = BenchParser(prog=f"python -m mpipar.tools.bench {name}")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    default = PLOTS if os.environ.get("MPIPAR_PLOTS") else SCRATCH
    ap.add_argument("--out", type=Path, default=default,
                    help=f"folder for the CSV and pictures (default {default}; `--out plots` "
                         "replaces the committed results, as `make report` does)")
    if worker:
        ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def int_list(text):
    """An argparse type: comma-separated whole numbers, "1,4,16" -> [1, 4, 16]."""
    return [int(v) for v in text.split(",")]


def wrote(*paths):
    """Say where a benchmark wrote its CSV and pictures."""
    note = ""
    if Path(paths[0]).resolve().parent == SCRATCH.resolve():
        note = "  (a scratch folder: --out plots replaces the committed results)"
    print("-> " + ", ".join(map(str, paths)) + note, flush=True)
