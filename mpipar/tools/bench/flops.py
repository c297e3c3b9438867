"""The FLOP rate one rank sustains while k of P ranks compute at once and the others wait.

    python -m mpipar.tools.bench flops          # flops.csv in --out (see mpipar.tools.bench)

Two cores do not give twice one core's FLOP rate when both are busy (shared caches, memory
bandwidth, clock boost), and four ranks on two cores get about half a core each. When only
some of the ranks compute (a pipeline's warm-up, a stage that waits for its input), the others
wait in :func:`mpipar.mpi.comm.wait`: with more ranks than cores they sleep between polls, and each
wake-up can take a core from a rank that computes (two computing and two waiting ranks on two
cores: about 0.8 of a core each, not 1). The cost model (:mod:`mpipar.tools.simulate`) scales its
FLOP rate by ``share = rate(k of P) / rate(1 of 1)`` measured here, in the same run as the
benchmarks it predicts: for P = 1 and 2 with every rank computing, and for P = 4 with
k = 1, 2, 3, 4. Each computing rank times float32 matrix products of the sizes the benchmarks
use, all starting together after a barrier; a waiting rank waits for a message rank 0 sends
when it is done. Times run from the first computing rank's start, on the machine's one
monotonic clock (each rank's own clock would flatter sharing: a rank that the scheduler leaves
off a core after the barrier starts it late). Two rates per k:

- ``gflops_per_rank``, ``share_of_one``: one rank's work over the makespan, to the LAST
  rank's end: the pace of ranks in lockstep (replicas that wait for the slowest, tensor-
  parallel peers with a collective after each layer). 4 of 4 here: about 0.47 of one core;
  the data-parallel benchmark's forward and backward on 4 ranks at once also give 0.47.
- ``gflops_mean``, ``share_mean``: the mean over the computing ranks of work / own end: the
  speed of ranks that do not wait for one another, such as pipeline stages. It differs most
  for 3 ranks on 2 cores: the scheduler tends to leave one alone on a core (about 1.0) and
  two sharing the other (0.5 each): 0.67 on average, 0.5 for the last.
"""

import argparse
import statistics
import time

from mpipar.tools.bench.common import (
    bench_parser,
    emit,
    environment,
    number,
    run_ranks,
    write_csv,
    wrote,
)

N = 512  # float32 (N, N) @ (N, N): 0.27 GFLOP, a few ms on one core
REPS = 8  # products per rank and repeat
RANKS = (1, 2, 4)
PARTIAL = 4  # with this many ranks, measure every number of computing ranks


def worker(repeats, computing):
    import numpy as np

    from mpipar.mpi import comm as C

    C.install_excepthook()
    C.choose_wait()  # as the runner does: how a rank waits on this machine
    w = C.world()
    rng = np.random.default_rng(w.rank)
    a = rng.standard_normal((N, N)).astype(np.float32)
    b = rng.standard_normal((N, N)).astype(np.float32)
    done = np.zeros(1)
    spans = []  # (start, end) of this rank's products, one clock for all ranks of a machine
    for _ in range(repeats):
        w.Barrier()
        if w.rank < computing:
            t0 = time.monotonic()
            for _ in range(REPS):
                a @ b
            spans.append((t0, time.monotonic()))
            if w.rank == 0:  # the waiting ranks wait until rank 0 is done
                for r in range(computing, w.size):
                    w.Send(done, r)
        else:
            w.Recv(done, 0)
    spans = w.mpi.gather(spans)  # floats: pickled
    if w.rank == 0:
        work = REPS * 2 * N**3
        last, each = [], []  # per repeat: the last rank's rate; the mean of each rank's rate
        for run in zip(*spans[:computing]):
            start = min(s for s, _ in run)
            last.append(work / (max(e for _, e in run) - start))
            each.append(statistics.mean(work / (e - start) for _, e in run))
        emit(dict(ranks=w.size, computing=computing,
                  gflops_per_rank=statistics.median(last) / 1e9,
                  gflops_mean=statistics.median(each) / 1e9))


def measure(repeats=15):
    """{(ranks, computing): {"gflops_per_rank": the pace of the last computing rank,
    "gflops_mean": the mean over the computing ranks}}, each the median of ``repeats``."""
    runs = [(p, p) for p in RANKS] + [(PARTIAL, k) for k in range(1, PARTIAL)]
    return {(p, k): run_ranks(p, "mpipar.tools.bench.flops", ["--worker", "--repeats", repeats,
                                                        "--computing", k])[0]
            for p, k in runs}


def main(argv=None):
    ap = bench_parser("flops")
    ap.sized("--repeats", 15, 5, type=number(), help="timed repeats per configuration (median)")
    ap.add_argument("--computing", type=number(), default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.repeats, args.computing)
        return
    rates = measure(args.repeats)
    one = rates[(1, 1)]["gflops_per_rank"]
    rows = [dict(environment(p), bench="flops", matmul=f"{N}x{N}x{N} float32", computing=k,
                 gflops_per_rank=round(r["gflops_per_rank"], 3),
                 share_of_one=round(r["gflops_per_rank"] / one, 4),
                 gflops_mean=round(r["gflops_mean"], 3),
                 share_mean=round(r["gflops_mean"] / one, 4))
            for (p, k), r in sorted(rates.items())]
    path = write_csv("flops.csv", rows, args.out)
    for row in rows:
        print(f"{row['computing']} of {row['ranks']} ranks computing: "
              f"{row['gflops_per_rank']:7.2f} GFLOP/s per rank by the last to finish "
              f"({row['share_of_one']:.2f} of one alone), {row['gflops_mean']:7.2f} on average "
              f"({row['share_mean']:.2f})")
    wrote(path)


if __name__ == "__main__":
    main()
