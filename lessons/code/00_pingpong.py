"""mpirun -n 2 python lessons/code/00_pingpong.py

Lesson 0, part 2: measure alpha (the latency of one message) and beta (seconds per byte).
Rank 0 sends n bytes to rank 1, which sends them back: half the round trip is one message.
The model says one message of n bytes takes alpha + n * beta. Small messages give alpha
(n * beta is negligible there: the median of the three smallest); the largest gives beta
(alpha is negligible there: its time divided by its size).
"""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
assert comm.Get_size() == 2, "run with mpirun -n 2"
other = 1 - rank
SIZES = [8 * 8**k for k in range(7)]  # 8 B .. 2 MiB
ROUND_TRIPS, REPEATS = 10, 5


def one_way_time(n_bytes):
    """The fastest of REPEATS runs of ROUND_TRIPS round trips, per one-way message. The
    fastest, not the median: other programs on the machine can only ever add time."""
    buf = np.zeros(n_bytes, dtype=np.uint8)
    times = []
    for _ in range(REPEATS + 1):  # the first repeat is a warm-up and is dropped
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(ROUND_TRIPS):
            if rank == 0:
                comm.Send(buf, dest=other)
                comm.Recv(buf, source=other)
            else:
                comm.Recv(buf, source=other)
                comm.Send(buf, dest=other)
        times.append((MPI.Wtime() - t0) / (2 * ROUND_TRIPS))
    return min(times[1:])


times = [one_way_time(n) for n in SIZES]
alpha = float(np.median(times[:3]))
beta = times[-1] / SIZES[-1]
if rank == 0:
    print(f"{'bytes':>10} {'measured':>12} {'alpha + n beta':>15}")
    for n, t in zip(SIZES, times):
        print(f"{n:>10} {t * 1e6:>9.1f} us {(alpha + n * beta) * 1e6:>12.1f} us")
    print(f"alpha = {alpha * 1e6:.1f} us   beta = {beta * 1e9:.3f} ns/byte "
          f"({1e-9 / beta:.1f} GB/s)")
    print(f"below n = alpha / beta = {alpha / beta:,.0f} bytes, latency is most of the cost")

assert len(times) == len(SIZES) and alpha > 0 and beta > 0
