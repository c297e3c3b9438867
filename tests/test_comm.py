"""comm under mpirun: results, counted bytes, refusals, and failure of one rank: an exception,
a hung or stopped rank (the watchdog), Ctrl-C, and bad MPIPAR_* environment values."""

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import MPI_SCRIPTS, ROOT, find_mpirun

from mpipar.runner import checkpoint


def test_comm_checks_on_4_ranks(mpirun):
    out = mpirun(4, [MPI_SCRIPTS / "comm_checks.py"], timeout=60)
    assert "comm checks passed" in out.stdout and "non-blocking checks passed" in out.stdout
    assert "count checks passed" in out.stdout
    assert "waiting checks passed: spin, backoff, yield, sleep" in out.stdout


def test_comm_checks_with_synchronous_sends(mpirun):
    out = mpirun(4, [MPI_SCRIPTS / "comm_checks.py"], timeout=60, env={"MPIPAR_SSEND": "1"})
    assert "comm checks passed" in out.stdout and "non-blocking checks passed" in out.stdout
    assert "count checks passed" in out.stdout
    assert "waiting checks passed: spin, backoff, yield, sleep" in out.stdout


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_a_crashing_ranks_traceback_is_never_lost(mpirun, rank):
    """The launcher kills every process on MPI_Abort, its output forwarders too: without the
    grace before the abort, about 1 traceback in 10 never reached mpirun's output here."""
    for _ in range(3):
        proc = mpirun(4, [MPI_SCRIPTS / "crash.py", str(rank)], timeout=30, check=False)
        assert proc.returncode != 0
        assert f"deliberate failure on rank {rank}" in proc.stderr, proc.stderr


def test_one_rank_exception_ends_the_job_quickly(mpirun):
    """Within 15 s of the exception (timed from it, not from the launch: a loaded machine
    starts a job slowly, and that is not what is promised)."""
    proc = mpirun(4, [MPI_SCRIPTS / "crash.py", "2"], timeout=60, check=False)
    ended = time.time()
    assert proc.returncode != 0
    assert "deliberate failure on rank 2" in proc.stderr
    assert "unreachable" not in proc.stdout
    failed = float(re.search(r"failing at (\d+\.\d+)", proc.stdout).group(1))
    assert ended - failed < 15, f"the job took {ended - failed:.1f} s to end after the exception"


def test_waiting_ranks_do_not_spin_when_ranks_outnumber_cores(mpirun):
    """4 ranks on this machine's cores: the ranks that wait must leave the CPU to the others."""
    out = mpirun(4, [MPI_SCRIPTS / "idle_wait.py"], timeout=60,
                 env={"MPIPAR_WAIT": "sleep"} if os.cpu_count() >= 4 else {})
    assert out.stdout.count("waited") == 3


def test_a_spinning_wait_is_caught(mpirun):
    """The same check fails when waiting ranks spin: the test above can fail."""
    proc = mpirun(4, [MPI_SCRIPTS / "idle_wait.py"], timeout=60, check=False,
                  env={"MPIPAR_WAIT": "spin"})
    assert proc.returncode != 0 and "burned" in proc.stderr


# -- never fail silently: a hung rank, Ctrl-C, bad environment values (mpipar/mpi/failure.py)
def test_the_flight_recorder_keeps_the_last_16_calls_and_clears_the_wait():
    from mpi4py import MPI

    from mpipar.mpi import comm as C
    from mpipar.mpi.failure import FLIGHT

    c = C.Comm(MPI.COMM_SELF, "self")
    for step in range(20):
        c.Allreduce(np.ones(2), what=f"step {step}")
    assert len(FLIGHT.recent) == 16 and FLIGHT.waiting is None
    _, name, op, detail, what = FLIGHT.recent[-1]
    assert (name, op, detail, what) == ("self", "Allreduce", "all <-> all (1)", "step 19")


@pytest.mark.parametrize("n,given", [(4, None), (2, None), (4, "yield")])
def test_a_pipeline_stage_sleeps_when_ranks_outnumber_cores(mpirun, n, given):
    """Whatever this machine's cores: sleep when the ranks outnumber them, spin when not, and
    MPIPAR_WAIT when it names a strategy."""
    from mpipar.engine import backend as B

    over = n > B.cores()
    expect = given or ("sleep" if over else "spin")
    out = mpirun(n, [MPI_SCRIPTS / "wait_default.py"], env={"MPIPAR_WAIT": given or ""})
    assert f"waits: {expect} (oversubscribed: {over}, MPIPAR_WAIT: {given})" in out.stdout


def test_the_watchdog_lists_direct_sends_and_receives_without_a_time():
    """A blocking Send or Recv that goes straight to MPI reads no clock: the watchdog's list
    shows it in its place, its time column empty, its partner's rank written out."""
    from mpipar.mpi.failure import hung_lines

    recent = [(9.5, "world", "Bcast", "root 0 -> all", "the weights"),
              (None, "pp", "Send", 1, "micro-batch 0"), (None, "pp", "Recv", 2, "")]
    lines = hung_lines((None, "pp", "Recv", 1, "its gradient"), 7.0, 3, recent, now=10.25)
    assert lines[0] == "watchdog: waited 3.2 s (limit 3 s) in Recv on pp: <- rank 1  (its gradient)"
    assert lines[3:] == ["     -0.750 s  Bcast on world: root 0 -> all  (the weights)",
                         "               Send on pp: -> rank 1  (micro-batch 0)",
                         "               Recv on pp: <- rank 2"]


def test_rank_0_lines_are_one_write_each(monkeypatch):
    """With an unbuffered stdout, ``print`` writes a line and its newline apart, and the
    launcher may put another rank's line between them (a lesson's output lost a line so)."""
    from mpipar.mpi import comm as C
    from mpipar.mpi import explain

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Recorder())
    C.log("header", 3)
    explain.step("DP Step 1")
    assert writes == ["header 3\n", "[rank 0] DP Step 1\n"]


def test_no_watchdog_without_a_positive_limit():
    """In a fresh process: the tests' own in-process runs may have started one here."""
    code = ("from mpipar.mpi import comm, failure\n"
            "for seconds in (None, 0, -1):\n"
            "    comm.start_watchdog(seconds)\n"
            "print('watchdog' in failure._started)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "False", out


def assert_hang_reported(proc, call, limit=3):
    """The job ended by the watchdog, with code 124, naming the call each waiting rank was
    stuck in and showing its flight recorder: past the limit, and within 15 s of the hang by
    the watchdogs' own clock (whatever the machine's speed, not launch to end)."""
    assert proc.returncode == 124, (proc.returncode, proc.stderr)
    err = proc.stderr
    waited = [float(s) for s in re.findall(r"watchdog: waited (\d+\.\d) s", err)]
    assert waited and all(limit <= s < 15 for s in waited), (waited, err)
    assert call in err, err
    assert re.search(r"its last \d+ communication calls", err), err
    assert "Bcast on world: root 0 -> all  (the weights)" in err, err
    assert "unreachable" not in proc.stdout and "Traceback" not in err


def leftovers(stdout):
    """The job's processes still alive (a zombie is dead: it only waits to be reaped)."""
    alive = []
    for pid in map(int, re.findall(r"pid (\d+)", stdout)):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in "ZX":
            alive.append((pid, state))
    return alive


@pytest.mark.parametrize("n,wait", [(4, "sleep"), (2, "spin")])
def test_a_hung_rank_ends_the_job_and_the_others_say_what_they_waited_for(mpirun, n, wait):
    """Rank 1 never calls MPI again; the others wait in an Allreduce (sleeping between polls,
    or blocked inside MPI's own Wait) until their watchdogs abort the job after 3 s."""
    proc = mpirun(n, [MPI_SCRIPTS / "hang.py", "1", "sleep", "3"], timeout=60, check=False,
                  env={"MPIPAR_WAIT": wait})
    call = f"Allreduce on world: all <-> all ({n})  (gradients of step 3)"
    assert_hang_reported(proc, call)
    assert "[rank 1] watchdog" not in proc.stderr  # the hung rank waits for nothing


def test_a_stopped_rank_ends_the_job_and_the_launcher_kills_it_too(mpirun):
    """Rank 1 stops itself (SIGSTOP, as a debugger or Ctrl-Z would): the others' watchdogs end
    the job, and MPICH's launcher kills the stopped process too (SIGKILL works on it)."""
    proc = mpirun(4, [MPI_SCRIPTS / "hang.py", "1", "stop", "3"], timeout=60, check=False)
    assert_hang_reported(proc, "Allreduce on world")
    time.sleep(0.5)
    left = leftovers(proc.stdout)
    for pid, _ in left:  # never leave a stopped process behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job still alive (pid, state): {left}"


@pytest.mark.parametrize("how, wait, says", [
    ("term", "spin", "[rank 2] ended by SIGTERM (signal 15): stopping the job"),
    ("hup", "sleep", "[rank 2] ended by SIGHUP (signal 1): stopping the job"),
])
def test_a_rank_ended_by_a_signal_says_which_and_ends_the_job(mpirun, how, wait, says):
    """Rank 0 sends rank 2 the signal while rank 2 waits inside MPI (blocked in MPI's own Wait,
    or between two polls): rank 2 names itself and the signal, and the job ends with 128 + the
    signal's number, with no process left."""
    proc = mpirun(4, [MPI_SCRIPTS / "hang.py", "2", how, "30"], timeout=60, check=False,
                  env={"MPIPAR_WAIT": wait})
    time.sleep(0.5)
    left = leftovers(proc.stdout)
    for pid, _ in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job still alive (pid, state): {left}"
    assert proc.returncode == 128 + (15 if how == "term" else 1), proc.stderr
    assert proc.stderr.splitlines()[0] == says, proc.stderr
    assert "Traceback" not in proc.stderr and "BAD TERMINATION" not in proc.stdout


def test_the_watchdog_never_reads_the_clock_after_mpi_finalize(mpirun):
    """The watchdog looks every 0.1 ms here: without the lock between its looks and
    MPI_Finalize, a look after the end failed the job with exit code 1 in 6 runs of 6."""
    for _ in range(3):
        proc = mpirun(4, [MPI_SCRIPTS / "exit_race.py"], timeout=60, check=False)
        assert proc.returncode == 0 and proc.stdout.count(" done") == 4, proc.stderr
        assert "Attempting to use an MPI routine" not in proc.stderr, proc.stderr


STOPS = {  # moment of tests/mpi/stop_at.py: the call the others' watchdogs name
    "paths": "Split_type on world: all ranks",  # rank 0's verdict went out eagerly: it waits next
    "machine": "Split_type on world: all ranks  (which ranks share this machine)",
    "grid": "Split on world: all ranks  (the tp groups)",
    "write": "gather on world: all -> root 0 (pickled)  (each rank's pieces)",
    "rename": "bcast on world: root 0 -> all (pickled)  (whether the checkpoint is whole)",
    "load": "bcast on world: root 0 -> all (pickled)  (the manifest)",
    "finalize": "Barrier on world: all ranks  (the end of the job, before MPI_Finalize)",
}


@pytest.mark.parametrize("moment", list(STOPS))
def test_a_rank_stopped_at_any_moment_of_a_run_ends_the_job(mpirun, tmp_path, moment):
    """One rank stops (SIGSTOP) at start-up, while a checkpoint is written or loaded, or at the
    end: the others' watchdogs name the call they wait in and end the job, with no process
    left and the last checkpoint whole."""
    ckpt = tmp_path / "ckpt"
    flags = ["--model", "mlp", "--steps", "4", "--checkpoint-every", "2", "--timeout", "3",
             "--quiet", "--checkpoint", str(ckpt)]
    if moment == "load":
        mpirun(4, ["-m", "mpipar.data_parallel"] + flags, timeout=120)
        flags = flags[:2] + ["--steps", "6"] + flags[4:] + ["--resume", str(ckpt)]
    proc = mpirun(4, [MPI_SCRIPTS / "stop_at.py", moment] + flags, timeout=90, check=False)
    time.sleep(0.5)
    left = leftovers(proc.stdout)
    for pid, _ in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job still alive (pid, state): {left}"
    assert proc.returncode == 124 and STOPS[moment] in proc.stderr, proc.stderr
    waited = [float(s) for s in re.findall(r"watchdog: waited (\d+\.\d) s", proc.stderr)]
    assert waited and max(waited) < 15, waited  # by the watchdogs' own clock, from the stop
    assert ("past the run" in proc.stdout) == (moment == "finalize"), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    if ckpt.exists():  # every step-N folder left is a whole checkpoint
        folders = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))
        assert folders == checkpoint.checkpoints(ckpt), (folders, checkpoint.checkpoints(ckpt))
        assert moment != "load" or folders[-1] == "step-00000004", folders


def test_the_watchdog_watches_pickled_calls_too(mpirun):
    proc = mpirun(4, [MPI_SCRIPTS / "hang.py", "1", "sleep-pickled", "3"], timeout=60,
                  check=False)
    assert_hang_reported(proc, "bcast on world: root 1 -> all (pickled)  (the step number)")


def test_the_watchdog_times_one_call_not_the_run(mpirun):
    """A slow rank keeps the others waiting 0.8 s per call, 6 s in all, under a 2 s limit:
    no call waits 2 s, so the job finishes."""
    out = mpirun(4, [MPI_SCRIPTS / "hang.py", "1", "slow", "2"], timeout=60)
    assert out.stdout.count("done") == 4 and "watchdog" not in out.stderr


def start_mpirun(n, args, env=None):
    """``mpirun -n n python ARGS`` started, not waited for (bytes output, as in conftest)."""
    cmd = [find_mpirun(), "-n", str(n), sys.executable, *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                    PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
                            cwd=ROOT)


def wait_for(proc, text, count, timeout=60):
    """Read proc's stdout until ``text`` has appeared ``count`` times; return what was read."""
    seen, deadline = b"", time.time() + timeout
    while seen.count(text.encode()) < count:
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"never saw {text!r} {count} times:\n{seen.decode()}\n"
                        f"{proc.stderr.read().decode()}")
        if select.select([proc.stdout], [], [], 0.5)[0]:
            seen += os.read(proc.stdout.fileno(), 65536)
    return seen


@pytest.mark.parametrize("where,n,wait", [("compute", 4, ""), ("mpi", 2, "spin"),
                                          ("mpi", 4, "sleep")])
def test_ctrl_c_prints_one_line_and_ends_the_job_with_130(where, n, wait):
    """Ctrl-C to mpirun, which forwards SIGINT to every rank: one line, no traceback per rank.
    ``mpi``: rank 0 is blocked in an Allreduce; with the "spin" wait it is inside MPI's own
    Wait, where Python never raises KeyboardInterrupt, and comm's interrupt thread ends it."""
    proc = start_mpirun(n, [MPI_SCRIPTS / "interrupt.py", where],
                        env={"MPIPAR_WAIT": wait} if wait else {})
    seen = wait_for(proc, "ready", n)
    time.sleep(0.3)  # let rank 0 enter its Allreduce
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("deadlock? Ctrl-C did not end the job in 30 s")
    text = (seen + out + err).decode()
    assert proc.returncode == 130, (proc.returncode, text)
    assert text.count("interrupted (Ctrl-C): stopping every rank") == 1, text
    assert "Traceback" not in text and "BAD TERMINATION" not in text, text
    assert time.time() - t0 < 15, f"Ctrl-C took {time.time() - t0:.1f} s to end the job"


@pytest.mark.parametrize("name,value,expected",
                         [("MPIPAR_WAIT", "foo", "spin or backoff or yield or sleep"),
                          ("MPIPAR_SSEND", "yes", "0 or 1")])
def test_bad_environment_values_are_refused(mpirun, name, value, expected):
    proc = mpirun(2, ["-m", "mpipar.data_parallel", "--steps", "1", "--quiet"], timeout=60,
                  check=False, env={name: value})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    message = f"error: {name}='{value}': expected {expected}, or unset"
    assert proc.stderr.count(message) == 1 and proc.stderr.count("error:") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_flight_recorder_writes_a_blocking_calls_partner_out_when_it_reports():
    """A blocking Send or Recv records its partner's rank alone (no string formatted on a
    ping-pong's path); the report reads as the other calls' do."""
    from mpipar.mpi.failure import _call

    assert _call("world", "Send", 3, "") == "Send on world: -> rank 3"
    assert _call("pp", "Recv", 0, "micro-batch 2") == "Recv on pp: <- rank 0  (micro-batch 2)"
    assert _call("world", "Bcast", "root 0 -> all", "") == "Bcast on world: root 0 -> all"
