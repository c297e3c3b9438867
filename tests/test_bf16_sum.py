"""The bf16 SUM MPI lacks: a user-defined operation on 2-byte words against the fp32 sum, on
2, 3 and 4 ranks (tests/mpi/bf16_checks.py): half the bytes, the same bits on every rank, and
each within its rounding bound of the exact sum."""

import pytest
from conftest import MPI_SCRIPTS


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_bf16_sum_halves_the_bytes_within_its_bound(mpirun, n):
    out = mpirun(n, [MPI_SCRIPTS / "bf16_checks.py"], timeout=120).stdout
    assert f"bf16 sum checks passed on {n} ranks" in out, out
    assert f"100000 values on {n} ranks: bytes a rank sends bf16 200,000, fp32 400,000" in out


@pytest.mark.parametrize("call, instead", [("Allreduce", "bf16.bf16_sum"),
                                           ("Reduce_scatter", "bf16.reduce_scatter")])
def test_a_plain_sum_of_bf16_words_is_refused(call, instead):
    """MPI's SUM would add bf16's 2-byte words as integers: both reductions refuse it before
    any message (a one-rank communicator), and name the sum to use instead."""
    import numpy as np

    from mpipar.engine.precision import dtype_of
    from mpipar.mpi import comm

    world, words = comm.world(), np.ones(4, dtype=dtype_of("bf16"))
    says = rf"{call}: MPI has no bf16 arithmetic .* mpipar\.mpi\.{instead}"
    with pytest.raises(TypeError, match=says):
        if call == "Allreduce":
            world.Allreduce(words)
        else:
            world.Reduce_scatter(words, np.empty(4 // world.size, dtype=words.dtype))
