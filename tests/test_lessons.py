"""The course stays true to the code: citations resolve, commands run, pictures exist.

A lesson cites code as `mpipar/<file>.py > XX Step N` (a banner ``# -- XX Step N: ...`` in
that file, standing over the code that does the step, not over a definition) or
`mpipar/<file>.py > Name` / `> Class.method` (a definition found with ast). Commands
are the ``$ ...`` lines of ```console blocks; each one runs from the repository root and must
exit 0. Training commands that set no ``--steps`` run shortened to 3 steps (``--steps 3
--quiet`` added before any pipe) and benchmarks with ``--quick``, so the suite stays fast.
Benchmarks write into a scratch folder (``MPIPAR_PLOTS``), never over the committed plots.

Expected output: the lines that follow a ``$`` line in its block, up to the next ``$`` line,
are what that command prints (stdout, or what the command line itself redirects), and the test
compares them with what it printed, from its first line to its last:

- a line of its own ``...`` stands for any number of lines (none included);
- ``...`` inside a line stands for any text on that line;
- a line ending in ``# varies`` must print the same words with any numbers (the comment is
  not printed; runs of spaces may differ, as right-aligned columns of other widths do);
- a line ending in ``# within N%`` must print the same words, with each number within N% of
  the one shown.

A command the test shortens (see :func:`shortened`) prints a short run's output, not the full
run's the lesson shows. The shown lines must then appear among the printed ones, in that order,
by the same rules, as a short run prints them (:func:`short_run_lines`):

- in a shortened training run, ``N steps`` reads ``3 steps`` and ``steps 2..N`` reads
  ``steps 2..3``, and the trained model's figures (train loss, val loss, test accuracy) may be
  anything, as ``...``; settings, parameter counts, byte counts and formulas stay exact;
- a line with a measured time (``3.2 us``, ``14 ms``) reads as if marked ``# varies``;
- a note ``(N ranks on M cores)`` reads as this machine prints it.

The few shown lines a short run cannot print at all are listed in ``NOT_IN_A_SHORT_RUN``, by
lesson, each with its reason. Blocks whose output varies too much to show belong in a
```` ```bash ```` block, which is not run.
"""

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, find_mpirun

from mpipar.engine.backend import cores

LESSONS = sorted((ROOT / "lessons").glob("*.md"))
CITE = re.compile(r"`(mpipar/[\w/]+\.py) > ([^`]+)`")
PICTURE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")
TRAINERS = re.compile(r"-m mpipar\.(serial|data_parallel|tensor_parallel|pipeline|hybrid|"
                      r"expert_parallel|context_parallel)\b")
SHORT_STEPS = 3  # the optimizer steps of a shortened training run


def citations():
    for lesson in LESSONS:
        for path, target in CITE.findall(lesson.read_text()):
            yield pytest.param(lesson.name, path, target.strip(), id=f"{lesson.stem}:{target}")


def commands():
    """Every ``$`` command of every console block, with the output lines shown after it."""
    for lesson in LESSONS:
        for block in re.findall(r"```console\n(.*?)```", lesson.read_text(), re.S):
            block = textwrap.dedent(block)  # a block indented under a list item counts too
            for part in re.split(r"^\$ ", block, flags=re.M)[1:]:
                command, *shown = part.rstrip("\n").split("\n")
                yield pytest.param(lesson.stem, command.strip(),
                                   [line.rstrip() for line in shown],
                                   id=f"{lesson.stem}:{command[:58]}")


NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?"


def shape(text):
    """A regex for text whose numbers may be any numbers and whose runs of spaces any runs."""
    parts = re.split(rf"({NUMBER}|\s+)", text)
    return "".join(NUMBER if re.fullmatch(NUMBER, x) else r"\s+" if x.isspace() else
                   re.escape(x) for x in parts if x)


def line_matches(shown, printed):
    """One shown line against one printed line (the rules of the module docstring)."""
    shown, _, note = shown.partition("  # ")
    tolerance = re.fullmatch(r"within (\d+(?:\.\d+)?)%", note)
    loose = note == "varies" or tolerance
    parts = shown.rstrip().split("...")  # "...", with the spaces before it: any text
    pattern = ".*".join((shape if loose else re.escape)(part.rstrip(" ") if i < len(parts) - 1
                                                         else part) for i, part in enumerate(parts))
    if not re.fullmatch(pattern, printed.rstrip()):
        return False
    if not tolerance:
        return True
    want, got = (re.findall(NUMBER, text.replace("...", " ")) for text in (shown, printed))
    share = float(tolerance.group(1)) / 100
    return len(want) == len(got) and all(
        abs(float(g.replace(",", "")) - float(w.replace(",", "")))
        <= share * abs(float(w.replace(",", ""))) for w, g in zip(want, got))


def output_matches(shown, printed):
    """Whether the printed lines are the shown ones, ``...`` lines standing for any lines."""
    if not shown:
        return not printed
    if shown[0] == "...":
        return any(output_matches(shown[1:], printed[i:]) for i in range(len(printed) + 1))
    return bool(printed) and line_matches(shown[0], printed[0]) and \
        output_matches(shown[1:], printed[1:])


def defined_names(path):
    """Every top-level function/class and Class.method in a module."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign)):
            if isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
                continue
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{n.name}" for n in node.body
                             if isinstance(n, ast.FunctionDef))
    return names


def test_there_is_a_course():
    names = [p.name for p in LESSONS]
    assert "README.md" in names and len(names) >= 3, names


@pytest.mark.parametrize("lesson,path,target", list(citations()))
def test_citation_resolves(lesson, path, target):
    source = ROOT / path
    assert source.exists(), f"{lesson} cites {path}, which does not exist"
    step = re.fullmatch(r"(\w+) Step (\d+)", target)
    if step:
        lines = source.read_text().split("\n")
        at = [i for i, line in enumerate(lines) if line.strip().startswith(f"# -- {target}:")]
        assert at, f"{lesson} cites {path} > {target}, but no '# -- {target}: ...' banner"
        for i in at:  # each banner stands over the code that does the step, not a definition
            code = next(line.strip() for line in lines[i + 1:]
                        if line.strip() and not line.strip().startswith("#"))
            assert not code.startswith(("def ", "class ", "@", '"""')), \
                f"{path}: the banner '{lines[i].strip()}' stands over '{code}', not its code"
    else:
        assert target in defined_names(source), f"{lesson} cites {path} > {target}: not defined"


@pytest.mark.parametrize("lesson", [p.name for p in LESSONS])
def test_pictures_exist(lesson):
    text = (ROOT / "lessons" / lesson).read_text()
    for ref in PICTURE.findall(text):
        assert (ROOT / "lessons" / ref).resolve().exists(), f"{lesson} shows {ref}: missing"


def test_every_figure_is_shown():
    """A picture of an idea (lessons/figures/, `make figures`) is linked by some lesson, as
    `figures/NAME.png`, resolved from lessons/ like every other picture."""
    shown = {(ROOT / "lessons" / ref).resolve() for p in LESSONS
             for ref in PICTURE.findall(p.read_text())}
    figures = sorted((ROOT / "lessons" / "figures").glob("*.png"))
    assert figures, "lessons/figures/ holds no pictures: run `make figures`"
    unshown = [f.name for f in figures if f.resolve() not in shown]
    assert not unshown, f"pictures no lesson shows: {unshown}"


def short_flags(command):
    """The flags that make the command's run short ("" where it runs as written): a trainer
    that sets no --steps trains SHORT_STEPS steps, and a benchmark runs --quick."""
    first = command.partition(" | ")[0]
    if TRAINERS.search(first) and not re.search(r"--help|--print|--steps", first):
        return f"--steps {SHORT_STEPS} --quiet"
    if "-m mpipar.tools.bench" in first and "--help" not in first:
        return "--quick"
    return ""


def shortened(command):
    """The command with its flags for a short run added to its first part (before any pipe)."""
    first, pipe, rest = command.partition(" | ")
    flags = short_flags(command)
    return (f"{first} {flags}" if flags else first) + pipe + rest


TRAINED = re.compile(r"\b(train loss|val loss|test accuracy) [^,\s]+")
TIMED = re.compile(rf"{NUMBER} ?[mun]?s(?![\w/])")  # 3.2 us, 14 ms, 1.62 s

# Shown lines of shortened commands that a short run does not print, by lesson: (a regex for
# the start of the shown line, why a short run cannot print it).
NOT_IN_A_SHORT_RUN = {
    "09-cluster": [
        (r"\s*(no limit|\d+ [MG]bit/s) ",
         "bench link's rows: --quick measures two of the four rates, fewer times; "
         "tests/test_course_facts.py checks the rows shown against plots/link.csv"),
        (r"-> ", "where a benchmark wrote: the test gives it a folder of its own"),
    ],
}


def on_this_machine(line):
    """A shown ``(N ranks on M cores)`` note as this machine prints it: with its own count of
    cores, and not at all where it has a core for each rank."""
    def note(match):
        ranks = int(match.group(1))
        return f" ({ranks} ranks on {cores()} cores)" if ranks > cores() else ""
    return re.sub(r" \((\d+) ranks on \d+ cores\)", note, line)


def short_run_lines(lesson, command, shown):
    """The lines shown after a shortened command that its short run prints too, rewritten as
    it prints them (the rules of the module docstring); ``...`` lines are left out."""
    trains = short_flags(command).startswith("--steps")
    skip = [pattern for pattern, _ in NOT_IN_A_SHORT_RUN.get(lesson, [])]
    lines = []
    for line in shown:
        if line == "..." or any(re.match(pattern, line) for pattern in skip):
            continue
        if trains:
            line = re.sub(r"\b\d[\d,]* steps\b", f"{SHORT_STEPS} steps", line)
            line = re.sub(r"\bsteps (\d+)\.\.\d+", rf"steps \g<1>..{SHORT_STEPS}", line)
            line = TRAINED.sub(r"\1 ...", line)
        if "  # " not in line and TIMED.search(line):
            line += "  # varies"
        lines.append(on_this_machine(line))
    return lines


@pytest.mark.parametrize("lesson,command,shown", list(commands()))
def test_command_runs(lesson, command, shown, tmp_path):
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MPIPAR_PLOTS=str(tmp_path),  # benchmarks write here, not over plots/
               PATH=f"{bin_dir}{os.pathsep}{Path(find_mpirun()).parent}{os.pathsep}"
                    f"{os.environ['PATH']}")
    cmd = shortened(command)
    try:
        proc = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock? `{cmd}` did not finish in 180 s")
    assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    printed = proc.stdout.rstrip("\n").split("\n")
    if cmd == command:
        assert not shown or output_matches(shown, printed), \
            "the lesson shows:\n" + "\n".join(shown) + "\n\nthe command printed:\n" + proc.stdout
    else:  # a short run: the shown lines it prints too, in this order, among its other lines
        want = short_run_lines(lesson, command, shown)
        assert output_matches(["...", *(x for line in want for x in (line, "..."))], printed), \
            "the lesson shows, as a short run prints them, these lines in this order:\n" + \
            "\n".join(want) + f"\n\n`{cmd}` printed:\n" + proc.stdout


def test_a_shortened_command_shows_the_full_run_s_lines():
    """A training command the test shortens runs its default steps for a learner: its shown
    lines must be that run's (``steps 2..250``), not the test's short run's (``steps 2..3``,
    ``3 steps``), which the test reads them as by itself."""
    short = re.compile(rf"\bsteps \d+\.\.{SHORT_STEPS}\b|\b{SHORT_STEPS} steps\b")
    slips = [(lesson, line) for lesson, command, shown in (c.values for c in commands())
             if short_flags(command).startswith("--steps")
             for line in shown if short.search(line)]
    assert not slips, slips
