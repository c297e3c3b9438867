"""How ranks should wait when they outnumber the cores: every ``MPIPAR_WAIT`` strategy
(:mod:`mpipar.waiting`) on every scheme, 4 ranks, and the main job on 4 ranks against 2.

    python -m mpipar.bench wait            # wait.csv and wait.png in --out

Each scheme's trainer, built from its own command line (its default model) as the runner
builds it, runs on 4 ranks once per strategy, the strategies interleaved round after round, so
that a slow spell of the machine hits each alike. In each launch, 3 warm-up steps, then
``--steps`` steps timed between barriers: the slowest rank's seconds per step (the launch
itself does not count). Each figure is the median over the rounds, with its range; the
default strategy when ranks outnumber cores (:func:`mpipar.waiting.default`: the pipeline's
is its own) is marked.

Two commands are also timed the same way on 4 ranks and on 2, with the default strategy: the
main job (``mpirun -n N python -m mpipar.pipeline``, the README's demo; 4 ranks / 2 ranks at
most 1.1) and data parallelism with its default MLP and global batch (at most 1.3). On a 2-core
machine 4 ranks cannot be faster than 2; the targets ask that sharing the cores cost little.
Beside them, the same data-parallel step with no framework at all (:class:`BareDP`: bare NumPy
and raw mpi4py, one Iallreduce a step, waited for in the same way), on 4 ranks and on 2: what
sharing the cores costs this machine itself, the floor under the framework's ratio.
"""

import argparse
import os
import statistics
import time

import numpy as np

from mpipar import waiting
from mpipar.bench.common import (
    bench_parser,
    emit,
    environment,
    pyplot,
    run_ranks,
    save_figure,
    write_csv,
    wrote,
)
from mpipar.bench.engine import bare_forward

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
BARE = "dp allreduce in bare NumPy and mpi4py"
PAIRS = {"main job (pipeline)": SCHEMES["pipeline"], "dp allreduce": SCHEMES["dp allreduce"],
         BARE: ["mpipar.bare", *SCHEMES["dp allreduce"][1:]]}
TARGETS = {"main job (pipeline)": 1.1, "dp allreduce": 1.3}


DEFAULT_LABELS = {waiting.LONG_WAITS: " (the pipeline's default)",
                  waiting.DEFAULT_OVERSUBSCRIBED: " (the others' default)"}


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

        from mpipar import comm

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
    "bare", data_parallel's, run as :class:`BareDP`), run ``warmup`` steps, then time ``steps``
    steps between barriers; rank 0 emits the slowest rank's seconds per step."""
    from mpi4py import MPI

    from mpipar import serial, train
    from mpipar.grid import Grid
    from mpipar.hybrid import make_grid

    bare, scheme = scheme == "bare", "data_parallel" if scheme == "bare" else scheme
    a = train.parse_args(scheme, [*argv, "--quiet", "--steps", str(warmup + steps)])
    task = serial.Task(a)
    grid = make_grid(a.dp, a.tp, a.pp) if scheme == "hybrid" else Grid(a.dp, a.tp, a.pp)
    trainer = train.trainer_class(scheme, a)(task, grid, a)
    if bare:
        trainer = BareDP(trainer)
    for step in range(warmup):
        trainer.step(step)
    world = MPI.COMM_WORLD
    world.Barrier()
    t0 = time.perf_counter()
    for step in range(warmup, warmup + steps):
        trainer.step(step)
    elapsed = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    if world.rank == 0:
        emit({"seconds_per_step": elapsed / steps})


def step_time(n, command, steps, strategy=None):
    """Seconds per step of ``command`` on ``n`` ranks with ``MPIPAR_WAIT=strategy`` (None: the
    default), timed inside the job: the launch itself does not count."""
    module, *flags = command
    (res,) = run_ranks(n, "mpipar.bench.wait", ["--worker", module.split(".")[-1], "--steps",
                                                steps, "--", *flags],
                       env={"MPIPAR_WAIT": strategy})
    return res["seconds_per_step"]


def measure(schemes, strategies, rounds, steps):
    """{(scheme, strategy): [seconds per step, one per round]}, and for each command of
    ``PAIRS`` [(2-rank step, 4-rank step), one per round] with the default strategy."""
    times = {(s, w): [] for s in schemes for w in strategies}
    pairs = {name: [] for name in PAIRS}
    for _ in range(rounds):
        for scheme in schemes:
            for strategy in strategies:
                times[scheme, strategy].append(step_time(4, SCHEMES[scheme], steps, strategy))
        for name, command in PAIRS.items():
            pairs[name].append((step_time(2, command, steps), step_time(4, command, steps)))
    return times, pairs


def plot(rows, path):
    plt = pyplot()
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(strategies)
    for i, strategy in enumerate(strategies):
        mine = [next(r for r in rows if r["scheme"] == s and r["strategy"] == strategy)
                for s in schemes]
        # each scheme's time over its fastest strategy's: the strategies side by side
        best = [min(r["step_ms"] for r in rows if r["scheme"] == s) for s in schemes]
        ax.bar([k + i * width for k in range(len(schemes))],
               [r["step_ms"] / b for r, b in zip(mine, best)], width,
               label=strategy + DEFAULT_LABELS.get(strategy, ""))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(schemes))], schemes)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("step time / the fastest strategy's")
    ax.set_title("4 ranks on 2 cores: how each rank waits (median over rounds)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("wait", "two schemes, two rounds, fewer steps", worker=False)
    ap.sized("--rounds", 3, 2, type=int, help="rounds over every scheme and strategy")
    ap.sized("--steps", 20, 10, type=int, help="timed steps per launch, after 3 warm-up steps")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("flags", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.worker:
        return worker(args.worker, args.steps, 3, args.flags)
    schemes = QUICK_SCHEMES if args.quick else tuple(SCHEMES)
    strategies = tuple(waiting.STRATEGIES)
    load = round(os.getloadavg()[0], 2)
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
        ratios = [four / two for two, four in measured]
        row = dict(environment(ranks=4), bench="wait", scheme=f"{name}: 4 / 2 ranks",
                   strategy=default_strategy(PAIRS[name]), default=True,
                   step_ms=round(statistics.median(f for _, f in measured) * 1e3, 3),
                   ratio=round(statistics.median(ratios), 3), ratio_min=round(min(ratios), 3),
                   ratio_max=round(max(ratios), 3), target=TARGETS.get(name, ""),
                   rounds=len(ratios), loadavg_1min=load)
        rows.append(row)
        verdict = ("the floor: no framework" if name not in TARGETS else
                   f"target at most {row['target']}: "
                   f"{'met' if row['ratio'] <= row['target'] else 'NOT met'}")
        print(f"{name}: 4 ranks / 2 ranks per step {row['ratio']:.2f} ({row['ratio_min']:.2f}.."
              f"{row['ratio_max']:.2f}), {verdict}")
    path = write_csv("wait.csv", rows, args.out)
    wrote(path, plot(rows[:-len(PAIRS)], args.out / "wait.png"))


if __name__ == "__main__":
    main()
