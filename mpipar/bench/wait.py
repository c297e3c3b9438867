"""How ranks should wait when they outnumber the cores: every ``MPIPAR_WAIT`` strategy
(:mod:`mpipar.waiting`) on every scheme, 4 ranks, and the main job on 4 ranks against 2.

    python -m mpipar.bench wait            # wait.csv and wait.png in --out

Each scheme's own command line (its default model, ``--quiet``) runs on 4 ranks once per
strategy, the strategies interleaved round after round, so that a slow spell of the machine
hits each alike. A step's time comes from two launches of the same command, ``--steps`` short
and long: (wall(long) - wall(short)) / (long - short), so the launch itself (interpreter,
imports, MPI start-up, building the model) cancels out. Each figure is the median over the
rounds, with its range; the default strategy when ranks outnumber cores
(``waiting.DEFAULT_OVERSUBSCRIBED``) is marked.

Two commands are also timed the same way on 4 ranks and on 2, with the default strategy: the
main job (``mpirun -n N python -m mpipar.pipeline``, the README's demo; 4 ranks / 2 ranks at
most 1.1) and data parallelism with its default MLP and global batch (at most 1.3). On a 2-core
machine 4 ranks cannot be faster than 2; the targets ask that sharing the cores cost little.
"""

import os
import statistics
import subprocess
import sys
import time

from mpipar import waiting
from mpipar.bench.common import (
    ONE_THREAD,
    bench_parser,
    environment,
    mpirun_path,
    pyplot,
    save_figure,
    write_csv,
    wrote,
)

SCHEMES = {
    "dp master": ["mpipar.data_parallel", "--sync", "master"],
    "dp allreduce": ["mpipar.data_parallel", "--sync", "allreduce"],
    "dp ring": ["mpipar.data_parallel", "--sync", "ring"],
    "tensor_parallel": ["mpipar.tensor_parallel"],
    "pipeline": ["mpipar.pipeline", "--timeline", "none"],
    "hybrid": ["mpipar.hybrid"],
}
QUICK_SCHEMES = ("dp ring", "pipeline")
# 4 ranks against 2 on the same command (the same global batch), and the most 4/2 may be
PAIRS = {"main job (pipeline)": SCHEMES["pipeline"], "dp allreduce": SCHEMES["dp allreduce"]}
TARGETS = {"main job (pipeline)": 1.1, "dp allreduce": 1.3}


def wall(n, command, steps, strategy=None):
    """Seconds of one launch of ``mpirun -n n python -m COMMAND --steps steps``."""
    module, *flags = command
    env = dict(os.environ, **ONE_THREAD)
    env.pop("MPIPAR_WAIT", None)
    if strategy:
        env["MPIPAR_WAIT"] = strategy
    cmd = [mpirun_path(), "-n", str(n), sys.executable, "-m", module, *flags, "--quiet",
           "--steps", str(steps)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return time.perf_counter() - t0


def step_time(n, command, short, long, strategy=None):
    return (wall(n, command, long, strategy) - wall(n, command, short, strategy)) / (long - short)


def measure(schemes, strategies, rounds, short, long):
    """{(scheme, strategy): [seconds per step, one per round]}, and for each command of
    ``PAIRS`` [(2-rank step, 4-rank step), one per round] with the default strategy."""
    times = {(s, w): [] for s in schemes for w in strategies}
    pairs = {name: [] for name in PAIRS}
    for _ in range(rounds):
        for scheme in schemes:
            for strategy in strategies:
                times[scheme, strategy].append(step_time(4, SCHEMES[scheme], short, long,
                                                         strategy))
        for name, command in PAIRS.items():
            pairs[name].append((step_time(2, command, short, long),
                                step_time(4, command, short, long)))
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
               label=strategy + (" (default)" if strategy == waiting.DEFAULT_OVERSUBSCRIBED
                                 else ""))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(schemes))], schemes)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("step time / the fastest strategy's")
    ax.set_title("4 ranks on 2 cores: how each rank waits (median over rounds)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("wait", "two schemes, two rounds", worker=False)
    ap.sized("--rounds", 3, 2, type=int, help="rounds over every scheme and strategy")
    ap.add_argument("--steps", default="3,23", help="short and long step counts (default 3,23)")
    args = ap.parse_args(argv)
    short, long = map(int, args.steps.split(","))
    if not 0 < short < long:
        ap.error("--steps wants two step counts, the first smaller: e.g. 3,23")
    schemes = QUICK_SCHEMES if args.quick else tuple(SCHEMES)
    strategies = tuple(waiting.STRATEGIES)
    load = round(os.getloadavg()[0], 2)
    times, pairs = measure(schemes, strategies, args.rounds, short, long)
    rows = [dict(environment(ranks=4), bench="wait", scheme=s, strategy=w,
                 default=w == waiting.DEFAULT_OVERSUBSCRIBED,
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
                   strategy=waiting.DEFAULT_OVERSUBSCRIBED, default=True,
                   step_ms=round(statistics.median(f for _, f in measured) * 1e3, 3),
                   ratio=round(statistics.median(ratios), 3), ratio_min=round(min(ratios), 3),
                   ratio_max=round(max(ratios), 3), target=TARGETS[name], rounds=len(ratios),
                   loadavg_1min=load)
        rows.append(row)
        print(f"{name}: 4 ranks / 2 ranks per step {row['ratio']:.2f} ({row['ratio_min']:.2f}.."
              f"{row['ratio_max']:.2f}), target at most {row['target']}: "
              f"{'met' if row['ratio'] <= row['target'] else 'NOT met'}")
    path = write_csv("wait.csv", rows, args.out)
    wrote(path, plot(rows[:-len(PAIRS)], args.out / "wait.png"))


if __name__ == "__main__":
    main()
