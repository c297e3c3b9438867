"""What each rank holds, counted by the memory ledger, and what it costs in step time: ZeRO
stages 0 to 3 on 1, 2 and 4 ranks, and a pipeline with activation recomputation off and on.

    python -m mpipar.tools.bench memory     # memory_bench.csv and memory_bench.png in --out

Two experiments, each trained with Adam in float32 under mpirun, one BLAS thread per rank:

- ZeRO: a GPT of 1.6 M parameters (width 256, 2 blocks, 32 tokens) on a global batch of 8
  sequences, ``--sync allreduce --zero 0..3`` and ZeRO-3 with prefetch (``--overlap``, two
  layers' parameters at once) on P = 1, 2 and 4 ranks;
- pipeline: a GPT of 0.8 M parameters (width 128, 4 blocks), 1F1B with 8 micro-batches of 4
  sequences, ``--recompute`` off, full and selective, on 2 and 4 stages.

Each launch builds every configuration of its experiment and runs them in interleaved rounds
(load from other work hits them alike). In a round each configuration takes one step under a
:class:`mpipar.runner.memory.Probe` (untimed: the probe counts between layers), then ``--steps``
steps, each from a barrier, timed with ``MPI.Wtime``: the slowest rank's time, the median of
the round's steps. A row holds one rank's ledger: its parameters, gradients, optimizer state
and buffers after the probed step, its activations at their peak in it, and the step's peak
(the most it held at once); the median over rounds with the smallest and largest (the ledger
counts arrays, so they only differ if the trainer allocates differently from round to round);
the step time over rounds likewise. ``formula_bytes`` is what ZeRO's paper says a rank holds
of parameters, gradients and Adam's state (Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 5,
16 bytes a parameter in float32: 4 + 4 + 8, each sharded over P from its stage on, no padding);
for a pipeline stage, 16 bytes for each of its parameters. 4 ranks on 2 cores are
oversubscribed: the times show the price of sharing cores, the bytes do not change. Each row
records the load average when the run began (the machine may be shared).

``predicted_step_ms`` is the cost model's step time (:func:`add_predictions`): its FLOP rate
fitted to the experiment's base configuration (ZeRO-0; recompute off) on as many ranks, so
what it predicts is what ZeRO-3's per-layer allgathers and reduce-scatters and recomputation's
extra forward add to that base; ``predicted_over_measured`` their ratio. ZeRO-3's work beyond
its collectives (fresh full buffers per gather) is measured on one rank, where it sends
nothing: ``zero3_ns_per_value`` (:func:`zero3_cost`), so its one-rank row matches by
construction and its rows on 2 and 4 ranks test the term.
"""

import os
import statistics

from mpipar.tools.bench.common import (
    bench_parser,
    emit,
    environment,
    number,
    pyplot,
    run_ranks,
    save_figure,
    write_csv,
    wrote,
)

KINDS = ("params", "grads", "optimizer", "activations", "buffers")
COMMON = ["--optim", "adam", "--dtype", "float32", "--quiet", "--n-heads", "4", "--seq-len", "32"]
MODELS = {"zero": ["--model", "gpt", "--d-model", "256", "--n-layers", "2", "--batch-size", "8"],
          "pipeline": ["--model", "gpt", "--d-model", "128", "--n-layers", "4", "--batch-size",
                       "32", "--micro-batches", "8", "--timeline", "none"]}
CONFIGS = {"zero": [(f"ZeRO-{z}", "data_parallel", ["--sync", "allreduce", "--zero", str(z)])
                    for z in range(4)] + [("ZeRO-3 prefetch", "data_parallel",
                                           ["--sync", "allreduce", "--zero", "3", "--overlap"])],
           "pipeline": [("recompute off", "pipeline", []),
                        ("recompute on", "pipeline", ["--recompute"]),
                        ("recompute selective", "pipeline", ["--recompute", "selective"])]}
BASE = {"zero": "ZeRO-0", "pipeline": "recompute off"}  # what a prediction's rate is fitted to
RANKS = {"zero": (1, 2, 4), "pipeline": (2, 4)}


# ----------------------------------------------------------------------------- worker (mpirun)
def formula(a, trainer, n):
    """Bytes of parameters, gradients and Adam's state the textbook formula gives this rank."""
    if a.scheme == "pipeline":
        lo, hi = trainer.bounds[trainer.comm.rank]
        return 16 * sum(sum(p.size for p in layer.parameters())
                        for _, layer in trainer.task.build_model().layers[lo:hi])
    return round(sum(b * n / (a.dp if a.zero >= z else 1) for b, z in ((4, 3), (4, 2), (8, 1))))


def build(experiment, world_size):
    from mpipar import serial
    from mpipar.mpi import comm
    from mpipar.mpi.grid import Grid
    from mpipar.runner import recompute
    from mpipar.runner.cli import parse_args
    from mpipar.train import trainer_class

    built, data = [], None  # a pipeline's experiment waits as the runner's pipeline does
    comm.choose_wait(long_waits=any(s == "pipeline" for _, s, _ in CONFIGS[experiment]))
    for name, scheme, flags in CONFIGS[experiment]:
        a = parse_args(scheme, MODELS[experiment] + COMMON + flags)
        task = serial.Task(a, data)  # the data depends on the model flags only
        data = task.data
        grid = Grid(dp=world_size) if scheme == "data_parallel" else Grid(pp=world_size)
        trainer = trainer_class(scheme, a)(task, grid, a)
        if a.recompute:
            recompute.apply(trainer, a.recompute)
        n = sum(p.size for p in task.build_model().parameters())
        built.append(dict(name=name, trainer=trainer, n=n, formula=formula(a, trainer, n),
                          ledgers=[], times=[]))
    return built


def worker(experiment, rounds, steps):
    from mpi4py import MPI

    from mpipar.mpi import comm
    from mpipar.runner import memory

    comm.install_excepthook()
    world = MPI.COMM_WORLD
    built, step = build(experiment, world.size), 0
    for _ in range(rounds):  # every configuration once per round
        for c in built:
            probe = memory.Probe(c["trainer"])
            c["trainer"].step(step)  # the probed step: untimed
            c["ledgers"].append(probe.ledger())
            times = []
            for _ in range(steps):
                step += 1
                world.Barrier()
                t0 = MPI.Wtime()
                c["trainer"].step(step)
                times.append(world.allreduce(MPI.Wtime() - t0, op=MPI.MAX))
            c["times"].append(statistics.median(times))
    for c in built:
        per_rank = world.gather(dict(ledgers=c["ledgers"], formula=c["formula"]))
        if world.rank == 0:
            emit(dict(experiment=experiment, config=c["name"], ranks=world.size, params=c["n"],
                      per_rank=per_rank, step_s=c["times"]))


# ----------------------------------------------------------------------------- the cost model
VOCAB = {}  # (experiment, width) -> the data set's vocabulary


def update_cost(experiment, repeats=7):
    """Seconds per parameter of Adam's update and zero_grad on the experiment's model in
    float32, timed here (median of ``repeats``): the part of a step that grows with the
    parameters a rank updates, which ZeRO divides by P (``Hardware.update_per_param``)."""
    import statistics
    import time

    from mpipar import serial
    from mpipar.runner.cli import parse_args

    a = parse_args("serial", MODELS[experiment][:6] + COMMON + ["--batch-size", "8"])
    model = serial.Task(a).build_model().init(a.seed)
    opt = serial.make_optimizer(a, model.parameters())
    times = []
    for _ in range(repeats + 1):  # the first makes Adam's state
        t0 = time.perf_counter()
        model.zero_grad()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / sum(p.size for p in model.parameters())


def predict_ms(experiment, config, ranks, rate, alpha, beta, update=0.0, measured=None,
               gather=0.0):
    """The step time (ms) :func:`mpipar.tools.simulate.predict` gives a configuration on ``ranks``
    ranks at ``rate`` FLOP/s: ZeRO's stage sets its traffic (ZeRO-3: 3 calls per layer, the
    others one allreduce's worth), --recompute its backward (full: one more forward; selective:
    attention's core once more). ``measured``: the Allreduces plots/net.csv timed
    (:func:`mpipar.tools.hardware.allreduce_table`), which price the collectives where they apply;
    ``gather``: ZeRO-3's seconds per value gathered (:func:`zero3_cost`)."""
    from mpipar import serial
    from mpipar.runner.cli import parse_args
    from mpipar.tools import simulate as S

    scheme, flags = next((sc, f) for name, sc, f in CONFIGS[experiment] if name == config)
    a = parse_args(scheme, MODELS[experiment] + COMMON + flags, ranks)
    if (experiment, a.d_model) not in VOCAB:  # the data set's vocabulary, read once
        VOCAB[experiment, a.d_model] = serial.Task(a).data.vocab
    spec = S.GPTSpec(VOCAB[experiment, a.d_model], a.d_model, a.n_heads, a.n_layers, a.seq_len)
    dp, pp = (ranks, 1) if scheme == "data_parallel" else (1, ranks)
    hw = S.this_machine(rate, alpha, beta, update_per_param=update, measured=measured,
                        zero3_per_value=gather)
    r = S.predict(spec, hw, dp, 1, pp, a.batch_size,
                  a.micro_batches, getattr(a, "schedule", "1f1b"), 4, getattr(a, "zero", 0),
                  a.recompute)
    return 1e3 * r["step_s"]


def zero3_cost(rows):
    """ZeRO-3's work beyond its collectives, in seconds per parameter value gathered
    (``Hardware.zero3_per_value``): on one rank ZeRO-3 sends nothing, so its step less
    ZeRO-0's, in the same launch, is the gathering into fresh full buffers, their views and
    freeing, and the fresh full gradients, divided by the values gathered per step (every
    layer twice per micro-batch: forward and backward). 0 without a one-rank ZeRO run."""
    from mpipar.runner.cli import parse_args

    one = {r["config"]: r for r in rows if r["experiment"] == "zero" and int(r["ranks"]) == 1}
    if "ZeRO-3" not in one or "ZeRO-0" not in one:
        return 0.0
    micro = parse_args("data_parallel", MODELS["zero"] + COMMON).micro_batches
    extra = (float(one["ZeRO-3"]["step_ms"]) - float(one["ZeRO-0"]["step_ms"])) / 1e3
    return max(extra, 0.0) / (2 * micro * int(one["ZeRO-3"]["params"]))


def add_predictions(rows):
    """Each row's predicted step time beside the measured: the FLOP rate fitted so that the
    experiment's base configuration (:data:`BASE`) on as many ranks takes its measured median,
    alpha and beta the ping-pong's and the collectives as net.csv timed them
    (:func:`mpipar.tools.hardware.measured_machine`). What the model
    adds to the base is then the prediction under test: ZeRO-3's allgathers and reduce-scatters
    per layer, recomputation's extra forward. Meant for a core per rank (``oversubscribed``
    False); where ranks share cores the fitted rate holds their sharing too."""
    from mpipar.tools.hardware import measured_machine

    ping, updates, gather = measured_machine(), {}, zero3_cost(rows)
    for (experiment, ranks), group in _groups(rows).items():
        if experiment not in updates:
            updates[experiment] = update_cost(experiment)
        links = (ping.net_alpha, ping.net_beta, updates[experiment], ping.measured, gather)
        base = next(r for r in group if r["config"] == BASE[experiment])
        # the step is C / rate + what does not compute (update, messages): fit C / rate to
        # what the base's measured time leaves beyond the rest
        rest = predict_ms(experiment, BASE[experiment], ranks, 1e30, *links)
        flop_s = (predict_ms(experiment, BASE[experiment], ranks, 1.0, *links) - rest)
        rate = flop_s / max(base["step_ms"] - rest, 1e-6)
        for r in group:
            r["predicted_step_ms"] = round(predict_ms(experiment, r["config"], ranks, rate,
                                                      *links), 3)
            r["predicted_over_measured"] = round(r["predicted_step_ms"] / r["step_ms"], 3)
            r["fitted_gflops"] = round(rate / 1e9, 3)
            r["update_ns_per_param"] = round(updates[experiment] * 1e9, 3)
            r["zero3_ns_per_value"] = round(gather * 1e9, 4)


def _groups(rows):
    out = {}
    for r in rows:
        out.setdefault((r["experiment"], int(r["ranks"])), []).append(r)
    return out


# ----------------------------------------------------------------------------- rows and plot
def rows_of(res, rounds, steps, load):
    rows = []
    times = [1e3 * t for t in res["step_s"]]
    for rank, mine in enumerate(res["per_rank"]):
        ledgers = mine["ledgers"]
        kinds = {f"{k}_bytes": statistics.median(g[k] for g in ledgers) for k in KINDS}
        peaks = [g["peak"] for g in ledgers]
        rows.append(dict(environment(res["ranks"]), bench="memory",
                         experiment=res["experiment"], config=res["config"], rank=rank,
                         model=" ".join(MODELS[res["experiment"]][:8]), params=res["params"],
                         **kinds, peak_bytes=statistics.median(peaks), peak_bytes_min=min(peaks),
                         peak_bytes_max=max(peaks), formula_bytes=mine["formula"],
                         step_ms=round(statistics.median(times), 3),
                         step_ms_min=round(min(times), 3), step_ms_max=round(max(times), 3),
                         rounds=rounds, steps=steps, loadavg_1min=round(load, 2)))
    return rows


def _stacked(ax, labels, rows, room=1.1):
    """One bar per row, stacked by kind (MiB); the formula as a black tick, the peak a dot."""
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:gray")
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for kind, color in zip(KINDS, colors):
        vals = [float(r[f"{kind}_bytes"]) / 2**20 for r in rows]
        ax.bar(x, vals, bottom=bottom, color=color, width=0.7, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(x, [float(r["formula_bytes"]) / 2**20 for r in rows], "k_", ms=18, mew=2,
            label="formula: params + grads + Adam")
    ax.plot(x, [float(r["peak_bytes"]) / 2**20 for r in rows], "ko", ms=4, mfc="none",
            label="step peak (most held at once)")
    ax.set_ylim(0, room * max(bottom + [float(r["peak_bytes"]) / 2**20 for r in rows]))
    ax.set_xticks(x, labels, fontsize=7, rotation=90)
    ax.set_ylabel("MiB on the rank")
    ax.grid(axis="y", alpha=0.3)


def plot(rows, path):
    plt = pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.8),
                                        gridspec_kw=dict(width_ratios=[3, 2, 3]))
    zero = [r for r in rows if r["experiment"] == "zero" and int(r["rank"]) == 0]
    _stacked(ax1, [f"P={r['ranks']} {r['config']}" for r in zero], zero, room=1.5)
    ax1.set_title("ZeRO 0-3, rank 0\n(every rank alike, within padding)", fontsize=10)
    ax1.legend(fontsize=7, loc="upper right", ncol=2)
    for config in dict.fromkeys(r["config"] for r in zero):
        mine = [r for r in zero if r["config"] == config]
        p = [int(r["ranks"]) for r in mine]
        mid = [float(r["step_ms"]) for r in mine]
        err = [[m - float(r["step_ms_min"]) for m, r in zip(mid, mine)],
               [float(r["step_ms_max"]) - m for m, r in zip(mid, mine)]]
        line = ax2.errorbar(p, mid, yerr=err, marker="o", capsize=3, label=config)
        ax2.plot(p, [float(r["predicted_step_ms"]) for r in mine], "x", ms=8,
                 color=line[0].get_color())
    ax2.set_xticks(sorted({int(r["ranks"]) for r in zero}))
    ax2.set_xlabel("ranks (4 on 2 cores: oversubscribed)")
    ax2.set_ylabel("ms per step (median, min-max; x: cost model)")
    ax2.set_title(f"ZeRO step time\n(load average {float(zero[0]['loadavg_1min']):.1f} at the "
                  "start: a shared machine)", fontsize=10)
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    pipe = [r for r in rows if r["experiment"] == "pipeline"]
    _stacked(ax3, [f"P={r['ranks']} stage {r['rank']}, {r['config'].split()[1]} "
                   f"({float(r['step_ms']):.0f} ms)" for r in pipe], pipe)
    ax3.set_title("Pipeline, 1F1B, 8 micro-batches\nrecompute off/on/selective (step time)",
                  fontsize=10)
    fig.suptitle("Bytes each rank holds, counted by the memory ledger (mpipar/runner/memory.py)")
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("memory")
    ap.sized("--rounds", 5, 2, type=number(), help="rounds over every configuration")
    ap.sized("--steps", 3, 1, type=number(), help="timed steps per configuration and round")
    ap.add_argument("--experiment", default="zero", choices=list(RANKS), help="worker only")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.experiment, args.rounds, args.steps)
        return
    rows, load = [], os.getloadavg()[0]  # other work on the machine, for the record
    for experiment, ranks in RANKS.items():
        for p in ranks:
            for res in run_ranks(p, "mpipar.tools.bench.memory", [
                    "--worker", "--experiment", experiment, "--rounds", args.rounds,
                    "--steps", args.steps]):
                rows += rows_of(res, args.rounds, args.steps, load)
    add_predictions(rows)
    path = write_csv("memory_bench.csv", rows, args.out)
    for r in rows:
        print(f"{r['experiment']:<8} P={r['ranks']} {r['config']:<19} rank {r['rank']}: "
              + ", ".join(f"{k} {r[f'{k}_bytes'] / 2**20:.2f}" for k in KINDS)
              + f" MiB; peak {r['peak_bytes'] / 2**20:.2f} MiB (formula "
              f"{r['formula_bytes'] / 2**20:.2f}); step {r['step_ms']:.1f} ms "
              f"({r['step_ms_min']:.1f}..{r['step_ms_max']:.1f}), predicted "
              f"{r['predicted_step_ms']:.1f} ms")
    wrote(path, plot(rows, args.out / "memory_bench.png"))


if __name__ == "__main__":
    main()
