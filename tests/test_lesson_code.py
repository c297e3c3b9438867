"""The first floor of the course: lesson 0 (bare mpi4py), the debugging lesson, the glossary.

tests/test_lessons.py runs every ``$`` command of every lesson and compares what it prints
with the lines the lesson shows (the deadlock's included: send-first passes 4,096 bytes and
hangs at 8,192, Ssend hangs at 8, timeout ends both). This file checks what those lines
cannot:

- every snippet under lessons/code/ (00_* and 10_*) is run by some lesson command;
- the snippets' own asserts on other numbers of ranks than the lessons show (uneven chunks,
  trees that are not full);
- the ping-pong's alpha and beta: positive, and the numbers derived from them consistent;
- the two-terminal session of lesson 10 (``kill -USR1`` prints one rank's stack);
- the glossary: every link resolves, to a heading where it names one, and every term is used
  in some lesson.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, find_mpirun

LESSONS = ROOT / "lessons"
GLOSSARY = LESSONS / "glossary.md"
SNIPPETS = sorted([*LESSONS.glob("code/00_*.py"), *LESSONS.glob("code/10_*.py")])


def run(command, timeout=120):
    """A shell command from the repository root, as the lessons run it: stdout and stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{Path(find_mpirun()).parent}"
                    f"{os.pathsep}{os.environ['PATH']}")
    try:
        return subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock? `{command}` did not finish in {timeout} s")


def test_every_snippet_is_run_by_a_lesson():
    commands = "\n".join(line for p in LESSONS.glob("*.md")
                         for block in re.findall(r"```console\n(.*?)```", p.read_text(), re.S)
                         for line in block.splitlines() if line.startswith("$ "))
    assert len(SNIPPETS) >= 9, SNIPPETS
    unrun = [p.name for p in SNIPPETS if f"lessons/code/{p.name}" not in commands]
    assert not unrun, f"snippets no lesson command runs: {unrun}"


def test_no_snippet_of_lesson_0_imports_mpipar():
    for path in LESSONS.glob("code/00_*.py"):
        assert not re.search(r"^\s*(import|from) mpipar", path.read_text(), re.M), path.name


@pytest.mark.parametrize("n,tree", [(3, [2, 0, 0]), (5, [3, 0, 1, 0, 0])])
def test_the_hand_written_collectives_on_uneven_numbers_of_ranks(n, tree):
    """The snippets assert their results against MPI's own: run them where the ring's chunks
    and the binomial tree are uneven. On 5 ranks the root sends to 4, 2 and 1, and rank 2 to 3."""
    for script in ("00_ring_allreduce.py", "00_bcast_reduce.py"):
        proc = run(f"mpirun -n {n} python lessons/code/{script}")
        assert proc.returncode == 0, f"{script} on {n} ranks\n{proc.stdout}\n{proc.stderr}"
    for op, verb in (("bcast", "sent"), ("reduce", "received")):
        line = f"{op} tree equals MPI's: yes messages {verb} by each rank: {tree}"
        assert line in [" ".join(s.split()) for s in proc.stdout.splitlines()], proc.stdout


def test_the_ping_pong_reports_a_consistent_alpha_and_beta():
    """No bound on the times themselves (they vary a thousandfold with load; timing belongs to
    benchmarks): the sizes, the signs, and the derived numbers agree with alpha and beta."""
    proc = run("mpirun -n 2 python lessons/code/00_pingpong.py")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:8]]
    assert [int(r[0]) for r in rows] == [8 * 8**k for k in range(7)], proc.stdout
    alpha, beta, gbs, n_half = (float(x.replace(",", "")) for x in re.search(
        r"alpha = ([\d.]+) us\s+beta = ([\d.]+) ns/byte \(([\d.]+) GB/s\)\n"
        r"below n = alpha / beta = ([\d,]+) bytes", proc.stdout).groups())
    assert alpha > 0 and beta > 0, proc.stdout
    assert gbs == pytest.approx(1 / beta, rel=0.1, abs=0.1)  # GB/s is 1 / (ns per byte)
    assert n_half == pytest.approx(alpha * 1e3 / beta, rel=0.1)  # printed rounded
    model = [float(r[3]) for r in rows]  # alpha + n beta, in us
    assert model == pytest.approx([alpha + n * beta * 1e-3 for n in [8 * 8**k for k in range(7)]],
                                  rel=0.05, abs=0.1)


def test_kill_usr1_prints_one_ranks_stack_and_the_job_goes_on():
    """The lesson's two-terminal session: start the hanging job, signal rank 2, read its
    stack; the watchdog then ends the job as usual."""
    cmd = [find_mpirun(), "-n", "4", sys.executable, "lessons/code/10_hang.py", "--timeout", "6"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any("step 2 done" in line for line in lines):
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)
        pid = int(re.search(r"rank 2 pid (\d+)", "".join(lines)).group(1))
        time.sleep(1.5)  # rank 2 may still be finishing step 2's Allreduce: let it reach its loop
        os.kill(pid, signal.SIGUSR1)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 124, out
    assert re.search(r'10_hang\.py", line \d+ in wait_for_data_loader', out), out
    assert "[rank 2] watchdog" not in out  # the hung rank waits for nothing


# -- the glossary
def glossary_entries():
    """(term, its other spellings, the lessons it links to) per ``- **term** (also: ...)``."""
    entries = []
    text = re.sub(r"\n  +", " ", GLOSSARY.read_text())  # an entry's indented lines join it
    for line in text.splitlines():
        m = re.match(r"- \*\*(.+?)\*\*(?: \(also: ([^)]*)\))?", line)
        if m:
            spellings = [m.group(1)] + [s.strip() for s in (m.group(2) or "").split(",") if s]
            entries.append((m.group(1), spellings, re.findall(r"\]\(([^)]+)\)", line)))
    return entries


def test_every_glossary_link_resolves():
    entries = glossary_entries()
    assert len(entries) >= 30, len(entries)
    for term, _, links in entries:
        assert links, f"glossary: {term} links to no lesson"
        for link in links:
            path, _, anchor = link.partition("#")
            target = ROOT / "lessons" / path
            assert target.exists(), f"glossary: {term} links to {link}: no such file"
            if anchor:
                headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                            for h in re.findall(r"^#+ (.*)$", target.read_text(), re.M)}
                assert anchor in headings, f"glossary: {term} links to {link}: no such heading"


def test_every_glossary_term_is_used_in_a_lesson():
    lessons = " ".join(p.read_text().lower() for p in (ROOT / "lessons").glob("*.md")
                       if p != GLOSSARY)
    unused = [term for term, spellings, _ in glossary_entries()
              if not any(s.lower() in lessons for s in spellings)]
    assert not unused, f"glossary terms no lesson uses: {unused}"
