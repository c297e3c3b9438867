"""What every benchmark shares: the command line, the environment of a row, CSV output, timing,
and running a worker under ``mpirun`` from a plain ``python -m mpipar.tools.bench ...``."""

import argparse
import csv
import io
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpipar.tools.cluster import refuse  # one line on stderr, then exit: the tools' refusal

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


class OneLineParser(argparse.ArgumentParser):
    """A command line that refuses bad input as the trainers do (:mod:`mpipar.runner.cli`): one
    line, ``error: MESSAGE (see --help)``, and exit code 2, without argparse's usage block.
    Its subcommands' parsers (``add_subparsers``) are of this class too."""

    def error(self, message):
        refuse(f"{message} (see --help)")


class BenchParser(OneLineParser):
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
    ap.add_argument("--out", type=out_folder, default=default,
                    help=f"folder for the CSV and pictures (default {default}; `--out plots` "
                         "replaces the committed results, as `make report` does)")
    if worker:
        ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def turns_flags(ap, warmup, steps):
    """The flags of a benchmark that times trainers in turns (:func:`in_turns`), with its
    defaults (warmup, steps) and --quick's 1/6 of them, and launches for the spread."""
    ap.sized("--launches", 5, 2, type=number(), help="launches, for the spread of the ratios")
    ap.sized("--warmup", warmup, max(1, warmup // 6), type=number(),
             help="steps trained before the timed ones")
    ap.sized("--steps", steps, 3, type=number(), help="timed steps of each trainer (median)")


def in_turns(trainers, warmup, steps, after=None):
    """Train each of ``trainers`` (under mpirun) ``warmup`` steps, then time ``steps`` more of
    each, taking turns so that all see the machine in the same state: a barrier, the step, the
    slowest rank's seconds. ``after(i)`` runs after each timed step of trainer i (reading the
    trace), ``before(i)`` not needed: the trace is cleared before each. Returns each trainer's
    list of seconds."""
    from mpi4py import MPI

    from mpipar.mpi.trace import TRACE

    world = MPI.COMM_WORLD
    for step in range(warmup):
        for trainer in trainers:
            trainer.step(step)
    times = [[] for _ in trainers]
    for step in range(warmup, warmup + steps):
        for i, trainer in enumerate(trainers):
            TRACE.clear()
            world.Barrier()
            t0 = time.perf_counter()
            trainer.step(step)
            times[i].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            if after is not None:
                after(i)
    return times


def step_columns(seconds):
    """A row's step-time columns from the timed steps of :func:`in_turns`: median, min, max,
    in ms."""
    ms = [1e3 * t for t in seconds]
    return dict(step_ms=round(statistics.median(ms), 3), step_ms_min=round(min(ms), 3),
                step_ms_max=round(max(ms), 3))


def number(kind=int, zero_ok=False):
    """An argparse type: a number > 0 (>= 0 with ``zero_ok``) of ``kind``, ``int`` (a whole
    number) or ``float`` (finite). Anything else (nan, inf, a word, nothing) is refused, and
    argparse names the flag: ``argument --steps: expected a whole number > 0, got '0'``."""
    what = f"{'a whole' if kind is int else 'a finite'} number {'>= 0' if zero_ok else '> 0'}"

    def parse(text):
        try:
            value = kind(text)
            fine = (kind is int or math.isfinite(value)) and (value > 0 or zero_ok and value == 0)
        except ValueError:
            fine = False
        if not fine:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def count_list(multiple_of=1):
    """An argparse type: comma-separated whole numbers > 0, each a multiple of ``multiple_of``,
    "1,4,16" -> [1, 4, 16]; an empty list, or any other entry, is refused."""
    what = "whole numbers > 0" + (f", multiples of {multiple_of}" if multiple_of > 1 else "")

    def parse(text):
        try:
            values = [number(int)(v) for v in text.split(",")]
        except argparse.ArgumentTypeError:
            values = None
        if values is None or any(v % multiple_of for v in values):
            like = ",".join(str(k * multiple_of) for k in (1, 2, 4))
            raise argparse.ArgumentTypeError(f"expected {what}, comma-separated (like {like}), "
                                             f"got {text!r}")
        return values
    return parse


def folder_problem(path):
    """Why files cannot be written into the folder ``path`` (one sentence), or None. A folder
    that does not exist yet is fine where it can be made: its nearest existing parent must be
    a folder this process can write in (tried with a temporary file, so that a read-only
    file system or /proc says no even to root)."""
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"cannot write in {existing} ({err.strerror or err})"
    return None


def out_folder(text):
    """An argparse type: the folder a benchmark writes into, refused before anything runs when
    files cannot be written there (:func:`folder_problem`)."""
    problem = folder_problem(text) if text.strip() else "expected a folder, got ''"
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return Path(text)


def too_big(nbytes, what):
    """Why ``what``, of ``nbytes`` bytes, cannot be held here (one sentence: more than this
    machine's memory), or None."""
    from mpipar.parts.plan import memory_bytes

    if nbytes <= memory_bytes():
        return None
    return (f"{what} would take {nbytes / 2**30:,.1f} GiB, more than this machine's "
            f"{memory_bytes() / 2**30:.1f} GiB")


def wrote(*paths):
    """Say where a benchmark wrote its CSV and pictures."""
    note = ""
    if Path(paths[0]).resolve().parent == SCRATCH.resolve():
        note = "  (a scratch folder: --out plots replaces the committed results)"
    print("-> " + ", ".join(map(str, paths)) + note, flush=True)
