"""The FLOP rate one rank sustains while P ranks compute at once (P = 1, 2, 4).

    python -m mpipar.bench flops

Two cores do not give twice one core's FLOP rate when both are busy (shared caches, memory
bandwidth, clock boost), and four ranks on two cores get about half a core each. The cost model
(:mod:`mpipar.simulate`) scales its FLOP rate by ``rate(P) / rate(1)`` measured here, in the
same run as the benchmarks it predicts. Each rank times float32 matrix products of the sizes the
benchmarks use, all ranks starting together after a barrier.
"""

import argparse
import statistics

from mpipar.bench.common import emit, environment, run_ranks, write_csv

N = 512  # float32 (N, N) @ (N, N): 0.27 GFLOP, a few ms on one core
RANKS = (1, 2, 4)


def worker(repeats):
    import numpy as np
    from mpi4py import MPI

    from mpipar import comm as C

    C.install_excepthook()
    w = C.world()
    rng = np.random.default_rng(w.rank)
    a = rng.standard_normal((N, N)).astype(np.float32)
    b = rng.standard_normal((N, N)).astype(np.float32)
    rates = []
    for _ in range(repeats):
        w.Barrier()
        t0 = MPI.Wtime()
        for _ in range(8):
            a @ b
        rates.append(8 * 2 * N**3 / (MPI.Wtime() - t0))
    rate = statistics.median(rates)
    slowest = w.mpi.allreduce(rate, op=MPI.MIN)  # a float, not an array
    if w.rank == 0:
        emit(dict(ranks=w.size, gflops_per_rank=slowest / 1e9))


def measure(quick=False):
    """{ranks: GFLOP/s one rank sustains while that many compute}."""
    repeats = 5 if quick else 15
    return {p: run_ranks(p, "mpipar.bench.flops", ["--worker", "--repeats", repeats])[0]
            ["gflops_per_rank"] for p in RANKS}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mpipar.bench flops")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=15, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.repeats)
        return
    rates = measure(args.quick)
    rows = [dict(environment(p), bench="flops", matmul=f"{N}x{N}x{N} float32",
                 gflops_per_rank=round(r, 3), share_of_one=round(r / rates[1], 4))
            for p, r in rates.items()]
    path = write_csv("flops.csv", rows)
    for row in rows:
        print(f"{row['ranks']} ranks at once: {row['gflops_per_rank']:7.2f} GFLOP/s per rank "
              f"({row['share_of_one']:.2f} of one alone)")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
