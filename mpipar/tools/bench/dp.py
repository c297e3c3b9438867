"""Data parallelism: step time, speedup and communication share per sync mode, and the measured
gradient communication beside its alpha-beta prediction.

    python -m mpipar.tools.bench dp # dp.csv and dp_speedup.png in --out (see mpipar.tools.bench)

A compute-bound MLP (widths 64-1024-1024-1024-10, 2.2 M parameters, 8.7 MB of float32
gradients) on the digits, global batch 1024 (about 100 ms per step on one rank), float32, one
BLAS thread per rank. Every replica still zeroes its gradients and runs the whole optimizer
update (about 4 ms here, whatever P), so by Amdahl's law P = 2 reaches 1.8x only when a
step's compute C is above about 68 ms
((C + 4) / (C/2 + 4 + 2 ms exposed communication) >= 1.8; batch 512 gives 53 ms). Trained by
the trainers of :mod:`mpipar.data_parallel` (``MasterScheme``, ``AllreduceScheme``,
``ZeroScheme``) on P = 1, 2 and 4 ranks (4 ranks on 2 cores are
oversubscribed and marked so) in five modes: master (the seed's Reduce + Bcast), allreduce,
ring, allreduce with 2 MiB buckets and overlap, and ZeRO-1.

Each launch builds all five trainers, warms them up and times them in interleaved rounds
(so load from other work hits every mode alike): one untimed step (the trainer's 26 MB of
weights, gradients and momentum come back into the caches that the other trainers' steps
filled, as they stay between the steps of a training run; about 3.5 ms per step at P = 1 and
2 alike), then barrier, one step, the slowest rank's time;
the median over rounds and over three launches per rank count, run as P = 1, 2, 4, 1, 2, 4, ...
(the machine may be shared: each row records the load average when the run began). Per step
it also sums, from the timeline (mpipar.mpi.trace):

- exposed communication: the "sync" spans of the step (Scatterv of the batch, the gradient
  exchange including the copies into flat buffers, the parameter Bcast/Allgather); divided by
  the step time it is the communication share;
- MPI time of the gradient exchange (the comm spans of Reduce+Bcast, Allreduce, Sendrecv or
  Reduce_scatter+Allgather), the MINIMUM over ranks: the rank that reaches a collective last
  waits only for the data, the others also for it. This is the number to set beside the
  alpha-beta-gamma prediction (:func:`mpipar.tools.bench.net.predict`, with alpha and beta from a
  ping-pong in the same run). With overlap the Iallreduce spans run from posting to the final
  wait, so they include backward compute. In master mode a worker's Bcast also waits for the
  master's optimizer update: the serial part the seed's scheme adds.

Overlap hides little here: on one machine MPI moves shared-memory messages with the same cores
that compute (no network card or copy engine does it in the background), and MPICH advances a
non-blocking collective only inside MPI calls, i.e. between layers.

Five trainers in one process share one C heap: glibc returns freed memory to the system
(heap trimming, and large blocks mmapped and unmapped one by one), so with the modes
interleaved each step allocated afresh what another mode's step had released: at P = 2 MPI's
temporary buffers (half of each bucket for a two-rank Allreduce) and NumPy's temporaries came
back as 500 to 1500 page faults per step (about 1.4 us each here, 0.7 to 2 ms per step) which
a trainer running alone does not take after its first steps. The workers therefore keep freed
memory in the process (:func:`mpipar.engine.backend.steady_heap`, glibc's mallopt, as every trainer
does, the same for every P and mode) and warm up in the interleaved order they are timed in;
every row records ``steady_heap``.

Speedup of a mode on P ranks = its step time on 1 rank / its step time on P ranks.

On 1 rank each round also times :class:`BareStep`, the same step written in bare NumPy, in the
same way. A mode's 1-rank step over it (the median over rounds of the ratio within a round,
with its range) is the price of the scheme's machinery where it buys nothing: flat buffers,
MPI calls on one rank, the trace's spans. Target: at most 1.1x.

The 4-rank rows also carry ``vs_2_ranks``: their step time over the 2-rank step of the same
mode and global batch (with ``vs_2_ranks_min`` and ``_max``, the range of the per-round ratios,
round i of P = 4 against round i of P = 2). On 2 cores that is the price of oversubscription,
which the way a rank waits (:mod:`mpipar.mpi.waiting`) decides; target: at most 1.3 for allreduce.
"""

import argparse
import os
import statistics

from mpipar.tools.bench.common import (
    bench_parser,
    cores,
    environment,
    number,
    pyplot,
    run_ranks,
    save_figure,
    write_csv,
    wrote,
)

SIZES = "64,1024,1024,1024,10"
BATCH = 1024
MODEL = ["--model", "mlp", "--sizes", SIZES, "--batch-size", str(BATCH), "--dtype", "float32",
         "--lr", "0.01", "--quiet"]
MODES = {
    "master": ["--sync", "master"],
    "allreduce": ["--sync", "allreduce"],
    "ring": ["--sync", "ring"],
    "allreduce+overlap": ["--sync", "allreduce", "--bucket-mb", "2", "--overlap"],
    "zero1": ["--sync", "allreduce", "--zero", "1"],
}
ALGO = {"master": "master", "allreduce": "mpi", "ring": "ring", "allreduce+overlap": "mpi",
        "zero1": "zero"}  # the net.predict formula of each mode
GRAD_OPS = {"Reduce", "Bcast", "Allreduce", "Sendrecv", "Reduce_scatter", "Allgather"}
RANKS = (1, 2, 4)
OVERSUBSCRIBED_TARGET = 1.3  # allreduce: 4-rank step / 2-rank step at most this
BARE_TARGET = 1.1  # a 1-rank step against BareStep


# ----------------------------------------------------------------------------- worker (mpirun)
class BareStep:
    """P = 1's yardstick: the trainers' step (make the batch, forward, backward, SGD with
    momentum) in bare NumPy (:func:`mpipar.tools.bench.engine.bare_step`), from a copy of a
    trainer's
    initial parameters. What a 1-rank step costs beyond it is the scheme's machinery."""

    def __init__(self, trainer):
        named = list(trainer.model.named_parameters())
        self.Ws = [p.data.copy() for name, p in named if name.endswith(".W")]
        self.bs = [p.data.copy() for name, p in named if name.endswith(".b")]
        self.velocity = ([w * 0 for w in self.Ws], [b * 0 for b in self.bs])  # on their device
        self.task, self.opt = trainer.task, trainer.opt

    def step(self, step):
        from mpipar.engine import backend as B
        from mpipar.tools.bench.engine import bare_step

        x, y = self.task.to_device(*self.task.batch(step))
        return bare_step(self.Ws, self.bs, x, y, self.opt.lr, self.opt.momentum, self.velocity,
                         xp=B.xp)


def worker(rounds, warmup, backend="numpy"):
    from mpi4py import MPI

    from mpipar import serial
    from mpipar.engine import backend as B
    from mpipar.mpi import comm as C
    from mpipar.mpi.grid import Grid
    from mpipar.mpi.trace import TRACE
    from mpipar.runner.cli import parse_args
    from mpipar.tools.bench.common import emit
    from mpipar.tools.bench.engine import device_name
    from mpipar.train import trainer_class

    TRACE.calls = True  # the gradient exchange's MPI time is read from the calls' spans

    C.install_excepthook()
    heap = B.steady_heap()
    grid = Grid(dp=C.world().size)
    dp_comm = grid.dp_comm
    task, trainers = None, {}
    for mode, flags in MODES.items():
        args = parse_args("data_parallel", MODEL + flags + ["--backend", backend], dp_comm.size)
        task = serial.Task(args, task and task.data)  # the data depends on the model flags only
        trainers[mode] = trainer_class("data_parallel", args)(task, grid, args)
    timed = dict(trainers, bare=BareStep(trainers["allreduce"])) if dp_comm.size == 1 else trainers
    step = 0
    for _ in range(warmup):  # in the timed order, so that the heap reaches its steady size
        for dp in timed.values():
            dp.step(step)
            step += 1
    samples = {mode: [] for mode in timed}
    for _ in range(rounds):
        for mode, dp in timed.items():
            dp.step(step)  # untimed: this trainer's arrays back in cache, as between the steps
            step += 1  # of a training run, after another trainer's step evicted them
            dp_comm.Barrier()
            TRACE.clear()
            t0 = MPI.Wtime()
            dp.step(step)
            B.synchronize()  # on a GPU: the step's kernels are done
            t = MPI.Wtime() - t0
            step += 1
            sync = sum(e[1] - e[0] for e in TRACE.events if e[2] == "sync")
            grad = sum(e[1] - e[0] for e in TRACE.events if e[2] == "comm" and e[3] in GRAD_OPS)
            per_rank = dp_comm.allgather_obj((t, sync, grad))
            samples[mode].append((max(v[0] for v in per_rank),
                                  statistics.mean(v[1] for v in per_rank),
                                  min(v[2] for v in per_rank)))
    state = {mode: max(dp_comm.allgather_obj(dp.optimizer_state_bytes()))
             for mode, dp in trainers.items()}
    if dp_comm.rank == 0:
        for mode, dp in trainers.items():
            emit({"ranks": dp_comm.size, "mode": mode, "samples": samples[mode],
                  "params": dp.n, "grad_bytes": dp.flat.nbytes,
                  "buckets": len(dp.sync.buckets) if hasattr(dp, "sync") else 1,
                  "bucket_bytes": [b.flat.nbytes for b in dp.sync.buckets]
                  if hasattr(dp, "sync") else [],
                  "optimizer_state_bytes": state[mode], "steady_heap": heap,
                  "device": device_name() if backend == "cupy" else "cpu",
                  "cuda_aware": B.CUDA_AWARE,
                  "bare_s": [s[0] for s in samples.get("bare", [])]})


def against_bare(res):
    """A 1-rank mode's step / the bare-NumPy step of the same round: median and range over
    the rounds (empty for P > 1)."""
    ratios = [s[0] / b for s, b in zip(res["samples"], res["bare_s"])]
    if not ratios:
        return dict(bare_ms="", vs_bare="", vs_bare_min="", vs_bare_max="")
    return dict(bare_ms=round(statistics.median(res["bare_s"]) * 1e3, 3),
                vs_bare=round(statistics.median(ratios), 3), vs_bare_min=round(min(ratios), 3),
                vs_bare_max=round(max(ratios), 3))


# ----------------------------------------------------------------------------- driver
def plot(rows, path):
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(16, 5.4))
    n_cores = cores()
    top = max(RANKS)
    for ax, key, title in ((axes[0], "speedup", "speedup over 1 rank"),
                           (axes[1], "efficiency", "parallel efficiency (speedup / ranks)")):
        for mode in MODES:
            pts = [r for r in rows if r["mode"] == mode]
            ax.plot([r["ranks"] for r in pts], [r[key] for r in pts], "o-", label=mode)
        ideal = list(RANKS) if key == "speedup" else [1.0] * len(RANKS)
        ax.plot(RANKS, ideal, "k--", lw=1, label="ideal")
        ax.axvline(n_cores, color="gray", ls=":", lw=1)
        ax.axvspan(n_cores + 0.5, top + 0.3, color="gray", alpha=0.12, lw=0)
        ax.text(n_cores, ax.get_ylim()[1], f" {n_cores} cores", fontsize=8, color="gray",
                va="top")
        ax.text(top + 0.25, ax.get_ylim()[1], "oversubscribed\n(ranks > cores) ", fontsize=8,
                color="gray", ha="right", va="top")  # above the lines, which fall there
        ax.set_xticks(RANKS)
        ax.set_xlim(0.8, top + 0.3)
        ax.set_xlabel("ranks (P)")
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
        ax.grid(alpha=0.3)  # the legends below the panels: none covers a point
    at2 = [r for r in rows if r["ranks"] == 2]
    x = range(len(at2))
    bars = (("grad_comm_ms", "MPI calls (min over ranks)"),
            ("exposed_comm_ms", "exposed: the step waits"),
            ("predicted_comm_ms", "alpha-beta-gamma model"))
    clip = 1.3 * max(r[k] for r in at2 for k, _ in bars if r["mode"] != "allreduce+overlap")
    ticks = [r["mode"] for r in at2]
    for j, (key, label) in enumerate(bars):
        xs = [i + (j - 1) * 0.27 for i in x]
        axes[2].bar(xs, [min(r[key], clip) for r in at2], 0.27, label=label)
        for i, r in enumerate(at2):
            if r[key] > clip:  # an Iallreduce's span runs from posting to wait: backward inside
                ticks[i] += f"\n(MPI bar cut: {r[key]:.0f} ms,\nspans the backward)"
    axes[2].set_ylim(0, clip)
    axes[2].set_xticks(list(x))
    axes[2].set_xticklabels(ticks, fontsize=7)
    axes[2].set_ylabel("ms per step")
    axes[2].set_title("gradient communication, 2 ranks")
    axes[2].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    fig.suptitle(f"data parallelism: MLP {SIZES}, batch {BATCH}, float32, 1 BLAS thread/rank")
    save_figure(fig, path)
    return path


def main(argv=None):
    ap = bench_parser("dp", "one launch per rank count, few rounds")
    ap.sized("--rounds", 6, 3, type=number(), help="timed steps per mode and launch")
    ap.add_argument("--warmup", type=number(zero_ok=True), default=2, help=argparse.SUPPRESS)
    ap.add_argument("--backend", choices=["numpy", "cupy"], default="numpy",
                    help="cupy: every rank's arrays on a GPU, the ranks sharing the GPUs there "
                         "are (dp_gpu.csv, dp_gpu_speedup.png)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.rounds, args.warmup, args.backend)
        return
    from mpipar.engine.backend import cupy_problem

    if args.backend == "cupy" and (problem := cupy_problem()):
        ap.exit(2, f"error: {problem}\n")

    from mpipar.tools.bench.net import measure_alpha_beta, measure_gamma, predict

    alpha, beta = measure_alpha_beta(args.quick)
    gamma = measure_gamma()
    print(f"alpha {alpha * 1e6:.2f} us, beta {beta * 1e9:.4f} ns/byte ({1 / beta / 1e9:.2f} GB/s),"
          f" gamma {gamma * 1e9:.4f} ns/byte")
    rounds = args.rounds
    passes = 1 if args.quick else 3
    load = os.getloadavg()[0]  # other work on the machine, for the record
    runs = {}  # (ranks, mode) -> worker result, samples pooled over passes
    for _ in range(passes):  # P = 1, 2, 4, then again: slow phases of the machine hit all P
        for p in RANKS:
            for res in run_ranks(p, "mpipar.tools.bench.dp",
                                 ["--worker", "--rounds", rounds, "--warmup", args.warmup,
                                  "--backend", args.backend]):
                key = (p, res["mode"])
                if key in runs:
                    runs[key]["samples"] += res["samples"]
                    runs[key]["bare_s"] += res["bare_s"]
                else:
                    runs[key] = res
    rows = []
    base = {mode: statistics.median(s[0] for s in runs[(1, mode)]["samples"]) for mode in MODES}
    for p in RANKS:
        for mode in MODES:
            res = runs[(p, mode)]
            step = statistics.median(s[0] for s in res["samples"])
            exposed = statistics.median(s[1] for s in res["samples"])
            grad = statistics.median(s[2] for s in res["samples"])
            if mode == "allreduce+overlap":  # one allreduce per bucket
                pred = sum(predict("mpi", p, n, alpha, beta, gamma) for n in res["bucket_bytes"])
            else:
                pred = predict(ALGO[mode], p, res["grad_bytes"], alpha, beta, gamma)
            speedup = base[mode] / step
            rows.append(dict(environment(ranks=p), bench="dp", backend=args.backend,
                             device=res["device"], cuda_aware=res["cuda_aware"],
                             model=f"mlp {SIZES}",
                             batch=BATCH, dtype="float32", params=res["params"], mode=mode,
                             buckets=res["buckets"], step_ms=round(step * 1e3, 3),
                             speedup=round(speedup, 3), efficiency=round(speedup / p, 3),
                             exposed_comm_ms=round(exposed * 1e3, 3),
                             comm_share=round(exposed / step, 3),
                             grad_comm_ms=round(grad * 1e3, 3),
                             predicted_comm_ms=round(pred * 1e3, 3),
                             optimizer_state_bytes=res["optimizer_state_bytes"],
                             samples=len(res["samples"]), steady_heap=res["steady_heap"],
                             alpha=alpha, beta=beta, gamma=gamma,
                             loadavg_1min=round(load, 2), **against_bare(res)))
    for row in rows:  # the 4-rank step against the 2-rank one, same mode and global batch
        if row["ranks"] == 4:
            ratios = [a[0] / b[0] for a, b in zip(runs[(4, row["mode"])]["samples"],
                                                   runs[(2, row["mode"])]["samples"])]
            row.update(vs_2_ranks=round(statistics.median(ratios), 3),
                       vs_2_ranks_min=round(min(ratios), 3), vs_2_ranks_max=round(max(ratios), 3))
    name = "dp_gpu" if args.backend == "cupy" else "dp"
    path = write_csv(f"{name}.csv", rows, args.out)
    png = plot(rows, args.out / f"{name}_speedup.png")
    print(f"{'ranks':>5} {'mode':<18} {'step ms':>8} {'speedup':>8} {'comm %':>7} "
          f"{'grad comm ms':>13} {'model ms':>9} {'opt state':>10}")
    for r in rows:
        print(f"{r['ranks']:5d} {r['mode']:<18} {r['step_ms']:8.1f} {r['speedup']:8.2f} "
              f"{100 * r['comm_share']:6.1f}% {r['grad_comm_ms']:13.2f} "
              f"{r['predicted_comm_ms']:9.2f} {r['optimizer_state_bytes']:10d}"
              + ("  (oversubscribed)" if r["oversubscribed"] else ""))
    bare = "CuPy" if args.backend == "cupy" else "NumPy"
    print(f"1 rank against bare {bare} doing the same step (target <= {BARE_TARGET}x; median "
          "over rounds, range):")
    for r in (r for r in rows if r["ranks"] == 1):
        print(f"      {r['mode']:<18} {r['bare_ms']:8.1f} ms bare: {r['vs_bare']:.3f}x "
              f"({r['vs_bare_min']:.3f}..{r['vs_bare_max']:.3f}), "
              f"{'met' if r['vs_bare'] <= BARE_TARGET else 'NOT met'}")
    (target,) = [r for r in rows if r["ranks"] == 2 and r["mode"] == "allreduce+overlap"]
    verdict = "met" if target["speedup"] >= 1.8 else "NOT met"
    print(f"target: P=2 allreduce+overlap >= 1.8x faster than P=1: {target['speedup']:.2f}x, "
          f"{verdict}")
    for r in (r for r in rows if r["ranks"] == 4):
        print(f"4 ranks on {r['cores']} cores against 2 ranks, {r['mode']:<18} "
              f"{r['vs_2_ranks']:.2f}x ({r['vs_2_ranks_min']:.2f}..{r['vs_2_ranks_max']:.2f})")
    (over,) = [r for r in rows if r["ranks"] == 4 and r["mode"] == "allreduce"]
    print(f"target: 4 ranks / 2 ranks (allreduce) <= {OVERSUBSCRIBED_TARGET}: "
          f"{over['vs_2_ranks']:.2f}x, "
          f"{'met' if over['vs_2_ranks'] <= OVERSUBSCRIBED_TARGET else 'NOT met'}")
    wrote(path, png)


if __name__ == "__main__":
    main()
