"""Data parallelism under mpirun: every sync mode equals the serial trainer, on 1 to 4 ranks,
with and without synchronous sends; the command line reports what the serial trainer reports;
bad input ends every rank with one message."""

import re

import pytest
from conftest import MPI_SCRIPTS, assert_matches_serial, assert_refused, run_mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_mode_equals_serial(mpirun, n):
    out = mpirun(n, [MPI_SCRIPTS / "dp_checks.py"], timeout=90)
    assert f"dp checks passed on {n} ranks" in out.stdout


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_mode_with_synchronous_sends(mpirun, n):
    """MPIPAR_SSEND=1: a send completes only once received, so no ordering that relies on MPI
    buffering a message can pass."""
    out = mpirun(n, [MPI_SCRIPTS / "dp_checks.py"], timeout=90, env={"MPIPAR_SSEND": "1"})
    assert f"dp checks passed on {n} ranks" in out.stdout


def ring_check(n, script="ring_check.py", *args):
    """ring_check.py's verdict line (or the run's error lines when it did not get that far)."""
    proc = run_mpi(n, [MPI_SCRIPTS / script, *args], timeout=60, env={"MPIPAR_SSEND": "1"},
                   check=False)
    said = [line for line in proc.stdout.splitlines() if line.startswith("ring check:")]
    hung = [f"deadlock: {line.strip()}" for line in proc.stderr.splitlines()
            if "watchdog: waited" in line]
    errors = [line for line in proc.stderr.splitlines()  # the exception's line, not its source
              if re.match(r"\w+(Error|Exception): ", line)]
    ended = [f"exited early (exit code {proc.returncode} before the check's verdict): exercise "
             "code must return, not call sys.exit()"]
    return proc.returncode, (said or hung or errors or ended)[0]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_ring_alone_chunk_by_chunk(n):
    """The student track's direct check of ring-allreduce: every rank's every chunk the sum,
    2(P-1) Sendrecvs and nothing else, each sending what the docstring's ring sends."""
    code, said = ring_check(n)
    if said != f"ring check: passed (on {n} ranks, {4 * n + 1} values)" or code != 0:
        raise AssertionError(said)  # the check's own sentence, as the grader shows it


@pytest.mark.parametrize("kind, says", [
    ("mean", "your result is 1/P of the sum (the mean over 4 ranks)"),
    ("copy", "the buffer never changed: write the sum into buf in place"),
    ("allreduce", "ring_allreduce called Allreduce: write the ring from Sendrecv alone"),
    ("skip", "rank 0, chunk 0, element 0 holds the values of rank 3, not the sum of all 4; "
             "first wrong send: rank 0, allgather step 1: sent chunk 1, but its element 5 "
             "holds the values of rank 0; the ring's holds the values of ranks 0, 1, 2, 3"),
    ("left", "ValueError: Sendrecv from "),
])
def test_the_ring_check_names_each_planted_mistake(kind, says):
    code, said = ring_check(4, "ring_mistakes.py", kind)
    assert code != 0 and says in said, said


def test_command_line_matches_serial(mpirun, tmp_path, capsys):
    flags = ["--model", "mlp", "--steps", "4", "--batch-size", "10", "--dtype", "float64",
             "--quiet"]
    saved = tmp_path / "dp.npz"
    out = mpirun(3, ["-m", "mpipar.data_parallel", *flags, "--micro-batches", "2", "--explain",
                     "--save-params", saved], timeout=60).stdout
    assert_matches_serial(out, flags, saved, tmp_path, capsys)
    # --explain: every rank narrates each of the five seed steps of the first step only
    for rank in range(3):
        for step in range(1, 6):
            assert out.count(f"[rank {rank}] DP Step {step}:") == 1, (rank, step, out)
    assert "[rank 1, dp 1] Reduce" in out and "[rank 2, dp 2] Scatterv" in out


BAD = {
    "more ranks than rows": (4, ["--batch-size", "3"], "cannot be split over 4 ranks"),
    "zero batch": (2, ["--batch-size", "0"], "--batch-size must be positive"),
    "negative batch": (2, ["--batch-size", "-4"], "--batch-size must be positive"),
    "unknown sync mode": (2, ["--sync", "tree"], "invalid choice: 'tree'"),
    "zero with master": (2, ["--zero", "1"], "use --sync allreduce --zero 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_on_every_rank(case):
    n, flags, message = BAD[case]
    assert_refused(n, "data_parallel", flags, message)


def test_any_mlp_width_on_synthetic_data_matches_serial(mpirun, tmp_path, capsys):
    """--data synthetic: the same rows on every rank and in the serial run, at any width."""
    flags = ["--model", "mlp", "--data", "synthetic", "--sizes", "100,48,7", "--samples", "500",
             "--steps", "4", "--batch-size", "13", "--dtype", "float64", "--quiet"]
    saved = tmp_path / "dp.npz"
    out = mpirun(3, ["-m", "mpipar.data_parallel", "--sync", "ring", *flags,
                     "--save-params", saved], timeout=60).stdout
    assert_matches_serial(out, flags, saved, tmp_path, capsys)
