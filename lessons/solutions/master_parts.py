"""The seed's master exchange taken apart: Reduce and Bcast timed separately, beside their
alpha-beta(-gamma) models with the alpha, beta and gamma of plots/net.csv, and the Reduce
written by hand as the literal master: the root receives each worker's array in turn and adds
it with NumPy (the same bytes and the same sums as MPI's Reduce).

    mpirun -n 2 python lessons/solutions/master_parts.py        # 16 MiB of float64

Every call goes through mpipar.mpi.comm, as in the benchmark; the median of 9 after 2 warm-ups,
the slowest rank's, three rounds taken in turn so that other work on the machine hits all.
"""

import csv
from pathlib import Path

import numpy as np
from mpi4py import MPI

from mpipar.mpi.comm import Comm

world = Comm(MPI.COMM_WORLD)
n_bytes = 16 * 2**20
buf, out = np.ones(n_bytes // 8), np.zeros(n_bytes // 8)
net = csv.DictReader(open(Path(__file__).parents[2] / "plots" / "net.csv"))
ping = next(r for r in net if r["kind"] == "pingpong")
alpha, beta, gamma = (float(ping[k]) for k in ("alpha", "beta", "gamma"))


def median_ms(fn, repeats=9, warmup=2):
    times = []
    for _ in range(warmup + repeats):
        MPI.COMM_WORLD.Barrier()
        t = MPI.Wtime()
        fn()
        times.append(MPI.Wtime() - t)
    slowest = MPI.COMM_WORLD.allreduce(sorted(times[warmup:])[repeats // 2], op=MPI.MAX)
    return slowest * 1e3


def reduce_by_hand():
    """Each worker sends its array to rank 0, which receives them one by one and adds them."""
    if world.rank == 0:
        out[:] = buf
        for source in range(1, world.size):
            world.Recv(scratch, source=source)
            np.add(out, scratch, out=out)
    else:
        world.Send(buf, dest=0)


scratch = np.empty_like(buf)
calls = {"Reduce": lambda: world.Reduce(buf, out, root=0),
         "Reduce by hand": reduce_by_hand,
         "Bcast": lambda: world.Bcast(out, root=0),
         "Reduce + Bcast": lambda: (world.Reduce(buf, out, root=0), world.Bcast(out, root=0))}
model = {"Reduce": alpha + n_bytes * (beta + gamma), "Bcast": alpha + n_bytes * beta,
         "Reduce by hand": (world.size - 1) * (alpha + n_bytes * (beta + gamma))}
model["Reduce + Bcast"] = model["Reduce"] + model["Bcast"]
rounds = {name: [] for name in calls}
for _ in range(3):
    for name, fn in calls.items():
        rounds[name].append(median_ms(fn))
if world.rank == 0:
    print(f"{world.size} ranks, {n_bytes / 2**20:.0f} MiB; alpha {alpha * 1e6:.2f} us, "
          f"beta {beta * 1e9:.4f} ns/B, gamma {gamma * 1e9:.4f} ns/B (plots/net.csv)")
    for name, ms in rounds.items():
        print(f"{name:15s} measured {' '.join(f'{m:6.2f}' for m in ms)} ms   model "
              f"{model[name] * 1e3:5.2f} ms   ratio {np.median(ms) / (model[name] * 1e3):5.1f}")
