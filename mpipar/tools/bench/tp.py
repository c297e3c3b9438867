"""Tensor parallelism: step time and communication share of one transformer block against its
hidden size h, on P = 1 and P = 2 ranks, and where P = 2 starts to pay off.

    python -m mpipar.tools.bench tp # tp.csv and tp_comm_share.png in --out (see mpipar.tools.bench)
    python -m mpipar.tools.bench tp --plot-only --out plots   # redraw the committed picture

One :class:`mpipar.parts.tp_models.ParallelBlock` (h / 16 heads of width 16, so attention's
work grows with h like the rest), float32, one BLAS thread per rank, for two step shapes:
batch 4 x sequence 64 (256 tokens, a training step) and batch 1 x sequence 16 (16 tokens, where
latency matters). A step is forward, backward of a fixed output gradient and an SGD update of
the local shards. On P = 2 each rank does half of every matrix product and attends with half
of the heads, and the step makes 4 Allreduces of b*s*h floats (2 forward, 2 backward); on
P = 1 the same code makes no call.

Per shape, hidden size and P, after warm-up: barrier, a batch of steps, the slowest rank's
time per step; the median over rounds (each round times every configuration once). From the
timeline (mpipar.mpi.trace) per step:

- comm: the time inside Allreduce (mean over ranks); divided by the step time it is the
  communication share. It includes waiting for the other rank.
- comm_min: the same, the MINIMUM over ranks: the rank that arrives last waits only for the
  data; this is the number to set beside the alpha-beta prediction.
- step_both: the one-rank block (a communicator of one) timed while the other rank runs its
  own one-rank block at the same moment, between the same barriers, no messages between them
  (the slowest rank's time; half the batch of steps, in every other round). Two ranks
  computing at once on shared cores and memory run slower than one rank alone; this is what a
  P = 2 rank computes at, so the cost model (mpipar.tools.validate) takes its rate for P = 2 from
  these times, measured in the same rounds as P = 1 and P = 2 so that a slow spell hits all
  three.

The prediction (the cost model of lessons/formulas.md#collectives): alpha and beta from a
ping-pong in the same run and gamma from a NumPy add (:mod:`mpipar.tools.bench.net`); an Allreduce
of
n bytes on 2 ranks costs ``net.predict("mpi", 2, n, alpha, beta, gamma)``. The P = 1 times are
fitted as
t1 = c0 + c1 h + c2 h^2: c0 the per-step work that does not grow with h (Python calls, mostly),
c1 h the work linear in h (elementwise ops, attention's T x T products), c2 h^2 the four weight
matrices. Splitting halves the parts that grow with h and adds the Allreduces:
t2 = c0 + (c1 h + c2 h^2) / 2 + 4 allreduce(b s h * 4 bytes), so P = 2 pays off once
(c1 h + c2 h^2) / 2 > 4 allreduce(b s h * 4 bytes): that crossover does not depend on c0.
Replicated work (LayerNorm, residual adds) does not halve; the model halves it with the rest.
The measured crossover is where the measured speedup t1 / t2 crosses 1 for good, interpolated
in log h. Both ranks of P = 2 and the one of P = 1 run in the same launch, in interleaved
rounds, on a machine that other work may share: ratios, not absolute times, are the result.
"""

import os
import statistics

import numpy as np

from mpipar.tools.bench.common import (
    bench_parser,
    cores,
    count_list,
    environment,
    number,
    pyplot,
    read_csv,
    run_ranks,
    save_figure,
    too_big,
    write_csv,
    wrote,
)

HIDDEN = [32, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
QUICK_HIDDEN = [32, 64, 128, 256, 512]
SHAPES = [(4, 64), (1, 16)]  # (batch, sequence): a training-sized step, and a small one
HEAD_DIM = 16  # heads = h / 16, so attention's work grows with h like the rest
N_ALLREDUCE = 4  # per block and step: 2 forward (row-parallel outputs), 2 backward (f)
BOTH = "both"  # the configuration of every rank running its own one-rank block at once
BOTH_BUDGET = 0.5  # its share of --budget per round (its time is a median, like the others)
BOTH_EVERY = 2  # timed in every other round: the bench grows by about a third, not a half


def heads_for(h):
    return h // HEAD_DIM


def block_flops(h, b, s):
    """Forward + backward FLOPs of one block on b x s tokens (backward = 2 x forward):
    nn.Block.flops written out, 24 N h^2 (the four matrices) + 4 b s^2 h (attention)
    + 16 N h (the LayerNorms), N = b s."""
    n = b * s
    return 3 * (24 * n * h * h + 4 * b * s * s * h + 16 * n * h)


# ----------------------------------------------------------------------------- worker (mpirun)
def worker(hidden, repeats, budget):
    """On 2 ranks: per shape and hidden size, P = 1 (rank 0 alone, on a communicator of
    itself, while rank 1 sleeps in a barrier), P = 2, and "both": each rank its own one-rank
    block at the same moment, no messages between them. Every configuration is timed once per
    round and the rounds repeat, so a burst of other work on the machine spoils one sample of
    many configurations rather than every sample of one."""
    from mpi4py import MPI

    from mpipar.engine import backend as B
    from mpipar.engine import optim
    from mpipar.mpi import comm as C
    from mpipar.mpi.grid import Grid
    from mpipar.mpi.trace import TRACE
    from mpipar.parts import tp_models
    from mpipar.tools.bench.common import emit

    C.install_excepthook()
    B.use("numpy", "float32")
    TRACE.calls = True  # the time inside Allreduce is read from the calls' spans
    tp_comm = Grid(tp=C.world().size).tp_comm
    alone = C.Comm(MPI.COMM_SELF, "self")
    rng = np.random.default_rng(0)

    def make_step(h, b, s, comm):
        block = tp_models.ParallelBlock(h, heads_for(h), comm).init(0, "blocks.0.")
        opt = optim.SGD(block.parameters(), lr=1e-4)
        x = rng.standard_normal((b, s, h)).astype(np.float32)  # (B, T, C)
        dout = (1e-3 * rng.standard_normal((b, s, h))).astype(np.float32)

        def step():
            opt.zero_grad()
            block.forward(x)
            block.backward(dout)
            opt.step()

        return step

    configs = [(b, s, h, p) for b, s in SHAPES for h in hidden for p in (1, 2, BOTH)]
    steps, iters = {}, {}
    for b, s, h, p in configs:
        if p == BOTH:  # every rank its own one-rank block (rank 0 the one it timed alone)
            steps[b, s, h, p] = steps.get((b, s, h, 1)) or make_step(h, b, s, alone)
        elif p == 2 or tp_comm.rank == 0:  # P = 1 runs on rank 0 only
            steps[b, s, h, p] = make_step(h, b, s, alone if p == 1 else tp_comm)
        t0 = MPI.Wtime()
        for _ in range(2 if (b, s, h, p) in steps else 0):  # warm-up and a first estimate
            steps[b, s, h, p]()
        estimate = max(tp_comm.allgather_obj((MPI.Wtime() - t0) / 2))
        share = BOTH_BUDGET if p == BOTH else 1.0  # a shorter batch of steps
        iters[b, s, h, p] = max(1, int(share * budget / estimate))  # the same on every rank
    samples = {c: [] for c in configs}  # every configuration once per round, in turn
    for rep in range(repeats):
        for c in configs:
            n, p = iters[c], c[3]
            if p == BOTH and rep % BOTH_EVERY:
                continue  # its largest sizes run a step per round whatever the budget
            tp_comm.Barrier()
            TRACE.clear()
            t0 = MPI.Wtime()
            for _ in range(n if c in steps else 0):
                steps[c]()
            t = (MPI.Wtime() - t0) / n
            comm = sum(e[1] - e[0] for e in TRACE.events if e[3] == "Allreduce") / n
            if p == 1:  # rank 1 waits for rank 0 without taking a core from other work
                C.WAIT, wait = "sleep", C.WAIT
                tp_comm.Barrier()
                C.WAIT = wait
            both = tp_comm.allgather_obj((t, comm))[:2 if p == BOTH else p]
            samples[c].append((max(v for v, _ in both), [v for _, v in both]))
    if tp_comm.rank == 0:
        for (b, s, h, p), got in samples.items():
            if p == BOTH:
                continue  # written beside P = 1 and P = 2, as step_both_s
            emit({"batch": b, "seq": s, "hidden": h, "ranks": p, "iters": iters[b, s, h, p],
                  "step_s": statistics.median(t for t, _ in got),
                  "comm_s": statistics.median(float(np.mean(c)) for _, c in got),
                  "comm_min_s": statistics.median(min(c) for _, c in got),
                  "step_both_s": statistics.median(t for t, _ in samples[b, s, h, BOTH])})


# ----------------------------------------------------------------------------- model
def fit_compute(hidden, t1):
    """(c0, c1, c2) of t1(h) = c0 + c1 h + c2 h^2, least squares on the relative error.
    c0 is the per-step work that does not grow with h (Python calls, mostly); c1 h the work
    linear in h (elementwise ops, attention's T x T products); c2 h^2 the four matrices."""
    h = np.asarray(hidden, dtype=float)
    t = np.asarray(t1, dtype=float)
    A = np.stack([1.0 / t, h / t, h * h / t], axis=1)
    coef, *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    return tuple(float(c) for c in coef)


def scaling_part(h, fit):
    """The part of t1(h) that splitting over the ranks divides: c1 h + c2 h^2."""
    _, c1, c2 = fit
    return c1 * h + c2 * h * h


def allreduce_bytes(h, b, s):
    return b * s * h * 4  # float32


def predicted_comm(h, b, s, alpha, beta, gamma):
    from mpipar.tools.bench.net import predict

    return N_ALLREDUCE * predict("mpi", 2, allreduce_bytes(h, b, s), alpha, beta, gamma)


def predicted_crossover(fit, b, s, alpha, beta, gamma, lo=4, hi=16384):
    """The smallest h (on a fine grid) where halving the scaling work saves more than the 4
    Allreduces cost: (c1 h + c2 h^2) / 2 > 4 allreduce(b s h 4 bytes); None if none."""
    for h in np.unique(np.geomspace(lo, hi, 600).astype(int)):
        if scaling_part(h, fit) / 2 > predicted_comm(int(h), b, s, alpha, beta, gamma):
            return int(h)
    return None


def measured_crossover(hidden, speedup):
    """h where the measured speedup first crosses 1 and stays above, interpolated in log h."""
    for i in range(len(hidden) - 1, 0, -1):
        if speedup[i - 1] < 1.0 <= speedup[i] and all(s >= 1.0 for s in speedup[i:]):
            a, b = np.log(hidden[i - 1]), np.log(hidden[i])
            w = (1.0 - speedup[i - 1]) / (speedup[i] - speedup[i - 1])
            return int(round(float(np.exp(a + w * (b - a)))))
    if speedup and speedup[0] >= 1.0:
        return hidden[0]  # pays off at every size measured
    return None


# ----------------------------------------------------------------------------- driver
def _number(v):
    """A CSV cell as a number where it is one (rows read back from plots/tp.csv)."""
    if not isinstance(v, str):
        return v
    try:
        return float(v) if any(c in v for c in ".e") else int(v)
    except ValueError:
        return v


def plot(rows, path):
    """Draw the two panels from the CSV's rows (their crossover and load columns too)."""
    plt = pyplot()

    rows = [{k: _number(v) for k, v in r.items()} for r in rows]
    load = rows[0]["load_before"], rows[0]["load_after"]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = ["#4C72B0", "#C44E52", "#55A868"]
    for color, (b, s) in zip(colors, SHAPES):
        two = [r for r in rows if r["ranks"] == 2 and (r["batch"], r["seq"]) == (b, s)]
        h = [r["hidden"] for r in two]
        label = f"b*s = {b}*{s}"
        ax1.semilogx(h, [100 * r["comm_share"] for r in two], "o-", color=color,
                     label=f"{label}: measured")
        ax1.semilogx(h, [100 * r["predicted_comm_share"] for r in two], "--", color=color,
                     alpha=0.6, label=f"{label}: alpha-beta model")
        ax2.semilogx(h, [r["speedup"] for r in two], "o-", color=color,
                     label=f"{label}: measured t1 / t2")
        ax2.semilogx(h, [r["predicted_speedup"] for r in two], "--", color=color, alpha=0.6,
                     label=f"{label}: model")
        measured, predicted = two[0]["measured_crossover_hidden"], \
            two[0]["predicted_crossover_hidden"]
        for value, style, what in ((measured, ":", "measured"), (predicted, "-.", "model")):
            if value in (None, ""):
                continue
            text = f"{label}: pays off from h = {value:.0f} ({what})"
            everywhere = what == "measured" and two[0]["speedup"] >= 1.0
            if everywhere:  # no crossover to draw: the first point already pays off
                text = f"{label}: pays off at every h measured ({what})"
            if value > min(h) and not everywhere:
                ax2.axvline(value, color=color, linestyle=style, linewidth=1, label=text)
            else:  # off the measured range: in the legend only
                ax2.plot([], [], color=color, linestyle=style, linewidth=1, label=text)
    ax1.set_ylabel("share of the step in Allreduce (%)")
    ax1.set_title("P = 2: 4 Allreduces of b*s*h floats per block step")
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_ylabel("speedup of P = 2 over P = 1")
    ax2.set_title(f"one transformer block, float32, 1 thread per rank, {cores()} cores "
                  f"(load {load[0]:.1f} -> {load[1]:.1f})", fontsize=10)
    for ax in (ax1, ax2):
        ax.set_xlabel("hidden size h")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=6)
    save_figure(fig, path)
    return path


def main(argv=None):
    ap = bench_parser("tp", "fewer sizes and repeats")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw tp_comm_share.png from tp.csv in --out, measure nothing")
    ap.sized("--hidden", HIDDEN, QUICK_HIDDEN, type=count_list(2 * HEAD_DIM),
             help=f"hidden sizes, comma-separated: multiples of {2 * HEAD_DIM}, so that P = 2 "
                  f"splits the heads of width {HEAD_DIM} evenly")
    ap.sized("--repeats", 11, 3, type=number())
    ap.add_argument("--budget", type=number(float), default=0.06,
                    help="seconds of steps per configuration and round")
    args = ap.parse_args(argv)
    hidden, repeats = args.hidden, args.repeats
    weights = 4 * 12 * sum(h * h for h in hidden) * len(SHAPES)  # each block's 12 h^2 floats
    if problem := too_big(weights, f"--hidden {','.join(map(str, hidden))}: the blocks' "
                                   "weights alone"):
        ap.error(problem)
    if args.worker:
        worker(hidden, repeats, args.budget)
        return
    if args.plot_only:
        if not (args.out / "tp.csv").is_file():
            ap.error(f"--plot-only draws from {args.out / 'tp.csv'}, which is not there: "
                     "give --out the folder a measuring run wrote")
        wrote(plot(read_csv("tp.csv", args.out), args.out / "tp_comm_share.png"))
        return

    from mpipar.tools.bench.net import measure_alpha_beta, measure_gamma

    alpha, beta = measure_alpha_beta(quick=args.quick)
    gamma = measure_gamma()
    print(f"ping-pong: alpha {alpha * 1e6:.2f} us, beta {beta * 1e9:.4f} ns/B "
          f"({1 / beta / 1e9:.2f} GB/s), gamma {gamma * 1e9:.4f} ns/B")
    flags = ["--worker", "--hidden", ",".join(map(str, hidden)), "--repeats", repeats,
             "--budget", args.budget]
    load_before = os.getloadavg()[0]
    results = run_ranks(2, "mpipar.tools.bench.tp", flags)
    load_after = os.getloadavg()[0]  # other work on the machine skews P = 2 the most
    print(f"load average (1 min) before {load_before:.2f}, after {load_after:.2f}, "
          f"on {cores()} cores")
    rows = []
    for b, s in SHAPES:
        measured = {p: {r["hidden"]: r for r in results
                        if r["ranks"] == p and (r["batch"], r["seq"]) == (b, s)} for p in (1, 2)}
        t1 = [measured[1][h]["step_s"] for h in hidden]
        fit = fit_compute(hidden, t1)
        c0 = fit[0]
        speedup = [measured[1][h]["step_s"] / measured[2][h]["step_s"] for h in hidden]
        cross_m = measured_crossover(hidden, speedup)
        cross_p = predicted_crossover(fit, b, s, alpha, beta, gamma)
        print(f"\nbatch {b} x sequence {s}; P = 1 fit: t1 = {c0 * 1e3:.3f} ms + "
              f"{fit[1] * 1e6:.3f} us h + {fit[2] * 1e9:.3f} ns h^2")
        print(f"{'h':>6} {'t1 ms':>9} {'t2 ms':>9} {'speedup':>8} {'model':>7} {'comm %':>7} "
              f"{'model %':>8} {'comm_min ms':>12} {'model ms':>9}")
        for h in hidden:
            F = block_flops(h, b, s)
            comm_pred = predicted_comm(h, b, s, alpha, beta, gamma)
            t1_fit = c0 + scaling_part(h, fit)
            pred = {1: t1_fit, 2: c0 + scaling_part(h, fit) / 2 + comm_pred}
            for p in (1, 2):
                m = measured[p][h]
                rows.append(dict(
                    environment(ranks=p), bench="tp", block="ParallelBlock", batch=b, seq=s,
                    tokens=b * s, hidden=h, heads=heads_for(h), dtype="float32", flops=F,
                    iters=m["iters"], step_ms=m["step_s"] * 1e3, comm_ms=m["comm_s"] * 1e3,
                    comm_min_ms=m["comm_min_s"] * 1e3, comm_share=m["comm_s"] / m["step_s"],
                    speedup=measured[1][h]["step_s"] / m["step_s"],
                    predicted_step_ms=pred[p] * 1e3,
                    predicted_comm_ms=(comm_pred if p == 2 else 0.0) * 1e3,
                    predicted_comm_share=(comm_pred / pred[2] if p == 2 else 0.0),
                    predicted_speedup=t1_fit / pred[p], allreduce_bytes=allreduce_bytes(h, b, s),
                    alpha=alpha, beta=beta, gamma=gamma, fit_c0_ms=c0 * 1e3,
                    fit_c1_us=fit[1] * 1e6, fit_c2_ns=fit[2] * 1e9,
                    step_both_ms=m["step_both_s"] * 1e3,
                    gflops=F / m["step_s"] / 1e9, load_before=load_before,
                    load_after=load_after,
                    measured_crossover_hidden=cross_m, predicted_crossover_hidden=cross_p))
            one, two = rows[-2], rows[-1]
            print(f"{h:6d} {one['step_ms']:9.3f} {two['step_ms']:9.3f} {two['speedup']:8.2f} "
                  f"{two['predicted_speedup']:7.2f} {100 * two['comm_share']:7.1f} "
                  f"{100 * two['predicted_comm_share']:8.1f} {two['comm_min_ms']:12.3f} "
                  f"{two['predicted_comm_ms']:9.3f}")
        print(f"P = 2 pays off from h = {cross_m} (measured) / h = {cross_p} (alpha-beta model)")
    path = write_csv("tp.csv", rows, args.out)
    png = plot(rows, args.out / "tp_comm_share.png")
    wrote(path, png)


if __name__ == "__main__":
    main()
