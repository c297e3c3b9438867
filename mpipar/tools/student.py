"""The student track: a copy of the project with the core of each scheme taken out, and a grader.

    python -m mpipar.tools.student list             # the exercises
    python -m mpipar.tools.student make DIR # DIR: a copy in which every exercise is to be written
    python -m mpipar.tools.student grade DIR        # one line per exercise: passed, or why not
    python -m mpipar.tools.student grade DIR ring-allreduce f-backward    # only these

``make`` copies the repository (``mpipar/``, ``tests/``, ``lessons/`` and the set-up files) into
DIR and replaces the body of each exercise's functions by ``raise NotImplementedError(task)``,
keeping the signature and the docstring, which says what the function must do. Write the
bodies in DIR; the rest of the copy is the reference and does not change.

``grade`` checks each exercise in DIR's copy with the project's own equivalence checks:
1. the training command that runs the exercise's code (``mpirun -n P python -m mpipar.<scheme>``)
   saves its parameters, the serial trainer with the same flags saves its own, and every
   parameter must agree within a relative error of 1e-10 (the tolerance of the tests); the
   first one that does not is named, with its relative error, and with how far the run's
   parameters moved from where both began against the serial ones: not at all, or 1/P or P
   times as far (a sum taken as a mean, or a mean as a sum);
2. before that, the existing tests named for the exercise, run by pytest: direct checks that
   name what is wrong (the ring on its own, chunk by chunk: the first rank, chunk and element
   whose sum is wrong, whose values it holds, and the first send that differs from the ring's;
   the row-parallel layer against its dense twin; the 1F1B lists of every stage count up to
   6 and micro-batch count up to 9 simulated, then the exact lists: a schedule that trains
   correctly in the wrong order is still wrong).
An exercise passes when both pass. The exit code is the number of exercises that failed.
Every run is made with synchronous sends (``MPIPAR_SSEND=1``: a send completes only when its
receive has started, so "every rank sends, then receives" hangs here as it would with large
messages) and a watchdog of ``WATCHDOG`` seconds per MPI call (``--timeout``): a deadlock
ends within seconds, named by the rank and the call it waits in. A failed test shows its
whole assertion; a failed run its first error, without the ``[rank N]`` prefixes.

Each exercise is graded on its own: its checks run in a scratch copy of DIR in which the
functions of every other exercise are the reference's (those of the project the grader runs
from), so the row-parallel Linear, which calls g, passes or fails by its own code while g is
still a stub. Checks that would run the same command on the same code run once.
"""

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

from mpipar.tools.bench.common import OneLineParser, folder_problem, mpirun_path
from mpipar.tools.exercises import (  # noqa: F401 (the table, imported from here too)
    EXERCISE_FILES,
    EXERCISES,
    GPT,
    MLP,
    Exercise,
    find,
)

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("mpipar", "tests", "lessons", "setup.cfg", "pyproject.toml", "Makefile", "README.md")
TOLERANCE = 1e-10
WATCHDOG = 20  # seconds one MPI call may wait in a graded run before the job ends, named
NOTHING_SAVED = "exit code 0, and no parameters saved"  # a training run that sys.exit(0) ended

# ----------------------------------------------------------------------------- make
def definition(tree, qualname):
    """The ast node of ``name`` or ``Class.method`` at the top of a module."""
    node, parts = tree, qualname.split(".")
    for part in parts:
        node = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            raise LookupError(f"{qualname} is not defined")
    return node


def stub_source(source, functions, message):
    """``source`` with the bodies of ``functions`` replaced by ``raise NotImplementedError``
    (the docstring stays), bottom-up so that earlier line numbers stay valid."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    nodes = sorted((definition(tree, f) for f in functions), key=lambda n: -n.lineno)
    for node in nodes:
        body = node.body
        has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                   and isinstance(body[0].value.value, str))
        first = body[1] if has_doc and len(body) > 1 else None if has_doc else body[0]
        indent = " " * (node.col_offset + 4)
        pieces = textwrap.wrap(message, 92 - len(indent), drop_whitespace=False)
        stub = f"{indent}raise NotImplementedError(\n" + "".join(
            f"{indent}    {piece!r}\n" for piece in pieces) + f"{indent})\n"
        if first is None:  # docstring only
            lines.insert(body[0].end_lineno, stub)
        else:
            lines[first.lineno - 1:node.end_lineno] = [stub]
    return "".join(lines)


def restore_source(source, reference, functions):
    """``source`` with the definitions of ``functions`` (decorators included) taken whole from
    ``reference``, bottom-up so that earlier line numbers stay valid."""
    def span(node):
        return min([node.lineno, *(d.lineno for d in node.decorator_list)]), node.end_lineno

    lines, ref_lines = source.splitlines(keepends=True), reference.splitlines(keepends=True)
    tree, ref_tree = ast.parse(source), ast.parse(reference)
    spans = []
    for f in functions:
        start, end = span(definition(tree, f))
        ref_start, ref_end = span(definition(ref_tree, f))
        spans.append((start, end, ref_lines[ref_start - 1:ref_end]))
    for start, end, text in sorted(spans, key=lambda s: -s[0]):
        lines[start - 1:end] = text
    return "".join(lines)


def copy_project(source, target):
    """The project's files (``COPIED``, without byte code) from ``source`` into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        src = source / name
        if src.is_dir():
            shutil.copytree(src, target / name, ignore=shutil.ignore_patterns("__pycache__"),
                            dirs_exist_ok=True)
        elif src.exists():
            shutil.copy2(src, target / name)


def make(target):
    """Write the student's copy into ``target``, a new or empty folder. Anything else (a file,
    a folder with files in it, a place this process cannot write in) is refused before a file
    is written; a copy that fails half-way (a full disk) is removed again."""
    target = Path(target)
    if target.is_dir() and any(target.iterdir()):
        raise SystemExit(f"error: {target} exists and is not empty; choose a new folder")
    if problem := folder_problem(target):
        raise SystemExit(f"error: cannot make the copy: {problem}")
    existed = target.exists()
    try:
        write_copy(target)
    except OSError as err:
        for path in list(target.iterdir()) if existed else [target]:  # what the copy made
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        raise SystemExit(f"error: could not write the copy in {target}, so nothing is left "
                         f"there: {err}") from None
    print(f"wrote {target}: {len(EXERCISES)} exercises to write "
          f"(`python -m mpipar.tools.student list`); grade with "
          f"`python -m mpipar.tools.student grade "
          f"{target}`")


def write_copy(target):
    """The project copied into ``target``, each exercise's functions replaced by stubs."""
    copy_project(ROOT, target)
    for path in EXERCISE_FILES:
        source = (target / path).read_text()
        for function, message in stub_messages(path).items():
            source = stub_source(source, [function], message)
        (target / path).write_text(source)


def stub_messages(path):
    """The stub's message for each function of ``path`` that an exercise names: the task of
    the first exercise that names it, and the names of the larger ones it is also part of."""
    owners = {}
    for ex in EXERCISES:
        for function in ex.functions if ex.path == path else ():
            owners.setdefault(function, []).append(ex.name)
    tasks = {ex.name: ex.task for ex in EXERCISES}
    return {function: f"exercise {names[0]}"
            + (f" (part of {', '.join(names[1:])})" if names[1:] else "") + f": {tasks[names[0]]}"
            for function, names in owners.items()}


# ----------------------------------------------------------------------------- grade
def run(cmd, copy, timeout=180):
    """``cmd`` in the copy, which must import its own mpipar (not this one)."""
    env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MPIPAR_SSEND="1")  # a send completes only when received: no hidden buffering
    try:
        return subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, -1, "", f"no answer in {timeout} s: deadlock?")


def why(proc):
    """The line that says why a run failed: the exception (``NotImplementedError``: "not
    written yet"; ``SystemExit``: the code exited), a refusal, a failed test's assertion, else
    the last line of output. A rank's lines lose their ``[rank N]`` prefix, except the
    watchdog's, which names the rank and the call it waited in (a deadlock)."""
    text = proc.stderr + proc.stdout
    hung = re.search(r"\[rank \d+\] watchdog: waited .*", text)
    if hung:
        return f"deadlock: {hung[0].strip()}"
    lines = [re.sub(r"^\[rank \d+(, [^\]]*)?\]\s*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("Traceback")]
    if any(line.startswith("NotImplementedError") for line in lines):
        return "not written yet (NotImplementedError)"
    exits = [m[0] for line in lines if (m := re.search(r"\bSystemExit\b.*$", line))]
    if exits:
        return exited(exits[0])
    found = [line for line in lines if re.match(r"(E +)?\w+(Error|Exception)\b|error:", line)]
    return re.sub(r"^E +", "", (found or lines or [f"exit code {proc.returncode}"])[0]).strip()


def exited(detail):
    """Why a run that the code under test ended early failed (one line)."""
    return f"exited early ({detail}): exercise code must return, not call sys.exit()"


def first_mismatch(got, want):
    """None when every parameter agrees, else a sentence naming the first that does not."""
    if sorted(got) != sorted(want):
        missing = sorted(set(want) ^ set(got))
        return f"the saved parameters differ in names: {missing[:3]}"
    for name in want:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        if a.shape != b.shape:
            return f"parameter {name}: shape {a.shape}, serial {b.shape}"
        scale = max(float(np.max(np.abs(b))), 1e-300)
        error = float(np.max(np.abs(a - b))) / scale
        if not np.isfinite(error) or error > TOLERANCE:
            return f"first mismatching parameter {name}: relative error {error:.2e}"
    return None


def isolate(ex, copy, scratch):
    """The folder in which ``ex`` is graded: ``copy`` with the reference's functions for every
    other exercise, so that their stubs and mistakes cannot fail it; ``copy`` itself when it
    already has them, else a copy of it in ``scratch``. A file that does not parse, or lacks a
    function, stays as it is: the run names its error."""
    restored = {}
    for path in EXERCISE_FILES:
        others = list(dict.fromkeys(  # once each; a larger exercise's own parts stay as written
            f for e in EXERCISES if e.path == path and e is not ex for f in e.functions
            if f not in ex.functions))
        try:
            source = (copy / path).read_text()
            text = restore_source(source, (ROOT / path).read_text(), others)
        except (OSError, SyntaxError, LookupError):
            continue
        if text != source:
            restored[path] = text
    if not restored:
        return copy
    folder = scratch / f"copy-{ex.name}"
    copy_project(copy, folder)
    for path, text in restored.items():
        (folder / path).write_text(text)
    return folder


def exercise_code(folder):
    """The text of every file that holds an exercise: within one copy, the code that differs
    from one graded folder to another."""
    return tuple((folder / p).read_text() if (folder / p).exists() else "" for p in
                 EXERCISE_FILES)


def check_training(ex, folder, scratch):
    """None when the scheme equals the serial trainer, else why not."""
    shared = [*ex.model, "--dtype", "float64", "--quiet"]
    saved = scratch / f"{ex.name}.npz"
    proc = run([mpirun_path(), "-n", str(ex.ranks), sys.executable, "-m", f"mpipar.{ex.scheme}",
                *ex.flags, *shared, "--timeout", str(WATCHDOG), "--save-params", str(saved)],
               folder)
    if proc.returncode != 0 or not saved.exists():  # exit code 0 and nothing saved: sys.exit(0)
        return why(proc) if proc.returncode != 0 else exited(NOTHING_SAVED)
    serial = scratch / f"serial-{'-'.join(ex.model)}.npz"  # exercises of one model share it
    if not serial.exists():
        proc = run([sys.executable, "-m", "mpipar.serial", *shared, "--save-params",
                    str(serial)], folder)
        if proc.returncode != 0 or not serial.exists():
            return ("the serial reference failed: "
                    + (why(proc) if proc.returncode else exited(NOTHING_SAVED)))
    with np.load(saved) as got, np.load(serial) as want:
        got, want = dict(got), dict(want)
    problem = first_mismatch(got, want)
    if problem is None or not problem.startswith("first mismatching"):
        return problem
    start = scratch / f"start-{'-'.join(ex.model)}.npz"  # the parameters before any update:
    if not start.exists():  # a step of 1e-300 times the gradient rounds away in float64
        run([sys.executable, "-m", "mpipar.serial", *shared, "--steps", "1", "--lr", "1e-300",
             "--save-params", str(start)], folder)
    if start.exists():
        with np.load(start) as init:
            problem += how_far(got, want, dict(init), ex.ranks)
    return problem


def how_far(got, want, start, ranks):
    """What the run's parameters did, against the serial run's, from where both began: the
    ends of a sentence. Nothing moved: no update reached them; moved 1/P or P times as far
    (plain SGD moves with the gradient): a sum taken as a mean, or a mean as a sum."""
    names = [n for n in want if n in start and start[n].shape == want[n].shape]
    moved = np.concatenate([(np.asarray(got[n]) - start[n]).ravel() for n in names])
    serial = np.concatenate([(np.asarray(want[n]) - start[n]).ravel() for n in names])
    if np.max(np.abs(moved)) < 1e-200:  # (a zero bias took the 1e-300 step: 1e-300 * grad)
        return "; the parameters never changed: no update reached them"
    share = float(moved @ serial / max(serial @ serial, 1e-300))  # how far along the serial's
    for factor, words in ((1 / ranks, f"1/{ranks}"), (ranks, f"{ranks} times")):
        if abs(share / factor - 1) < 0.1:
            return (f"; they moved {words} as far as the serial ones ({share:.3f} of the way): "
                    f"{'a sum taken as a mean' if factor < 1 else 'a mean taken as a sum'} "
                    f"somewhere?")
    return ""


def check_tests(ex, folder):
    if not ex.tests:
        return None
    proc = run([sys.executable, "-m", "pytest", "-x", "-vv", "-p", "no:cacheprovider",
                *ex.tests], folder, timeout=300)
    if proc.returncode == 0:
        return None
    if "NotImplementedError" in proc.stdout + proc.stderr:
        return "not written yet (NotImplementedError)"
    diff = [re.sub(r"^\[rank \d+\]\s*", "", line[1:].strip())
            for line in proc.stdout.splitlines() if line.startswith("E ")]
    said = [line for line in diff if re.match(r"\w*Error\b", line)]  # what the check says
    if not said:
        return f"{ex.tests[0].split('::')[-1]}: {why(proc)}"
    noise = re.compile(r"(File |Traceback|Abort\(|Failed: `|--- |\^+$|assert err <=)")
    rest = [line for line in diff if line and line != said[0] and not noise.match(line)]
    failed = re.search(r"(?:FAILED|ERROR) \S+::(\S+)", proc.stdout)  # the test that failed
    name = failed[1] if failed else ex.tests[0].split("::")[-1]
    return f"{name}: " + "\n".join([said[0].removeprefix("AssertionError: "), *rest])


def grade(copy, names=()):
    """One line per exercise; returns the number that failed."""
    copy = Path(copy).resolve()
    if not (copy / "mpipar" / "tools" / "student.py").exists():
        raise SystemExit(f"error: {copy} is not a copy made by "
                         "`python -m mpipar.tools.student make`")
    exercises = [find(n) for n in names] if names else EXERCISES
    failed, trained = 0, {}  # trained: the training checks' answers by command and code
    with tempfile.TemporaryDirectory() as scratch:
        for ex in exercises:
            folder = isolate(ex, copy, Path(scratch))
            problem = check_tests(ex, folder)  # the direct checks first: they name the layer
            key = (ex.ranks, ex.scheme, tuple(ex.flags), tuple(ex.model), exercise_code(folder))
            if problem is None and key not in trained:
                trained[key] = check_training(ex, folder, Path(scratch))
            problem = problem or trained[key]
            failed += problem is not None
            first, *more = (problem or "").split("\n")  # a test's diff: its further lines
            print(f"{ex.name:16s} {'passed' if problem is None else 'FAILED: ' + first}"
                  + "".join(f"\n{'':16s}   {line}" for line in more if line.strip()), flush=True)
    print(f"{len(exercises) - failed} of {len(exercises)} exercises passed")
    if failed:
        ex = next(e for e in exercises if e.ranks)
        print(f"to run your copy yourself: cd {copy} && mpirun -n {ex.ranks} python -m "
              f"mpipar.{ex.scheme} {' '.join(ex.flags + ex.model)} --explain (each MPI call "
              f"narrated), with MPIPAR_SSEND=1 and --timeout {WATCHDOG} as the grader runs it")
    return failed


def main(argv=None):
    ap = OneLineParser(prog="python -m mpipar.tools.student", description=__doc__.split("\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the exercises, with the functions each one asks for")
    sub.add_parser("make", help="copy the project with the exercises taken out").add_argument(
        "dir")
    g = sub.add_parser("grade", help="check a copy's exercises against serial training")
    g.add_argument("dir")
    g.add_argument("exercises", nargs="*", help="only these (default: all)")
    a = ap.parse_args(argv)
    if a.command == "list":
        for ex in EXERCISES:
            print(f"{ex.name:16s} about {ex.minutes} min, {ex.path} > "
                  f"{', '.join(ex.functions)}\n{'':16s} {ex.task}")
    elif a.command == "make":
        make(a.dir)
    else:
        sys.exit(min(grade(a.dir, a.exercises), 125))


if __name__ == "__main__":
    main()
