"""Data parallelism under mpirun: every sync mode equals the serial trainer, on 1 to 4 ranks,
with and without synchronous sends; the command line reports what the serial trainer reports;
bad input ends every rank with one message."""

import pytest
from conftest import MPI_SCRIPTS, assert_matches_serial, assert_refused


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
