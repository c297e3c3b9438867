"""comm under mpirun: results, counted bytes, refusals, and failure of one rank."""

import time

from conftest import MPI_SCRIPTS


def test_comm_checks_on_4_ranks(mpirun):
    out = mpirun(4, [MPI_SCRIPTS / "comm_checks.py"], timeout=60)
    assert "comm checks passed" in out.stdout


def test_comm_checks_with_synchronous_sends(mpirun):
    mpirun(4, [MPI_SCRIPTS / "comm_checks.py"], timeout=60, env={"MPIPAR_SSEND": "1"})


def test_one_rank_exception_ends_the_job_quickly(mpirun):
    t0 = time.time()
    proc = mpirun(4, [MPI_SCRIPTS / "crash.py", "2"], timeout=30, check=False)
    elapsed = time.time() - t0
    assert proc.returncode != 0
    assert "deliberate failure on rank 2" in proc.stderr
    assert "unreachable" not in proc.stdout
    assert elapsed < 10, f"the job took {elapsed:.1f} s to end"
