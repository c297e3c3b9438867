"""Every pipeline schedule with two chunks or one, on one model: the bubble each measures from
its trace beside its formula, and its step beside 1F1B's.

    python -m mpipar.tools.bench schedules   # schedules.csv and schedules.png in --out

The MLP of 8 equal Linear(512, 512) layers (synthetic data, 64 rows a micro-batch, float32), so
that every cut gives equal pieces: 2 layers a stage and 1 a chunk on 4 ranks, 4 and 2 on 2. On
``--ranks`` ranks (2: a core each; 4: two ranks a core, marked oversubscribed) and for each
``--micro`` m, one trainer a schedule: 1f1b and zb-h1 (one chunk a stage), interleaved
(2 chunks, the production warm-up), zb-v and dualpipev (2 chunks in a V; dualpipev needs m >= 2p
and is left out below it). All built from one seed, they train ``--warmup`` steps, then
``--steps`` steps of each are timed, taking turns (a barrier, the step, the slowest rank's
time), so that a slow spell of the machine hits every schedule alike. Each timed step's bubble
comes from its trace, as the pipeline run prints it: 1 - busy / (P x the span from the first
forward to the last backward), W counted busy. The formula beside it takes F, B and W of equal
times (:func:`mpipar.parts.schedules.bubble_formula`). Between the two, the replay: the same
lists run by :func:`mpipar.parts.schedules.simulate` with each rank's and chunk's own measured
forward, backward and W (the median instruction spans, free messages, :func:`replayed`): what
unequal times alone give. The rest of the gap is the messages and the waits for them. The
spread is over ``--launches`` launches.
"""

import statistics

from mpipar.tools.bench.common import (
    PLOTS,
    bench_parser,
    cores,
    count_list,
    csv_rows,
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

SCHEDULES = (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 2), ("dualpipev", 2))
FLAGS = ["--model", "mlp", "--data", "synthetic", "--sizes", ",".join(["512"] * 9), "--quiet"]
ROWS = 64  # a micro-batch's rows


def runs(p, m):
    """The (schedule, chunks) this bench trains on p ranks with m micro-batches."""
    return [(name, v) for name, v in SCHEDULES if name != "dualpipev" or m >= 2 * p]


def worker(micro, warmup, steps):
    from mpi4py import MPI

    from mpipar import serial
    from mpipar.mpi import comm
    from mpipar.mpi.grid import Grid
    from mpipar.mpi.trace import TRACE, measured_bubble, step_summary
    from mpipar.runner.cli import parse_args
    from mpipar.train import trainer_class

    comm.install_excepthook()
    world = MPI.COMM_WORLD
    grid = Grid(pp=world.size)
    cases, trainers = [], []
    for m in micro:
        for name, v in runs(world.size, m):
            a = parse_args("pipeline", FLAGS + ["--schedule", name, "--chunks", str(v),
                                                "--micro-batches", str(m),
                                                "--batch-size", str(ROWS * m)])
            cases.append((name, m))
            trainers.append(trainer_class("pipeline", a)(serial.Task(a), grid, a))
    summaries = [[] for _ in trainers]  # this rank's (first F, last B, busy) a timed step
    spans = [[] for _ in trainers]  # and its instructions' spans: (kind, chunk, split, seconds)

    def record(i):
        summaries[i].append(step_summary(TRACE.events))
        work = [e for e in TRACE.events if e[2] in ("forward", "backward")]  # W: a backward
        split = {(ins.micro, ins.chunk) for _, _, _, ins, info in work if info.get("part")}
        spans[i] += [(info.get("part") or kind, ins.chunk,
                      kind == "backward" and (ins.micro, ins.chunk) in split, t1 - t0)
                     for t0, t1, kind, ins, info in work]

    times = in_turns(trainers, warmup, steps, record)
    ranks = world.gather([summaries, [part_times(s) for s in spans]])
    if ranks is not None:
        for i, (name, m) in enumerate(cases):
            bubbles = [measured_bubble([r[0][i][k] for r in ranks]) for k in range(steps)]
            parts = [r[1][i] for r in ranks]
            emit(dict(schedule=name, m=m, times=times[i], bubble=statistics.median(bubbles),
                      replayed=replayed(name, world.size, m, dict(SCHEDULES)[name], parts)))


def part_times(spans):
    """One rank's median forward and whole backward (B + W where split) of one micro-batch on
    each chunk, and the W's share of a split backward (None where nothing splits)."""
    def median(kind, chunk, split):
        got = [t for k, c, s, t in spans if (k, c, s) == (kind, chunk, split)]
        return statistics.median(got) if got else None

    out = []
    for c in sorted({c for _, c, _, _ in spans}):
        b, w, whole = (median("backward", c, True), median("weight", c, True),
                       median("backward", c, False))
        out.append((median("forward", c, False), whole if b is None else b + w,
                    None if b is None else w / (b + w)))
    return out


def replayed(name, p, m, v, parts):
    """The bubble of the schedule's lists replayed with each rank's and chunk's measured
    forward and backward (``parts``: per rank, :func:`part_times`), free messages."""
    from mpipar.parts.schedules import placement_of, schedule, simulate, simulated_bubble

    shares = [w for rank in parts for _, _, w in rank if w is not None]
    timeline = simulate(schedule(name, p, m, v), [[f for f, _, _ in rank] for rank in parts],
                        [[b for _, b, _ in rank] for rank in parts], 0.0,
                        statistics.mean(shares) if shares else 0.5, placement_of(name))
    return simulated_bubble(timeline)


def plot(rows, path):
    from mpipar.parts.schedules import bubble_formula

    plt = pyplot()
    ranks = sorted({int(r["ranks"]) for r in rows})
    fig, axes = plt.subplots(1, len(ranks), figsize=(5.6 * len(ranks), 4.2), squeeze=False)
    for ax, p in zip(axes[0], ranks):
        mine = [r for r in rows if int(r["ranks"]) == p]
        ms = sorted({int(r["m"]) for r in mine})
        width, labelled = 0.8 / len(SCHEDULES), set()
        for k, (name, v) in enumerate(SCHEDULES):
            for j, m in enumerate(ms):
                got = [float(r["bubble"]) for r in mine if r["schedule"] == name
                       and int(r["m"]) == m]
                if not got:  # dualpipev below m = 2p
                    continue
                x = j + (k - (len(SCHEDULES) - 1) / 2) * width
                ax.bar(x, statistics.median(got), width, color=f"C{k}",
                       label=None if name in labelled else name)
                ax.plot([x - width / 2, x + width / 2], [bubble_formula(p, m, name, v)] * 2,
                        color="black", lw=1.5, label=None if labelled else "formula (F = B = W)")
                labelled |= {name}
        ax.set_xticks(range(len(ms)), [f"m = {m}" for m in ms])
        shared = f", {p} ranks on {cores()} cores" if p > cores() else ""
        ax.set_title(f"{p} stages{shared}: bubble from the trace (median of launches)",
                     fontsize=9)
        ax.set_ylabel("bubble")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # the legend above the bars
        ax.legend(fontsize=8, ncol=3, loc="upper right")
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("schedules")
    turns_flags(ap, warmup=4, steps=12)
    ap.sized("--ranks", [2, 4], [2], type=count_list(), help="pipeline stages, one a rank")
    ap.sized("--micro", [4, 8, 16], [4], type=count_list(), help="micro-batch counts m")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.micro, args.warmup, args.steps)
        return
    rows = []
    for launch in range(1, args.launches + 1):  # rank counts in turn: load hits them alike
        for p in args.ranks:
            got = run_ranks(p, "mpipar.tools.bench.schedules", [
                "--worker", "--micro", ",".join(map(str, args.micro)),
                "--warmup", args.warmup, "--steps", args.steps])
            for r in got:
                base = next(b for b in got if b["schedule"] == "1f1b" and b["m"] == r["m"])
                rows.append(dict(environment(p), bench="schedules", launch=launch,
                                 schedule=r["schedule"], m=r["m"], bubble=round(r["bubble"], 4),
                                 replayed=round(r["replayed"], 4),
                                 **step_columns(r["times"]),
                                 ratio_to_1f1b=round(statistics.median(r["times"])
                                                     / statistics.median(base["times"]), 4),
                                 oversubscribed=p > cores(), warmup=args.warmup,
                                 steps=args.steps))
                print(f"launch {launch}, {p} ranks, m = {r['m']:>2}, {r['schedule']:<11}: "
                      f"bubble {r['bubble']:.3f} (replayed {r['replayed']:.3f}), "
                      f"step {rows[-1]['step_ms']:.1f} ms, "
                      f"{rows[-1]['ratio_to_1f1b']:.3f} of 1F1B's (varies)")
    wrote(write_csv("schedules.csv", rows, args.out), plot(rows, args.out / "schedules.png"))


# ----------------------------------------------------------------------------- the report
def section(folder=PLOTS):
    """REPORT.md's section on ``schedules.csv``: per rank count and m, each schedule's bubble
    (median over the launches, their range) beside its formula, and its step over 1F1B's;
    [] without the CSV."""
    from mpipar.parts.schedules import bubble_formula

    rows = csv_rows(folder, "schedules.csv")
    if not rows:
        return []

    def cell(p, m, name, v):
        mine = [r for r in rows if (int(r["ranks"]), int(r["m"]), r["schedule"]) == (p, m, name)]
        if not mine:
            return f"{name} not run (it needs m >= {2 * p})"
        bubble = sorted(float(r["bubble"]) for r in mine)
        ratio = sorted(float(r["ratio_to_1f1b"]) for r in mine)
        replay = [float(r["replayed"]) for r in mine if r.get("replayed")]  # not in older CSVs
        return (f"{name} {statistics.median(bubble):.3f} ({bubble[0]:.3f}-{bubble[-1]:.3f}; "
                + (f"replayed {statistics.median(replay):.3f}; " if replay else "")
                + f"formula {bubble_formula(p, m, name, v):.3f})"
                + ("" if name == "1f1b" else f", step {statistics.median(ratio):.2f}x"))

    launches = max(int(r["launch"]) for r in rows)
    lines = ["## Pipeline schedules side by side, V-shaped ones too", "",
             "![schedules](schedules.png)", "",
             "`python -m mpipar.tools.bench schedules` trains the MLP of 8 equal Linear(512, "
             "512) layers with 64-row micro-batches under every schedule with one or two "
             f"chunks a stage, in turns, {launches} launches (`schedules.csv`). The bubble each "
             "step measures from its trace, median over the launches and their range (varies), "
             "beside the same lists replayed with each rank's and chunk's measured forward, "
             "backward and W (free messages; median over the launches) and the formula for F, "
             "B and W of equal times, and the step against 1F1B's in the same launch:", ""]
    for p in sorted({int(r["ranks"]) for r in rows}):
        shared = f" ({p} ranks on {cores()} cores: oversubscribed)" if p > cores() else ""
        for m in sorted({int(r["m"]) for r in rows if int(r["ranks"]) == p}):
            lines.append(f"- {p} stages, m = {m}{shared}: "
                         + "; ".join(cell(p, m, name, v) for name, v in SCHEDULES) + ".")
    return lines + ["", "Between the formula and the replay is what unequal times alone give "
                    "(the last piece's loss, a W unlike its B, ranks slowing each other); "
                    "between the replay and the measurement, the messages, the waits for them "
                    "and the time between instructions, which the replay does not count. The "
                    "V-shaped schedules "
                    "hand a micro-batch from piece p-1 to piece p on one rank without a "
                    "message, and compute the loss on rank 0, beside the input. On these CPUs "
                    "no forward runs at the same time as another micro-batch's backward: "
                    "DualPipeV's pairs are an order, its forward's send posted before its "
                    "backward's receive, so a message travels while the next computation "
                    "runs, and nothing else is overlapped "
                    "(lessons/05-pipeline-parallel.md#v-shaped-schedules-zb-v-and-dualpipev).",
                    ""]


if __name__ == "__main__":
    main()
