"""The main job on a busy machine: its step time beside 1, 2 or 4 busy processes, over its
step time on the idle machine, for every waiting strategy (``bench wait --busy 1,2,4``).

A learner's laptop is rarely idle. Each busy process is a Python loop that never waits
(``while True: pass``), at the same priority as the ranks, so 4 ranks and N busy processes
share the cores. A round times the main job (4 ranks, ``mpipar.pipeline``'s defaults, through
:func:`mpipar.tools.bench.wait.step_time`) with each strategy on the idle machine, then beside
each count of busy processes; a slowdown is a round's busy step over the same round's idle step
with the same strategy, so that a slow spell of the machine hits both alike. The figure is the
median over the rounds, with the range. The default strategy (the pipeline's,
:func:`mpipar.mpi.waiting.default`) should stay within ``TARGET`` beside 2 busy processes.

Why waiting matters here: a rank that spins or yields while it waits is runnable, so the
scheduler shares the cores between it, the rank it waits for and the busy processes alike; a
rank that sleeps is not, and the rank doing the work gets a larger share.
"""

import statistics
import subprocess
import sys
from contextlib import contextmanager

from mpipar.tools.bench.common import environment, pyplot, save_figure

TARGET = (2, 2.0)  # beside 2 busy processes, the default strategy's slowdown at most 2.0
LOOP = "while True: pass"  # a busy process: all CPU, no waiting


@contextmanager
def busy_processes(n):
    """``n`` busy processes (:data:`LOOP`) for the length of the block, killed at its end."""
    procs = [subprocess.Popen([sys.executable, "-c", LOOP]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def measure(time_step, strategies, counts, rounds):
    """{(busy count, strategy): [slowdown, one per round]}: ``time_step(strategy)`` (seconds a
    step) beside each count of ``counts`` busy processes over on the idle machine, in the same
    round."""
    slowdowns = {(n, w): [] for n in counts for w in strategies}
    for _ in range(rounds):
        idle = {w: time_step(w) for w in strategies}
        for n in counts:
            with busy_processes(n):
                for w in strategies:
                    slowdowns[n, w].append(time_step(w) / idle[w])
    return slowdowns


def rows_of(slowdowns, default, load):
    """wait_busy.csv's rows: one per busy count and strategy."""
    return [dict(environment(ranks=4), bench="wait", scheme="main job (pipeline)", busy=n,
                 strategy=w, default=w == default,
                 slowdown=round(statistics.median(s), 3), slowdown_min=round(min(s), 3),
                 slowdown_max=round(max(s), 3), rounds=len(s),
                 round_slowdowns=";".join(f"{v:.3f}" for v in s),
                 target=TARGET[1] if n == TARGET[0] and w == default else "",
                 loadavg_1min=load)
            for (n, w), s in slowdowns.items()]


def table(rows):
    """The printed table: a line per strategy, a column per busy count, and the verdict."""
    counts = list(dict.fromkeys(r["busy"] for r in rows))
    lines = ["main job beside N busy processes, step time / on the idle machine "
             "(median over rounds, range):",
             f"{'strategy':<18}" + "".join(f"{f'N = {n}':>20}" for n in counts)]
    for w in dict.fromkeys(r["strategy"] for r in rows):
        mine = {r["busy"]: r for r in rows if r["strategy"] == w}
        lines.append(f"{w + (' (default)' if mine[counts[0]]['default'] else ''):<18}" + "".join(
            f"{mine[n]['slowdown']:8.2f} ({mine[n]['slowdown_min']:.2f}-"
            f"{mine[n]['slowdown_max']:.2f})" for n in counts))
    judged = [r for r in rows if r["target"] != ""]
    for r in judged:
        met = r["slowdown"] <= r["target"]
        lines.append(f"default ({r['strategy']}) beside {r['busy']} busy processes: "
                     f"{r['slowdown']:.2f}, target at most {r['target']}: "
                     + ("met" if met else "NOT met"))
    return "\n".join(lines)


def plot(rows, path):
    """wait_busy.png: each strategy's slowdown against the number of busy processes."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for w in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == w]
        x = [int(r["busy"]) for r in mine]
        y = [float(r["slowdown"]) for r in mine]
        err = [[v - float(r["slowdown_min"]) for v, r in zip(y, mine)],
               [float(r["slowdown_max"]) - v for v, r in zip(y, mine)]]
        default = any(str(r["default"]) == "True" for r in mine)
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, lw=2.5 if default else 1.2,
                    label=w + (" (the pipeline's default)" if default else ""))
    ax.plot([TARGET[0]], [TARGET[1]], "kv", ms=9, label=f"target: at most {TARGET[1]}")
    ax.set_xticks(sorted({int(r["busy"]) for r in rows}))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("busy processes beside the 4 ranks (2 cores)")
    ax.set_ylabel("step time / on the idle machine")
    ax.set_title("the main job on a busy machine (median over rounds)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
