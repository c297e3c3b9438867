"""The network model every other benchmark leans on: latency alpha and seconds per byte beta,
fitted to a ping-pong between two ranks, then the time of an allreduce against its size for
three algorithms, measured and predicted by the alpha-beta(-gamma) formulas of
lessons/formulas.md#collectives.

    python -m mpipar.tools.bench net   # net.csv and net_allreduce.png in --out

1. Ping-pong (2 ranks): rank 0 sends n bytes, rank 1 sends them back; half the round trip is
   t(n) = alpha + n beta. Sizes 8 B to 16 MiB; alpha and beta by least squares on the RELATIVE
   error (each equation divided by its t), so the 8-byte and the 16 MiB messages weigh alike.
   The messages go through mpipar.mpi.comm, so alpha includes its checks and bookkeeping: the
   latency the schemes really pay.
2. gamma (seconds per byte reduced): one NumPy ``a += b`` over 16 MiB on one thread.
3. Allreduce of n bytes of float64 on P = 2 and P = 4 ranks (4 ranks on 2 cores is
   oversubscribed: the model assumes one core per rank and is not expected to hold there):
   - master: Reduce(SUM) to rank 0, then Bcast (the seed's steps 4-5);
     predicted 2 lg P (alpha + n beta) + lg P n gamma (binomial trees);
   - mpi: MPI's own Allreduce; predicted by the faster of recursive doubling,
     lg P (alpha + n beta + n gamma), and ring, 2(P-1) alpha + 2(P-1)/P n beta + (P-1)/P n gamma
     (MPICH switches from the first to a bandwidth-optimal one as n grows);
   - ring: :func:`mpipar.data_parallel.ring_allreduce`, written from Sendrecv; predicted by the
     ring formula.
4. Allreduce between computations on 4 ranks, as tensor parallelism calls it ("lockstep"):
   every rank multiplies two (256, 256) matrices, then allreduces n bytes, again and again.
   With more ranks than cores, ranks take turns on the cores: the ones that finish their
   multiply first sleep in :func:`mpipar.mpi.comm.wait` while the others compute, and each step of
   the allreduce waits for a partner to be woken up. What an iteration takes beyond the
   multiply alone (timed first, without collectives, while every rank multiplies) is what a
   collective costs ranks that share cores; the cost model fits its alpha and beta for such
   runs to these times (:func:`mpipar.tools.validate.oversubscribed_alpha_beta`). In back-to-back
   allreduces (3.) every rank is already awake and this cost hardly shows.

Other benchmarks call :func:`measure_alpha_beta` (and :func:`measure_gamma`, :func:`predict`)
to put an alpha-beta prediction beside their own measured communication time.
"""

import argparse
import math
import os
import statistics
import time

import numpy as np

from mpipar.tools.bench.common import (
    bench_parser,
    environment,
    pyplot,
    run_ranks,
    save_figure,
    write_csv,
    wrote,
)
from mpipar.tools.hardware import ring_allreduce_time

PINGPONG_SIZES = [8 * 4**k for k in range(11)] + [16 * 2**20]  # 8 B .. 8 MiB, 16 MiB
ALLREDUCE_SIZES = [8 * 8**k for k in range(8)]  # 8 B .. 16 MiB
ALGOS = ("master", "mpi", "ring")


# ----------------------------------------------------------------------------- the model
def fit_alpha_beta(sizes, times):
    """alpha, beta minimising sum(((alpha + n beta) - t) / t)^2 over the measured points."""
    n, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    A = np.stack([1.0 / t, n / t], axis=1)  # (points, 2): each row divided by its t
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def predict(algo, p, n, alpha, beta, gamma=0.0):
    """Seconds to allreduce n bytes over p ranks (lessons/formulas.md#collectives)."""
    if p == 1:
        return 0.0
    lg = math.ceil(math.log2(p))
    # the ring's alpha-beta part is the cost model's own formula; the reduction adds gamma
    ring = ring_allreduce_time(n, p, alpha, beta) + (p - 1) / p * n * gamma
    if algo == "master":
        return 2 * lg * (alpha + n * beta) + lg * n * gamma
    if algo == "mpi":
        return min(lg * (alpha + n * beta + n * gamma), ring)
    if algo in ("ring", "zero"):  # ZeRO-1: reduce-scatter + allgather, the ring's two halves
        return ring
    raise ValueError(f"unknown algorithm {algo!r}")


def measure_gamma(nbytes=16 * 2**20, repeats=7):
    """Seconds per byte of a float64 ``a += b`` on this process (one BLAS-free thread)."""
    a, b = np.zeros(nbytes // 8), np.ones(nbytes // 8)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        a += b
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) / nbytes


def measure_alpha_beta(quick=False):
    """Run the ping-pong on 2 ranks and return the fitted (alpha, beta) in seconds, s/byte."""
    alpha, beta, _ = pingpong(quick)
    return alpha, beta


def pingpong(quick=False):
    rows = run_ranks(2, "mpipar.tools.bench.net", ["--worker", "pingpong"] + (["--quick"] * quick))
    sizes = [row["bytes"] for row in rows]
    times = [row["seconds"] for row in rows]
    alpha, beta = fit_alpha_beta(sizes, times)
    return alpha, beta, rows


# ----------------------------------------------------------------------------- workers (mpirun)
def _slowest(comm, seconds):
    return max(comm.allgather_obj(seconds))


def worker_pingpong(comm, quick):
    from mpipar.tools.bench.common import emit

    repeats = 5 if quick else 9
    r = comm.rank
    for n in PINGPONG_SIZES:
        buf = np.zeros(n, dtype=np.uint8)
        iters = 200 if n <= 64 * 1024 else max(4, int(2e7 // n))
        if quick:
            iters = max(2, iters // 4)
        samples = []
        for rep in range(repeats + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                if r == 0:
                    comm.Send(buf, 1)
                    comm.Recv(buf, 1)
                else:
                    comm.Recv(buf, 0)
                    comm.Send(buf, 0)
            if rep:  # the first round is the warm-up
                samples.append((time.perf_counter() - t0) / (2 * iters))  # one way
        if r == 0:
            emit({"bytes": n, "seconds": statistics.median(samples)})


def worker_allreduce(comm, quick):
    from mpipar.data_parallel import ring_allreduce
    from mpipar.tools.bench.common import emit

    repeats = 3 if quick else 7
    p = comm.size
    sizes = ALLREDUCE_SIZES[::2] + ALLREDUCE_SIZES[-1:] if quick else ALLREDUCE_SIZES
    for n in sizes:
        buf = np.zeros(n // 8)  # zeros stay zeros: the sums never overflow or go denormal
        out = np.zeros(n // 8)
        algos = {
            "master": lambda b=buf, o=out: (comm.Reduce(b, o, root=0), comm.Bcast(o, root=0)),
            "mpi": lambda b=buf: comm.Allreduce(b),
            "ring": lambda b=buf: ring_allreduce(comm, b),
        }
        iters = 100 if n <= 32 * 1024 else max(3, int(4e7 // (n * p)))
        if quick:
            iters = max(2, iters // 4)
        samples = {a: [] for a in ALGOS}
        for rep in range(repeats + 1):
            for algo in ALGOS:  # interleaved, so load from other work hits all three alike
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    algos[algo]()
                t = _slowest(comm, (time.perf_counter() - t0) / iters)
                if rep:
                    samples[algo].append(t)
        if comm.rank == 0:
            for algo in ALGOS:
                emit({"ranks": p, "algo": algo, "bytes": n,
                      "seconds": statistics.median(samples[algo])})


LOCKSTEP_SIZES = [8 * 8**k for k in range(3, 7)]  # 4 KiB .. 2 MiB
LOCKSTEP_N = 256  # (N, N) float32 matrices: about 0.2 ms per product on one core


def worker_lockstep(comm, quick):
    from mpipar.tools.bench.common import emit

    iters, repeats = (20, 3) if quick else (40, 5)
    a = np.random.default_rng(comm.rank).standard_normal((LOCKSTEP_N,) * 2).astype(np.float32)

    def compute():
        (a @ a) @ a

    def run(n):  # seconds per iteration, the median over repeats of the slowest rank's mean
        buf = np.zeros(n // 8) if n else None
        samples = []
        for rep in range(repeats + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                compute()
                if buf is not None:
                    comm.Allreduce(buf)
            if rep:
                samples.append(_slowest(comm, (time.perf_counter() - t0) / iters))
        return statistics.median(samples)

    alone = run(0)  # every rank multiplies, nobody waits for anybody
    for n in LOCKSTEP_SIZES:
        t = run(n)
        if comm.rank == 0:
            emit({"ranks": comm.size, "algo": "mpi", "bytes": n, "seconds": t - alone,
                  "compute_seconds": alone})


def worker(kind, quick):
    from mpipar.mpi import comm as C
    from mpipar.mpi import direct
    from mpipar.mpi.trace import TRACE

    C.install_excepthook()
    TRACE.enabled = False  # thousands of calls: keep no timeline
    C.choose_wait()  # as the runner does: how a rank waits on this machine
    w = direct.world()  # what the grid gives this rank
    {"pingpong": worker_pingpong, "allreduce": worker_allreduce,
     "lockstep": worker_lockstep}[kind](w, quick)


# ----------------------------------------------------------------------------- driver
def plot(ping, alpha, beta, gamma, rows, path):
    plt = pyplot()

    from mpipar.tools.bench.common import cores

    ranks = sorted({row["ranks"] for row in rows})
    fig, axes = plt.subplots(1, 1 + len(ranks), figsize=(5 * (1 + len(ranks)), 4.2))
    n = np.array([row["bytes"] for row in ping], dtype=float)
    axes[0].loglog(n, [row["seconds"] * 1e6 for row in ping], "o", color="black",
                   label="measured (half round trip)")
    axes[0].loglog(n, (alpha + n * beta) * 1e6, "-", color="gray",
                   label=f"alpha {alpha * 1e6:.2f} us + n / {1 / beta / 1e9:.2f} GB/s")
    axes[0].set_title("ping-pong, 2 ranks")
    colors = {"master": "#C44E52", "mpi": "#4C72B0", "ring": "#55A868"}
    names = {"master": "master (Reduce + Bcast)", "mpi": "MPI Allreduce",
             "ring": "hand-written ring"}
    for ax, p in zip(axes[1:], ranks):
        for algo in ALGOS:
            pts = [row for row in rows if row["ranks"] == p and row["algo"] == algo]
            x = np.array([row["bytes"] for row in pts], dtype=float)
            ax.loglog(x, [row["seconds"] * 1e6 for row in pts], "o", color=colors[algo],
                      label=f"{names[algo]}, measured")
            ax.loglog(x, [predict(algo, p, v, alpha, beta, gamma) * 1e6 for v in x], "-",
                      color=colors[algo], alpha=0.6, label="alpha-beta-gamma model")
        over = " (oversubscribed)" if p > cores() else ""
        ax.set_title(f"allreduce, {p} ranks on {cores()} cores{over}")
    for ax in axes:
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("time (us)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)
    return path


def main(argv=None):
    ap = bench_parser("net", "fewer sizes and repeats", worker=False)
    ap.add_argument("--worker", choices=["pingpong", "allreduce", "lockstep"],
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.quick)
        return

    from mpipar.tools.bench.common import cores

    load = os.getloadavg()[0]  # other work on the machine, for the record
    alpha, beta, ping = pingpong(args.quick)
    gamma = measure_gamma()
    print(f"ping-pong, 2 ranks: alpha = {alpha * 1e6:.2f} us, beta = {beta * 1e9:.4f} ns/byte "
          f"({1 / beta / 1e9:.2f} GB/s); gamma = {gamma * 1e9:.4f} ns/byte")
    rows = []
    for row in ping:
        rows.append(dict(environment(ranks=2), bench="net", kind="pingpong", algo="send-recv",
                         bytes=row["bytes"], seconds=row["seconds"],
                         predicted_seconds=alpha + row["bytes"] * beta,
                         alpha=alpha, beta=beta, gamma=gamma, loadavg_1min=round(load, 2)))
    measured = []
    for p in (2, 4):
        measured += run_ranks(p, "mpipar.tools.bench.net",
                              ["--worker", "allreduce"] + (["--quick"] * args.quick))
    print(f"{'ranks':>5} {'bytes':>10} " + " ".join(f"{a + ' us':>12} {'model':>8}" for a in ALGOS))
    for p in (2, 4):
        for n in sorted({m["bytes"] for m in measured if m["ranks"] == p}):
            line = f"{p:5d} {n:10d} "
            for algo in ALGOS:
                (m,) = [m for m in measured if (m["ranks"], m["algo"], m["bytes"]) == (p, algo, n)]
                pred = predict(algo, p, n, alpha, beta, gamma)
                rows.append(dict(environment(ranks=p), bench="net", kind="allreduce", algo=algo,
                                 bytes=n, seconds=m["seconds"], predicted_seconds=pred,
                                 alpha=alpha, beta=beta, gamma=gamma, loadavg_1min=round(load, 2)))
                line += f"{m['seconds'] * 1e6:12.1f} {pred * 1e6:8.1f} "
            print(line + ("  (oversubscribed)" if p > cores() else ""))
    lockstep = run_ranks(4, "mpipar.tools.bench.net",
                         ["--worker", "lockstep"] + (["--quick"] * args.quick))
    print("allreduce between multiplies on 4 ranks (lockstep): cost beyond the multiply")
    for m in lockstep:
        pred = predict("mpi", 4, m["bytes"], alpha, beta, gamma)
        rows.append(dict(environment(ranks=4), bench="net", kind="allreduce-lockstep",
                         algo="mpi", bytes=m["bytes"], seconds=m["seconds"],
                         predicted_seconds=pred, alpha=alpha, beta=beta, gamma=gamma,
                         loadavg_1min=round(load, 2)))
        print(f"{4:5d} {m['bytes']:10d} {m['seconds'] * 1e6:12.1f} {pred * 1e6:8.1f}"
              + ("  (oversubscribed)" if 4 > cores() else ""))
    path = write_csv("net.csv", rows, args.out)
    png = plot(ping, alpha, beta, gamma, measured, args.out / "net_allreduce.png")
    wrote(path, png)


if __name__ == "__main__":
    main()
