"""mpirun -n P python tests/mpi/bf16_checks.py: the two sums of bf16 gradients.

Each rank holds its own seeded bf16 values (1,000 and 100,000 of them: MPICH reduces small
and large messages with different algorithms). For each size, on every rank:
- the bf16 sum (a user-defined operation on 2-byte words) sends and receives the array's
  bytes, the fp32 sum twice that (Comm.stats);
- every rank ends with the same bits, whatever order MPI reduced in (the operation is
  commutative, so the pairs of a tree or a ring compute the same sums);
- against the exact sum of the bf16 values (float64), the fp32 sum is off by at most its one
  rounding to bf16 (2^-8 of the sum) and float32's own 2^-24 per addition; the bf16 sum by
  the p - 1 roundings of its partial sums, each at most 2^-8 of the sum of magnitudes (the
  test allows p of them).
It prints the worst errors, relative to the sum of magnitudes.
"""

import sys

import ml_dtypes
import numpy as np

from mpipar.mpi import comm as C
from mpipar.mpi.bf16 import bf16_sum, fp32_sum

C.install_excepthook()
world = C.world()
P, U = world.size, 2.0 ** -8  # U: half a bf16 unit in the last place, relative


def values(rank, n):
    return np.random.default_rng(100 + rank).standard_normal(n).astype(ml_dtypes.bfloat16)


def fail(what):
    sys.stderr.write(f"[rank {world.rank}] FAILED: {what}\n")
    world.mpi.Abort(1)


for n in (1_000, 100_000):
    mine = values(world.rank, n)
    exact = sum(values(r, n).astype(np.float64) for r in range(P))
    magnitude = sum(np.abs(values(r, n).astype(np.float64)) for r in range(P))
    errors = {}
    for name, fn, wire in (("bf16", bf16_sum, 2 * n), ("fp32", fp32_sum, 4 * n)):
        buf = mine.copy()
        world.reset_stats()
        fn(world, buf)
        if world.stats["Allreduce"]["sent"] != wire:
            fail(f"{name} sum of {n}: sent {world.stats['Allreduce']['sent']}, not {wire}")
        if len(set(world.allgather_obj(buf.tobytes()))) != 1:
            fail(f"{name} sum of {n}: the ranks ended with different bits")
        err = np.abs(buf.astype(np.float64) - exact)
        bound = P * U * magnitude if name == "bf16" else \
            U * np.abs(exact) + P * 2.0 ** -24 * magnitude
        if (err > bound).any():
            fail(f"{name} sum of {n}: an error of {err.max():.3g} above its bound")
        errors[name] = float((err / magnitude).max())
    C.log(f"{n} values on {P} ranks: bytes a rank sends bf16 {2 * n:,}, fp32 {4 * n:,}; worst "
          f"error over the sum of magnitudes bf16 {errors['bf16']:.2e}, fp32 {errors['fp32']:.2e}")
C.log(f"bf16 sum checks passed on {P} ranks")
