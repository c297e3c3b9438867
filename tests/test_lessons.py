"""The course stays true to the code: citations resolve, commands run, pictures exist.

A lesson cites code as `mpipar/<file>.py > Step N` (a banner ``# -- XX Step N: ...`` in that
file) or `mpipar/<file>.py > Name` / `> Class.method` (a definition found with ast). Commands
are the ``$ ...`` lines of ```console blocks; each one runs from the repository root and must
exit 0. Training commands that set no ``--steps`` run shortened to 3 steps (``--steps 3
--quiet`` added before any pipe) and benchmarks with ``--quick``, so the suite stays fast.
Benchmarks write into a scratch folder (``MPIPAR_PLOTS``), never over the committed plots.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, find_mpirun

LESSONS = sorted((ROOT / "lessons").glob("*.md"))
CITE = re.compile(r"`(mpipar/[\w/]+\.py) > ([^`]+)`")
PICTURE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")
TRAINERS = re.compile(r"-m mpipar\.(serial|data_parallel|tensor_parallel|pipeline|hybrid)\b")


def citations():
    for lesson in LESSONS:
        for path, target in CITE.findall(lesson.read_text()):
            yield pytest.param(lesson.name, path, target.strip(), id=f"{lesson.stem}:{target}")


def commands():
    for lesson in LESSONS:
        for block in re.findall(r"```console\n(.*?)```", lesson.read_text(), re.S):
            for line in block.splitlines():
                line = line.strip()  # a block indented under a list item counts too
                if line.startswith("$ "):
                    yield pytest.param(line[2:], id=f"{lesson.stem}:{line[2:60]}")


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
    step = re.fullmatch(r"Step (\d+)", target)
    if step:
        banner = re.compile(rf"^\s*# -- \w+ Step {step.group(1)}:", re.M)
        assert banner.search(source.read_text()), \
            f"{lesson} cites {path} > {target}, but no '# -- .. Step {step.group(1)}:' banner"
    else:
        assert target in defined_names(source), f"{lesson} cites {path} > {target}: not defined"


@pytest.mark.parametrize("lesson", [p.name for p in LESSONS])
def test_pictures_exist(lesson):
    text = (ROOT / "lessons" / lesson).read_text()
    for ref in PICTURE.findall(text):
        assert (ROOT / "lessons" / ref).resolve().exists(), f"{lesson} shows {ref}: missing"


def shortened(command):
    """The command with its flags for a short run added to its first part (before any pipe)."""
    first, pipe, rest = command.partition(" | ")
    if TRAINERS.search(first) and not re.search(r"--help|--print|--steps", first):
        first += " --steps 3 --quiet"
    elif "-m mpipar.bench" in first and "--help" not in first:
        first += " --quick"
    return first + pipe + rest


@pytest.mark.parametrize("command", list(commands()))
def test_command_runs(command, tmp_path):
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
