"""mpirun -n 4 python lessons/code/00_ring_allreduce.py

Lesson 0, part 5: the ring allreduce, the algorithm behind data parallelism, in 20 lines.

The array is cut into p chunks. The ranks stand in a ring; each sends only to its right
neighbour and receives only from its left one, with Sendrecv (no deadlock, lesson 0 part 3).
1. Reduce-scatter, p - 1 steps: pass a chunk right, add the chunk that arrives from the left
   into your own copy. After p - 1 steps, rank r holds chunk r + 1 summed over every rank.
2. Allgather, p - 1 steps: pass the finished chunks around the ring, overwriting.
Each rank sends 2 (p - 1) chunks of n / p values: 2 (p - 1) / p * n values, almost 2 n,
whatever p is. Checked against MPI's Allreduce.
"""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
right, left = (rank + 1) % p, (rank - 1) % p


def ring_allreduce(x):
    """Sum x over every rank, in place. Returns the bytes this rank sent."""
    chunks = np.array_split(x, p)  # p views into x (sizes differ by at most one)
    sent = 0
    # 1. reduce-scatter: at step s, send chunk r - s, receive chunk r - s - 1 and add it in
    for s in range(p - 1):
        out, into = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        arrived = np.empty_like(into)
        comm.Sendrecv(out, dest=right, recvbuf=arrived, source=left)
        into += arrived
        sent += out.nbytes
    # 2. allgather: at step s, send the finished chunk r + 1 - s, receive chunk r - s
    for s in range(p - 1):
        out, into = chunks[(rank + 1 - s) % p], chunks[(rank - s) % p]
        comm.Sendrecv(out, dest=right, recvbuf=into, source=left)
        sent += out.nbytes
    return sent


def slowest_median(fn, x, repeats=5):
    times = []
    for _ in range(repeats):
        y = x.copy()
        comm.Barrier()
        t0 = MPI.Wtime()
        fn(y)
        times.append(comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX))
    return float(np.median(times))


n = 1_200_000  # divisible by 2, 3, 4, 5, 6 and 8: equal chunks
x = np.random.default_rng(rank).integers(-1000, 1000, n).astype(np.float64)  # exact sums
mine = x.copy()
sent = ring_allreduce(mine)
want = x.copy()
comm.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
formula = 2 * (p - 1) * n * 8 // p

t_ring = slowest_median(ring_allreduce, x)
t_mpi = slowest_median(lambda y: comm.Allreduce(MPI.IN_PLACE, y), x)
if rank == 0:
    print(f"ring allreduce of {n:,} float64 on {p} ranks equals MPI's Allreduce: "
          f"{np.array_equal(mine, want)}")
    print(f"bytes sent per rank: {sent:,} (2 (p - 1) / p * n * 8 = {formula:,})")
    print(f"ring {t_ring * 1e3:.1f} ms, MPI's Allreduce {t_mpi * 1e3:.1f} ms")

# -- the checks, on every rank
assert np.array_equal(mine, want)
assert sent == formula or n % p != 0
for n_small in (1, p - 1, p + 1, 10):  # fewer values than ranks, and chunks of unequal size
    y = np.arange(n_small, dtype=np.float64) * (rank + 1)
    ring_allreduce(y)
    assert np.array_equal(y, np.arange(n_small) * p * (p + 1) / 2), n_small
