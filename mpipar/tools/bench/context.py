"""Context parallelism's balance: each rank's attention compute with the plain ring, the zigzag
and Ulysses, and the step they make.

    python -m mpipar.tools.bench context   # context.csv and context.png in --out

The GPT of lesson 12 with 256 tokens a sequence (8 rows, width 64, 4 heads, 2 blocks, float32)
on 2 ranks, ``--cp 2``, a core each (on 4 ranks this machine's 2 cores would be shared, and a
rank's wait would let its partner run faster: the balance would not show). Three trainers from
one seed, one per ``--cp-algo``, train ``--warmup`` steps, then ``--steps`` steps of each are
timed, taking turns (a barrier, the step, the slowest rank's time). Each step records each
rank's attention compute (the trace's "attention" spans, :mod:`mpipar.context_parallel`).

Per launch: the medians, each algorithm's step over the ring's, and its balance, the mean of
the ranks' attention time over the busiest's. The causal work allows G/(2G-1) = 2/3 for the
ring on 2 ranks (3/4 for the blocks this code computes, its diagonals whole) and 1 for the
zigzag and Ulysses. The spread is over ``--launches`` launches.
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

ALGOS = ("ring", "zigzag", "ulysses")
FLAGS = ["--model", "gpt", "--seq-len", "256", "--batch-size", "8", "--quiet"]


def worker(warmup, steps):
    from mpi4py import MPI

    from mpipar import serial
    from mpipar.context_parallel import make_grid
    from mpipar.mpi import comm
    from mpipar.mpi.trace import TRACE
    from mpipar.runner.cli import parse_args
    from mpipar.train import trainer_class

    comm.install_excepthook()
    trainers = []
    for algo in ALGOS:
        a = parse_args("context_parallel", FLAGS + ["--cp-algo", algo])
        trainers.append(trainer_class("context_parallel", a)(serial.Task(a), make_grid(a.cp), a))
    attention = [[] for _ in ALGOS]  # this rank's seconds of attention compute, step by step
    times = in_turns(trainers, warmup, steps, lambda i: attention[i].append(
        sum(t1 - t0 for t0, t1, kind, _, _ in TRACE.events if kind == "attention")))
    ranks = MPI.COMM_WORLD.gather([statistics.median(a) for a in attention])
    if ranks is not None:
        for i, algo in enumerate(ALGOS):
            emit(dict(algo=algo, times=times[i], attention=[r[i] for r in ranks]))


def plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    width = 0.35
    for k, algo in enumerate(ALGOS):
        mine = [r for r in rows if r["algo"] == algo]
        per_rank = [statistics.median(float(r[f"attention_ms_rank{i}"]) for r in mine)
                    for i in range(2)]
        balance = statistics.median(float(r["balance"]) for r in mine)
        for i, ms in enumerate(per_rank):
            ax.bar(k + (i - 0.5) * width, ms, width, color=["#4C72B0", "#DD8452"][i],
                   label=f"rank {i}" if k == 0 else None)
        ax.text(k, max(per_rank) * 1.03, f"balance {balance:.2f}", ha="center", fontsize=9)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # room for the labels and the legend
    ax.set_xticks(range(len(ALGOS)))
    ax.set_xticklabels([f"--cp-algo {a}" for a in ALGOS])
    ax.set_ylabel("attention compute a step, ms (median over launches)")
    ax.set_title("Each rank's attention: 2 ranks, 256 tokens (ring allows 2/3 causal, 3/4 "
                 "computed)", fontsize=9)
    ax.legend(loc="upper center", ncol=2)
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("context")
    turns_flags(ap, warmup=6, steps=15)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.warmup, args.steps)
        return
    rows = []
    for launch in range(1, args.launches + 1):
        got = run_ranks(2, "mpipar.tools.bench.context", ["--worker", "--warmup", args.warmup,
                                                          "--steps", args.steps])
        ring = statistics.median(next(r for r in got if r["algo"] == "ring")["times"])
        for r in got:
            att = r["attention"]
            rows.append(dict(environment(2), bench="context", launch=launch, algo=r["algo"],
                             **step_columns(r["times"]),
                             ratio_to_ring=round(statistics.median(r["times"]) / ring, 4),
                             **{f"attention_ms_rank{i}": round(1e3 * t, 3)
                                for i, t in enumerate(att)},
                             balance=round(sum(att) / len(att) / max(att), 4),
                             warmup=args.warmup, steps=args.steps))
    path = write_csv("context.csv", rows, args.out)
    for r in rows:
        print(f"launch {r['launch']}, --cp-algo {r['algo']:<8}: step {r['step_ms']:.2f} ms "
              f"({r['step_ms_min']:.2f}..{r['step_ms_max']:.2f}), {r['ratio_to_ring']:.3f} of "
              f"the ring's; attention {r['attention_ms_rank0']:.2f} and "
              f"{r['attention_ms_rank1']:.2f} ms, balance {r['balance']:.3f}")
    wrote(path, plot(rows, args.out / "context.png"))


if __name__ == "__main__":
    main()
