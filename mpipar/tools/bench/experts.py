"""What load imbalance costs: an expert-parallel step with its router left alone, against the
same model kept balanced by the load-balancing loss.

    python -m mpipar.tools.bench experts   # experts.csv and experts.png in --out

The mixture-of-experts GPT of lesson 11 (8 experts a block, top-2, float32) on 2 ranks with
``--ep 2``: 4 experts a rank, a core each (on 4 ranks this machine's 2 cores would be shared,
and a busy rank would slow its idle partner's core too). Three trainers from the same seed,
with ``--aux-loss-coef`` 0, 0.01 and 0.1, train ``--warmup`` steps, during which the weaker the
loss, the more tokens the router sends to a few experts; then ``--steps`` steps of each are
timed,
taking turns (a barrier, the step, the slowest rank's time), so that both see the machine in
the same state. Each step records its imbalance: for each MoE layer the rows the busiest
rank's experts ran over the mean of the two ranks, summed over the layers (the time the
slower rank spends in its experts), and the largest max over mean of tokens per expert, as
the run prints it.

Each launch gives the ratio of each median to the balanced one's (0.1); the spread is over
``--launches`` launches. The cost model (:func:`mpipar.tools.simulate.predict` with
``imbalance``, this machine's measured FLOP rate and links) predicts the same ratio from the
two imbalances.
"""

import statistics

from mpipar.tools.bench.common import (
    bench_parser,
    emit,
    environment,
    in_turns,
    pyplot,
    run_ranks,
    save_figure,
    step_columns,
    turns_flags,
    write_csv,
    wrote,
)

COEFS = (0.0, 0.01, 0.1)  # the router left alone, nudged, kept balanced (the baseline)
FLAGS = ["--model", "gpt", "--experts", "8", "--top-k", "2", "--ep", "2", "--quiet"]


def imbalance(trainer):
    """(the busiest rank's rows over the mean, summed over the MoE layers; the largest max over
    mean of tokens per expert) of the step just taken."""
    from mpipar.engine import moe

    layers = [m for m in trainer.model.modules() if isinstance(m, moe.MoE)]
    g = trainer.ep.size
    loads = [m.tokens_per_expert.reshape(g, -1).sum(axis=1) for m in layers]  # rows per rank
    busiest = sum(load.max() for load in loads) / sum(load.mean() for load in loads)
    worst = max(m.tokens_per_expert.max() / m.tokens_per_expert.mean() for m in layers)
    return float(busiest), float(worst)


def worker(warmup, steps):
    from mpi4py import MPI

    from mpipar import serial
    from mpipar.expert_parallel import make_grid
    from mpipar.mpi import comm
    from mpipar.runner.cli import parse_args
    from mpipar.train import trainer_class

    comm.install_excepthook()
    trainers = []
    for coef in COEFS:
        a = parse_args("expert_parallel", FLAGS + ["--aux-loss-coef", str(coef)])
        trainers.append(trainer_class("expert_parallel", a)(serial.Task(a), make_grid(a.ep), a))
    times = in_turns(trainers, warmup, steps)
    if MPI.COMM_WORLD.rank == 0:
        for coef, trainer, seconds in zip(COEFS, trainers, times):
            busiest, worst = imbalance(trainer)
            emit(dict(coef=coef, times=seconds, busiest=busiest, worst=worst))


def predicted_ratio(busiest, balanced):
    """The cost model's step at imbalance ``busiest`` over its step at ``balanced``."""
    from mpipar import serial
    from mpipar.runner.cli import parse_args
    from mpipar.tools import simulate as S

    a = parse_args("expert_parallel", FLAGS, n_ranks=2)
    spec = S.GPTSpec(serial.Task(a).data.vocab, a.d_model, a.n_heads, a.n_layers, a.seq_len,
                     experts=a.experts, top_k=a.top_k)
    hw = S.measured_machine()
    step = [S.predict(spec, hw, dp=2, global_batch=a.batch_size, dtype_bytes=4, ep=2,
                      imbalance=max(1.0, i))["step_s"] for i in (busiest, balanced)]
    return step[0] / step[1]


def plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for coef, marker in zip(COEFS, "o^s"):
        mine = [r for r in rows if float(r["aux_coef"]) == coef]
        x = [float(r["busiest_over_mean"]) for r in mine]
        y = [float(r["ratio_to_balanced"]) for r in mine]
        ax.plot(x, y, marker, label=f"--aux-loss-coef {coef:g}, each launch")
    seen = [float(r["busiest_over_mean"]) for r in rows]
    base, top = min(seen), max(seen)
    grid = [base + (top - base) * i / 20 for i in range(21)]
    ax.plot(grid, [predicted_ratio(i, base) for i in grid], "k--", lw=1,
            label="cost model (simulate --ep 2 --imbalance X)")
    ax.set_xlabel("rows run by the busiest rank's experts over the mean (2 ranks, ep 2)")
    ax.set_ylabel("step time over the balanced run's (same launch)")
    ax.set_title("What an unbalanced router costs: 8 experts, top-2, 4 a rank")
    ax.legend()
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("experts")
    turns_flags(ap, warmup=60, steps=30)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.warmup, args.steps)
        return
    rows = []
    for launch in range(1, args.launches + 1):
        got = run_ranks(2, "mpipar.tools.bench.experts", ["--worker", "--warmup", args.warmup,
                                                          "--steps", args.steps])
        balanced = statistics.median(next(r for r in got if r["coef"] == COEFS[-1])["times"])
        for r in got:
            rows.append(dict(environment(2), bench="experts", launch=launch, aux_coef=r["coef"],
                             **step_columns(r["times"]),
                             ratio_to_balanced=round(statistics.median(r["times"]) / balanced, 4),
                             busiest_over_mean=round(r["busiest"], 4),
                             tokens_per_expert_max_over_mean=round(r["worst"], 4),
                             warmup=args.warmup, steps=args.steps))
    for r in rows:
        balanced = next(b for b in rows if b["launch"] == r["launch"]
                        and b["aux_coef"] == COEFS[-1])
        r["predicted_ratio"] = round(predicted_ratio(r["busiest_over_mean"],
                                                     balanced["busiest_over_mean"]), 4)
    path = write_csv("experts.csv", rows, args.out)
    for r in rows:
        print(f"launch {r['launch']}, --aux-loss-coef {r['aux_coef']:g}: step {r['step_ms']:.2f} "
              f"ms ({r['step_ms_min']:.2f}..{r['step_ms_max']:.2f}), busiest rank "
              f"{r['busiest_over_mean']:.2f} x the mean, ratio {r['ratio_to_balanced']:.3f} "
              f"(cost model {r['predicted_ratio']:.3f})")
    wrote(path, plot(rows, args.out / "experts.png"))


if __name__ == "__main__":
    main()
