"""How ranks should wait when they outnumber the cores: every ``MPIPAR_WAIT`` strategy
(:mod:`mpipar.mpi.waiting`) on every scheme, 4 ranks, and the main job on 4 ranks against 2.

    python -m mpipar.tools.bench wait            # wait.csv and wait.png in --out
    python -m mpipar.tools.bench wait --busy-only    # wait_busy.csv and wait_busy.png only

Each scheme's trainer, built from its own command line (its default model) as the runner
builds it, runs on 4 ranks once per strategy, the strategies interleaved round after round, so
that a slow spell of the machine hits each alike. In each launch, 3 warm-up steps, then
``--steps`` steps timed between barriers: the slowest rank's seconds per step (the launch
itself does not count). Each figure is the median over the rounds, with its range; the
default strategy when ranks outnumber cores (:func:`mpipar.mpi.waiting.default`: the pipeline's
is its own) is marked.

Two commands are also timed the same way on 4 ranks and on 2, with the default strategy: the
main job (``mpirun -n N python -m mpipar.pipeline``, the README's demo; 4 ranks / 2 ranks at
most 1.1) and data parallelism with its default MLP and global batch (at most 1.3). On a 2-core
machine 4 ranks cannot be faster than 2; the targets ask that sharing the cores cost little.
Beside them, the same data-parallel step with no framework at all (:class:`BareDP`: bare NumPy
and raw mpi4py, one Iallreduce a step, waited for in the same way), on 4 ranks and on 2: what
sharing the cores costs this machine itself, the floor under the framework's ratio. For the
main job, the same schedule replayed on the shared cores by a perfect scheduler
(:func:`on_shared_cores`, the stages timed by their FLOPs) gives the ratio sharing would cost
if switching ranks were free, and the ranks' CPU time over the cores' wall time (its stages
sleep while they wait, so CPU time is work) says how busy the cores really were. The same
command on 2 ranks that also sleep as they wait gives the CPU time its work takes with a core
per rank; the context switches a step on 4 and on 2 (voluntary: a wait that sleeps;
involuntary: a rank preempted) count what sharing adds; and the main job's model trained by
each rank on its own (ALONE: no messages, no waits) on 4 ranks and on 2 gives what sharing a
core costs the work itself, CPU time a step and rank.

Last, the main job with each strategy beside ``--busy`` busy processes, against the idle
machine (:mod:`mpipar.tools.bench.busy`): what a machine busy with other work costs.
"""

import argparse
import os
import resource
import statistics
import time
from collections import namedtuple

import numpy as np

from mpipar.mpi import waiting
from mpipar.parts import schedules
from mpipar.tools import headlines
from mpipar.tools.bench import busy
from mpipar.tools.bench.common import (
    WAIT_BARE,
    bench_parser,
    cores,
    count_list,
    emit,
    environment,
    number,
    pyplot,
    run_ranks,
    save_figure,
    write_csv,
    wrote,
)
from mpipar.tools.bench.engine import bare_forward

SCHEMES = {
    "dp master": ["mpipar.data_parallel", "--sync", "master"],
    "dp allreduce": ["mpipar.data_parallel", "--sync", "allreduce"],
    "dp ring": ["mpipar.data_parallel", "--sync", "ring"],
    "tensor_parallel": ["mpipar.tensor_parallel"],
    "pipeline": ["mpipar.pipeline", "--timeline", "none"],
    "hybrid": ["mpipar.hybrid"],
}
QUICK_SCHEMES = ("dp ring", "pipeline")
# 4 ranks against 2 on the same command (the same global batch), and the most 4/2 may be;
# "bare" runs BareDP: dp allreduce's step without the framework, the floor (no target)
BARE = WAIT_BARE
PAIRS = {"main job (pipeline)": SCHEMES["pipeline"], "dp allreduce": SCHEMES["dp allreduce"],
         BARE: ["mpipar.bare", *SCHEMES["dp allreduce"][1:]]}
TARGETS = {"main job (pipeline)": 1.1, "dp allreduce": 1.3}


# one launch of a command: seconds a step (the slowest rank's), CPU seconds and context switches
# (voluntary: a wait that sleeps or yields; involuntary: a rank preempted) a step over the ranks
Timing = namedtuple("Timing", "step cpu voluntary involuntary")
# one round of a PAIRS command: its Timing on 2 ranks and on 4 with the default strategy; for
# the pipeline also on 2 ranks that sleep as they wait (asleep), and ALONE on 2 and on 4
Round = namedtuple("Round", "two four asleep alone2 alone4", defaults=(None, None, None))
# the main job's model with no messages ("alone"): every rank trains a whole copy of it on its
# own (the serial trainer, the main job's flags), so 4 ranks on 2 cores do twice the work of 2;
# their CPU time a step per rank against 2's is what sharing a core costs work itself
ALONE = ["mpipar.alone", *SCHEMES["pipeline"][1:]]

DEFAULT_LABELS = {waiting.LONG_WAITS: " (the pipeline's default)",
                  waiting.DEFAULT_OVERSUBSCRIBED: " (the others' default)"}


def on_shared_cores(name, forward, backward, n_micro, n_cores):
    """Makespan of schedule ``name`` replayed with ``n_cores`` cores shared by its stages, by a
    perfect scheduler: switching costs nothing, a rank runs the moment a core is free and its
    input is there (the rank that has waited longest first), messages are free. ``forward``
    and ``backward``: each stage's time for one micro-batch (chunks and split backwards not
    modelled: naive, GPipe and 1F1B only). Returns (makespan, busy share of the cores)."""
    if name not in ("naive", "gpipe", "1f1b"):
        raise ValueError(f"on_shared_cores replays naive, gpipe and 1f1b, not {name}")
    n = len(forward)
    ops = [[(type(i) is schedules.Forward, i.micro) for i in ins
            if isinstance(i, (schedules.Forward, schedules.Backward))]
           for ins in schedules.schedule(name, n, n_micro)]
    finished, free_at, nxt, running, now = {}, [0.0] * n, [0] * n, {}, 0.0
    while running or any(nxt[s] < len(ops[s]) for s in range(n)):
        ready = []
        for s in range(n):
            if s in running or nxt[s] == len(ops[s]):
                continue
            fwd, k = ops[s][nxt[s]]
            needs = (s - 1, True, k) if fwd else (s + 1, False, k)  # the input from a neighbour
            if (fwd and s == 0) or (not fwd and s == n - 1) or finished.get(needs, now + 1) <= now:
                ready.append((max(free_at[s], finished.get(needs, 0.0)), s))
        for _, s in sorted(ready)[:n_cores - len(running)]:
            running[s] = now + (forward if ops[s][nxt[s]][0] else backward)[s]
        s = min(running, key=running.get)
        now = free_at[s] = running.pop(s)
        finished[(s, *ops[s][nxt[s]])] = now
        nxt[s] += 1
    return now, n_micro * (sum(forward) + sum(backward)) / (n_cores * now)


def default_strategy(command):
    """The strategy a command of SCHEMES waits with on 4 ranks on 2 cores."""
    return waiting.default(True, long_waits=command[0] == "mpipar.pipeline")


class BareDP:
    """A data-parallel trainer's step with nothing but NumPy and raw mpi4py: this rank's rows
    of the same global batch (``trainer.own_rows``), forward and backward of the MLP, its
    gradients and its loss summed over the ranks in one Iallreduce of a flat buffer (completed
    by the strategy mpipar's ranks wait with), SGD with momentum. It starts from a copy of
    ``trainer``'s parameters, which it then leaves alone."""

    def __init__(self, trainer):
        from mpi4py import MPI

        from mpipar.mpi import comm

        named = list(trainer.model.named_parameters())
        self.Ws = [p.data.copy() for name, p in named if name.endswith(".W")]
        self.bs = [p.data.copy() for name, p in named if name.endswith(".b")]
        self.velocity = [a * 0 for a in self.Ws + self.bs]
        n = sum(a.size for a in self.Ws + self.bs)
        self.flat, self.total = np.empty((2, n + 1), dtype=self.Ws[0].dtype)  # + the loss
        self.grads, self.sums, at = [], [], 0
        for a in self.Ws + self.bs:  # views: [gradient of each W, then each b], their sums
            self.grads.append(self.flat[at:at + a.size].reshape(a.shape))
            self.sums.append(self.total[at:at + a.size].reshape(a.shape))
            at += a.size
        self.trainer, self.opt, self.world = trainer, trainer.opt, MPI.COMM_WORLD
        self.wait = waiting.STRATEGIES[comm.WAIT]

    def step(self, step):
        x, y, normalizer = self.trainer.own_rows(step)
        Ws, bs, layers = self.Ws, self.bs, len(self.Ws)
        hs, p = bare_forward(Ws, bs, x)
        rows = np.arange(len(y))
        self.flat[-1] = -np.log(p[rows, y]).sum() / normalizer
        dz = p
        dz[rows, y] -= 1
        dz /= normalizer
        for i in range(layers - 1, -1, -1):
            np.matmul(hs[i].T, dz, out=self.grads[i])
            dz.sum(axis=0, out=self.grads[layers + i])
            if i:
                dz = (dz @ Ws[i].T) * (hs[i] > 0)
        self.wait(self.world.Iallreduce(self.flat, self.total), None)
        for w, g, v in zip(Ws + bs, self.sums, self.velocity):
            v *= self.opt.momentum
            v += g
            w -= self.opt.lr * v
        return float(self.total[-1])


def worker(scheme, steps, warmup, argv):
    """On every rank: build ``scheme``'s trainer from its command line as the runner does (for
    "bare", data_parallel's, run as :class:`BareDP`; for "alone", ALONE), run ``warmup``
    steps, then time ``steps`` steps between barriers; rank 0 emits the slowest rank's
    seconds per step, and the CPU seconds and the context switches per step of all the ranks
    together."""
    from mpi4py import MPI

    from mpipar import serial, train
    from mpipar.hybrid import make_grid
    from mpipar.mpi.grid import Grid

    bare, alone = scheme == "bare", scheme == "alone"
    scheme = "data_parallel" if bare else "pipeline" if alone else scheme
    a = train.parse_args(scheme, [*argv, "--quiet", "--steps", str(warmup + steps)])
    task = serial.Task(a)
    if alone:  # ALONE: a whole copy of the model on each rank, no messages
        trainer = serial.Serial(task, None, a)
    else:
        grid = make_grid(a.dp, a.tp, a.pp) if scheme == "hybrid" else Grid(a.dp, a.tp, a.pp)
        trainer = train.trainer_class(scheme, a)(task, grid, a)
    if bare:
        trainer = BareDP(trainer)
    for step in range(warmup):
        trainer.step(step)
    world = MPI.COMM_WORLD
    world.Barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    use0 = resource.getrusage(resource.RUSAGE_SELF)
    for step in range(warmup, warmup + steps):
        trainer.step(step)
    use, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    elapsed = world.allreduce(elapsed, op=MPI.MAX)
    cpu = world.allreduce(time.process_time() - cpu0, op=MPI.SUM)  # over the ranks
    switches = world.allreduce(np.array([use.ru_nvcsw - use0.ru_nvcsw,
                                         use.ru_nivcsw - use0.ru_nivcsw]), op=MPI.SUM)
    if world.rank == 0:
        emit({"seconds_per_step": elapsed / steps, "cpu_seconds_per_step": cpu / steps,
              "switches_per_step": [int(n) / steps for n in switches]})


def step_time(n, command, steps, strategy=None):
    """The :data:`Timing` of ``command`` on ``n`` ranks with ``MPIPAR_WAIT=strategy`` (None:
    the default), timed inside the job: the launch itself does not count."""
    module, *flags = command
    (res,) = run_ranks(n, "mpipar.tools.bench.wait", ["--worker", module.split(".")[-1], "--steps",
                                                steps, "--", *flags],
                       env={"MPIPAR_WAIT": strategy})
    return Timing(res["seconds_per_step"], res["cpu_seconds_per_step"],
                  *res["switches_per_step"])


def measure(schemes, strategies, rounds, steps):
    """{(scheme, strategy): [seconds per step, one per round]}, and for each command of
    ``PAIRS`` a :data:`Round` per round; for the pipeline, whose 4 ranks sleep as they wait,
    with its 2 ranks sleeping too (their CPU time is then their work) and with ALONE."""
    times = {(s, w): [] for s in schemes for w in strategies}
    pairs = {name: [] for name in PAIRS}
    for _ in range(rounds):
        for scheme in schemes:
            for strategy in strategies:
                times[scheme, strategy].append(step_time(4, SCHEMES[scheme], steps, strategy)[0])
        for name, command in PAIRS.items():
            pair = step_time(2, command, steps), step_time(4, command, steps)
            if command[0] == "mpipar.pipeline":
                pair += (step_time(2, command, steps, default_strategy(command)),
                         step_time(2, ALONE, steps), step_time(4, ALONE, steps))
            pairs[name].append(Round(*pair))
    return times, pairs


def ideal(command, n_cores=2):
    """The pipeline ``command`` on 4 ranks sharing ``n_cores`` cores under a perfect scheduler
    (:func:`on_shared_cores`), its stages timed by their FLOPs as the pipeline cuts them:
    (4-rank makespan / 2-rank makespan with a core each, busy share of the cores on 4)."""
    from mpipar import serial
    from mpipar.parts import plan
    from mpipar.runner.cli import parse_args

    span = {}
    for n in (2, 4):
        a = parse_args("pipeline", [*command[1:], "--quiet"], n)
        counts, flops = plan.plan_stages(serial.Task(a), n, a.micro_batches, a.partition)
        fwd = [sum(flops[lo:hi]) for lo, hi in plan.stage_bounds(counts)]
        span[n] = on_shared_cores(a.schedule, fwd, [2 * f for f in fwd], a.micro_batches,
                                  min(n, n_cores))
    return span[4][0] / span[2][0], span[4][1]


def pair_row(name, measured, load):
    """wait.csv's row of a PAIRS command from its :data:`Round` s: the 4 / 2 ratio (median,
    range, each round's); for the pipeline also its CPU time and context switches a step on 4
    ranks and on 2 that sleep as they wait too, ALONE's CPU time a step and rank on 4 over on
    2, the cores' busy share and the perfect scheduler's (:func:`ideal`)."""
    def median(values):
        return round(statistics.median(values), 3)

    ratios = [r.four.step / r.two.step for r in measured]
    row = dict(environment(ranks=4), bench="wait", scheme=f"{name}: 4 / 2 ranks",
               strategy=default_strategy(PAIRS[name]), default=True,
               step_ms=median(r.four.step * 1e3 for r in measured),
               ratio=round(statistics.median(ratios), 3), ratio_min=round(min(ratios), 3),
               ratio_max=round(max(ratios), 3), target=TARGETS.get(name, ""),
               rounds=len(ratios), round_ratios=";".join(f"{r:.3f}" for r in ratios),
               loadavg_1min=load)
    if PAIRS[name][0] == "mpipar.pipeline":  # its stages sleep as they wait: CPU time is work
        busy = [r.four.cpu / (cores() * r.four.step) for r in measured]
        ideal_ratio, ideal_busy = ideal(PAIRS[name], cores())
        row.update(cpu_ms=median(r.four.cpu * 1e3 for r in measured),
                   cpu2_ms=median(r.asleep.cpu * 1e3 for r in measured),
                   voluntary=median(r.four.voluntary for r in measured),
                   involuntary=median(r.four.involuntary for r in measured),
                   voluntary2=median(r.asleep.voluntary for r in measured),
                   involuntary2=median(r.asleep.involuntary for r in measured),
                   alone_cpu_ratio=median((r.alone4.cpu / 4) / (r.alone2.cpu / 2)
                                          for r in measured),
                   busy_share=median(busy),
                   ideal_ratio=round(ideal_ratio, 3), ideal_busy_share=round(ideal_busy, 3))
    return row


def plot(rows, path):
    """wait.png from wait.csv's rows (as written, or as read back): left, each scheme's step
    per strategy over its fastest strategy's; right, each PAIRS command's 4 / 2 ratio (median,
    range over rounds) beside its target and, for the main job, the perfect scheduler's."""
    plt = pyplot()
    cells = [r for r in rows if r.get("ratio") in (None, "")]
    pairs = [r for r in rows if r.get("ratio") not in (None, "")]
    schemes = list(dict.fromkeys(r["scheme"] for r in cells))
    strategies = list(dict.fromkeys(r["strategy"] for r in cells))
    fig, (ax, right) = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=(2.2, 1))
    width = 0.8 / len(strategies)
    for i, strategy in enumerate(strategies):
        mine = [next(r for r in cells if r["scheme"] == s and r["strategy"] == strategy)
                for s in schemes]
        # each scheme's time over its fastest strategy's: the strategies side by side
        best = [min(float(r["step_ms"]) for r in cells if r["scheme"] == s) for s in schemes]
        ax.bar([k + i * width for k in range(len(schemes))],
               [float(r["step_ms"]) / b for r, b in zip(mine, best)], width,
               label=strategy + DEFAULT_LABELS.get(strategy, ""))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(schemes))], schemes, fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("step time / the fastest strategy's")
    ax.set_title("4 ranks on 2 cores: how each rank waits (median over rounds)")
    ax.legend(fontsize=8)
    for k, r in enumerate(pairs):
        ratio = float(r["ratio"])
        right.bar(k, ratio, 0.6, color="tab:grey" if r["target"] in (None, "") else "tab:blue",
                  yerr=[[ratio - float(r["ratio_min"])], [float(r["ratio_max"]) - ratio]],
                  capsize=4)
        if r["target"] not in (None, ""):
            right.hlines(float(r["target"]), k - 0.4, k + 0.4, colors="tab:red",
                         label="target" if k == 0 else None)
        if r.get("ideal_ratio") not in (None, ""):
            right.plot(k, float(r["ideal_ratio"]), "k*", ms=10, label="perfect scheduler")
    right.set_xticks(range(len(pairs)), [r["scheme"].split(":")[0].replace(" in ", "\nin ")
                                         for r in pairs], fontsize=8)
    right.axhline(1.0, color="k", lw=0.8)
    right.set_ylabel("4 ranks / 2 ranks, per step")
    right.set_title("sharing 2 cores (grey: no framework)")
    right.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("wait", "two schemes, two rounds, fewer steps", worker=False)
    ap.sized("--rounds", 5, 2, type=number(), help="rounds over every scheme and strategy, "
             "each a launch of every command (a 4 / 2 ratio varies from launch to launch)")
    ap.sized("--steps", 20, 10, type=number(),
             help="timed steps per launch, after 3 warm-up steps")
    ap.sized("--busy", [1, 2, 4], [2], type=count_list(),
             help="the main job also beside this many busy processes, each count against the "
                  "idle machine (wait_busy.csv, wait_busy.png)")
    ap.add_argument("--busy-only", action="store_true",
                    help="measure only the main job beside busy processes")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("flags", nargs="*", help=argparse.SUPPRESS)  # the worker's trainer's
    args = ap.parse_args(argv)
    if args.flags and not args.worker:
        ap.error(f"unrecognized arguments: {' '.join(args.flags)}")
    if args.worker:
        return worker(args.worker, args.steps, 3, args.flags)
    strategies = tuple(waiting.STRATEGIES)
    load = round(os.getloadavg()[0], 2)
    if not args.busy_only:
        measure_strategies(args, strategies, load)
    main_job = PAIRS["main job (pipeline)"]
    slowdowns = busy.measure(lambda w: step_time(4, main_job, args.steps, w).step, strategies,
                             args.busy, args.rounds)
    rows = busy.rows_of(slowdowns, default_strategy(main_job), load)
    print(busy.table(rows))
    wrote(write_csv("wait_busy.csv", rows, args.out), busy.plot(rows, args.out / "wait_busy.png"))


def measure_strategies(args, strategies, load):
    """Every scheme with every strategy, and the PAIRS on 4 ranks against 2: wait.csv."""
    schemes = QUICK_SCHEMES if args.quick else tuple(SCHEMES)
    times, pairs = measure(schemes, strategies, args.rounds, args.steps)
    rows = [dict(environment(ranks=4), bench="wait", scheme=s, strategy=w,
                 default=w == default_strategy(SCHEMES[s]),
                 step_ms=round(statistics.median(t) * 1e3, 3), min_ms=round(min(t) * 1e3, 3),
                 max_ms=round(max(t) * 1e3, 3), rounds=len(t), loadavg_1min=load)
            for (s, w), t in times.items()]
    print(f"{'scheme':<16}" + "".join(f"{w:>20}" for w in strategies) + "   (ms per step)")
    for s in schemes:
        cells = [next(r for r in rows if r["scheme"] == s and r["strategy"] == w) for w in
                 strategies]
        print(f"{s:<16}" + "".join(f"{c['step_ms']:8.1f} ({c['min_ms']:4.0f}-{c['max_ms']:<4.0f})"
                                   for c in cells))
    for name, measured in pairs.items():
        rows.append(pair_row(name, measured, load))
        verdict = "the floor: no framework"
        if name in TARGETS:  # as the report judges it: every round, or the median only
            judged = headlines.verdict(headlines.round_ratios(rows[-1]), ("<=", TARGETS[name]))
            verdict = (f"target at most {TARGETS[name]}: "
                       + ("NOT met" if judged == "not met" else judged))
        print(f"{name}: 4 ranks / 2 ranks per step {rows[-1]['ratio']:.2f} "
              f"({rows[-1]['ratio_min']:.2f}..{rows[-1]['ratio_max']:.2f}), {verdict}")
    path = write_csv("wait.csv", rows, args.out)
    wrote(path, plot(rows, args.out / "wait.png"))


if __name__ == "__main__":
    main()
