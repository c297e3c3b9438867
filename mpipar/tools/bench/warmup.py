"""The interleaved schedule's two warm-ups across a limited link (root: an emulated cluster).

    sudo python -m mpipar.tools.bench warmup   # warmup.csv and warmup.png in --out

The GPT of the lessons on 2 emulated hosts (:class:`mpipar.tools.cluster.Cluster`), one
pipeline stage on each, ``--schedule interleaved --chunks 2`` with ``--micro-batches 8``: for
each link rate of ``--rates`` (none: no limit) and each ``--warmup`` (production, lean), one
launch after the other, ``--launches`` times over, the bubble each run measures from its trace
(the median over its steps) and the stash it prints. A message's latency here is its size over
the rate (and the queue); the simulator's replay of the same lists
(:func:`mpipar.tools.figures.layouts.warmup_run`) predicts the lean list's bubble to grow
faster with it than the production one's. Timings vary from run to run: every launch is kept,
and the report gives the median and the spread.
"""

import os
import re
import statistics
import subprocess
import sys

from mpipar.tools.bench.common import (
    bench_parser,
    environment,
    number,
    pyplot,
    save_figure,
    write_csv,
    wrote,
)

WARMUPS = ("production", "lean")
FLAGS = ["--model", "gpt", "--schedule", "interleaved", "--chunks", "2", "--micro-batches", "8",
         "--quiet", "--timeline", "none"]
BUBBLE = re.compile(r"bubble measured from the trace (\d+\.\d+)")
STASH = re.compile(r"peak activation stash per stage: (.*)")


def run(bits, warmup, steps):
    """One pipeline run on 2 hosts joined at ``bits``/s (None: no limit): (bubble, stash)."""
    from mpipar.tools import cluster

    with cluster.Cluster(2, bits) as c:
        env = c.env(dict(os.environ, OMP_NUM_THREADS="1"))
        line = cluster.mpiexec_line(2, ["-n", "2", sys.executable, "-m", "mpipar.pipeline",
                                        *FLAGS, "--warmup", warmup, "--steps", str(steps)])
        proc = subprocess.run(line, env=env, capture_output=True, text=True, timeout=600)
    bubble = BUBBLE.search(proc.stdout)
    if proc.returncode or bubble is None:
        raise SystemExit(f"{' '.join(line)} failed:\n{proc.stdout}\n{proc.stderr}")
    return float(bubble.group(1)), STASH.search(proc.stdout).group(1)


def plot(rows, rates, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for warmup, style in (("production", "o-"), ("lean", "s--")):
        medians = [statistics.median(float(r["bubble"]) for r in rows
                                     if r["rate"] == rate and r["warmup"] == warmup)
                   for rate in rates]
        ax.plot(range(len(rates)), medians, style, label=f"--warmup {warmup}")
        for i, rate in enumerate(rates):
            got = [float(r["bubble"]) for r in rows if r["rate"] == rate and r["warmup"] == warmup]
            ax.plot([i] * len(got), got, "." if warmup == "production" else "x", color="gray")
    ax.set_xticks(range(len(rates)), rates)
    ax.set_xlabel("link rate between the 2 emulated hosts (none: no limit)")
    ax.set_ylabel("bubble measured from the trace")
    ax.set_title("interleaved 1F1B, 2 stages x 2 chunks, 8 micro-batches: median and launches",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None):
    from mpipar.tools import cluster
    from mpipar.tools.bench.link import rate_list

    ap = bench_parser("warmup", "two rates, one launch, fewer steps", worker=False)
    ap.sized("--rates", "none,1gbit,500mbit,250mbit", "none,250mbit", type=rate_list,
             help="link rates, as tc writes them (none: no limit)")
    ap.sized("--launches", 3, 1, type=number(), help="times over every rate and warm-up")
    ap.sized("--steps", 20, 6, type=number(), help="training steps of each run")
    args = ap.parse_args(argv)
    reason = cluster.unavailable()
    if reason:
        raise SystemExit(f"cannot emulate hosts: {reason}")
    rates, rows = args.rates.split(","), []
    for launch in range(args.launches):  # rate after rate, so that load hits every rate alike
        for rate in rates:
            for warmup in WARMUPS:
                bubble, stash = run(cluster.parse_rate(rate), warmup, args.steps)
                rows.append(dict(environment(2), bench="warmup", rate=rate, warmup=warmup,
                                 launch=launch + 1, bubble=bubble, stash=stash))
                print(f"{rate:>8} --warmup {warmup:<10} launch {launch + 1}: bubble {bubble:.3f}"
                      f" (varies); stash {stash}")
    wrote(write_csv("warmup.csv", rows, args.out), plot(rows, rates, args.out / "warmup.png"))


if __name__ == "__main__":
    main()
