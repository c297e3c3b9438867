"""The report's headline figures and targets, each over several launches of its benchmark.

    python -m mpipar.tools.report                   # launches the headline benchmarks 3 times
    python -m mpipar.tools.report --launches 5      # more launches, a truer spread

One run's figures on a shared machine are not the project's figures: a slow spell of the
machine moves them all. So the report launches the benchmarks behind each headline several
times (the first launch is the one whose CSVs sit in plots/, the others write into scratch
folders), reads every figure from every launch's CSVs, and gives the median and the range
(lowest..highest) over the launches. A target is

- **met** when every launch meets it,
- **met by the median** when the median does but at least one launch does not,
- **not met** when the median does not.

Beside them, the machine's state in each launch: the 1-minute load average when the launch
began, and the bare-NumPy reference step (the same arithmetic every time: its spread is the
machine's, not the code's).
"""

import os
import statistics
from collections import namedtuple

from mpipar.tools.bench.common import WAIT_BARE as BARE
from mpipar.tools.bench.common import csv_rows

# key: a name for the CSV; text: what it is; bench: the benchmark that measures it;
# target: (comparison, bound) or None; extract(folder) -> the figure, or None if not measured
Headline = namedtuple("Headline", "key text bench target extract")


def _value(folder, name, column, **where):
    """``column`` of the one row of ``name`` whose fields equal ``where``, else None."""
    for row in csv_rows(folder, name):
        if all(str(row.get(k)) == str(v) for k, v in where.items()) and row.get(column):
            return float(row[column])
    return None


def _dp_speedup(mode, p):
    return lambda folder: _value(folder, "dp.csv", "speedup", mode=mode, ranks=p)


def _bubble_gap(p):
    def gap(folder):
        rows = [r for r in csv_rows(folder, "pp.csv") if r["stage"] == "0" and
                int(r["ranks"]) == p and r["schedule"] in ("gpipe", "1f1b")]
        return max((abs(float(r["bubble_measured"]) - float(r["bubble_formula"]))
                    for r in rows), default=None)
    return gap


def _pp_speedup(p, m, schedule="1f1b", csv="pp.csv"):
    return lambda folder: _value(folder, csv, "speedup_vs_serial", ranks=p, m=m,
                                 schedule=schedule, stage=0)


def _overhead(case):
    return lambda folder: _value(folder, "overhead.csv", "ratio", case=case)


def round_ratios(row):
    """A wait.csv pair's 4 / 2 ratio of each round (each a launch of its own), or [its median]
    for a CSV from before the rounds were kept."""
    return [float(v) for v in (row.get("round_ratios") or row["ratio"]).split(";")]


def _shared_cores(name):
    def extract(folder, rounds=False):
        """The 4 / 2 ratio (median over bench wait's rounds), or with ``rounds`` a list: the
        ratio of each round (each a launch of its own) where the CSV keeps them, else [the
        median]. None if not measured."""
        row = next((r for r in csv_rows(folder, "wait.csv")
                    if r["scheme"] == f"{name}: 4 / 2 ranks" and r.get("ratio")), None)
        if row is None:
            return None
        if not rounds:
            return float(row["ratio"])
        return round_ratios(row)
    return extract


def _beside_busy(n):
    def extract(folder, rounds=False):
        """The main job's slowdown beside ``n`` busy processes with its default waiting
        (median over bench wait's rounds; with ``rounds``, each round's). None if not
        measured."""
        row = next((r for r in csv_rows(folder, "wait_busy.csv")
                    if r["busy"] == str(n) and r["default"] == "True"), None)
        if row is None:
            return None
        if not rounds:
            return float(row["slowdown"])
        return [float(v) for v in row["round_slowdowns"].split(";")]
    return extract


HEADLINES = [
    *(Headline(f"engine_{rows}", f"engine / bare NumPy, MLP step at {rows} rows", "overhead",
               ("<=", 1.15), _overhead(f"MLP step, {rows} rows")) for rows in (16, 32, 128)),
    Headline("engine_big", "engine / bare NumPy, the 784-128-...-10 MLP at 128 rows", "engine",
             ("<=", 1.15), lambda f: _value(f, "engine.csv", "ratio")),
    Headline("comm_8", "comm wrapper / raw mpi4py, 8-byte ping-pong", "overhead", ("<=", 1.3),
             _overhead("Send/Recv 8 B")),
    Headline("comm_1m", "comm wrapper / raw mpi4py, 1 MiB ping-pong", "overhead", ("<=", 1.05),
             _overhead("Send/Recv 1 MiB")),
    Headline("dp1_bare", "data parallelism (allreduce), 1 rank / bare-NumPy loop", "dp",
             ("<=", 1.1), lambda f: _value(f, "dp.csv", "vs_bare", mode="allreduce", ranks=1)),
    Headline("dp4_vs_2", "data parallelism (allreduce), 2.2 M parameters: 4 ranks on 2 cores "
             "/ 2 ranks", "dp", ("<=", 1.3),
             lambda f: _value(f, "dp.csv", "vs_2_ranks", mode="allreduce", ranks=4)),
    Headline("dp4_vs_2_small", "data parallelism (allreduce), default MLP: 4 ranks / 2 ranks",
             "wait", ("<=", 1.3), _shared_cores("dp allreduce")),
    Headline("dp4_vs_2_bare", "the same, in bare NumPy and mpi4py (the floor): 4 ranks / 2 "
             "ranks", "wait", None, _shared_cores(BARE)),
    Headline("main_job", "the main job (pipeline demo): 4 ranks / 2 ranks per step", "wait",
             ("<=", 1.1), _shared_cores("main job (pipeline)")),
    Headline("main_job_busy2", "the main job beside 2 busy processes / on the idle machine, "
             "per step", "wait", ("<=", 2.0), _beside_busy(2)),
    Headline("dp2_overlap", "data parallelism, 2 ranks, allreduce + overlap: speedup", "dp",
             (">=", 1.8), _dp_speedup("allreduce+overlap", 2)),
    Headline("dp2_master", "data parallelism, 2 ranks, master scheme: speedup", "dp", None,
             _dp_speedup("master", 2)),
    Headline("pp2_gap", "pipeline, 2 ranks: largest gap, bubble measured vs formula (GPipe, 1F1B)",
             "pp", ("<=", 0.05), _bubble_gap(2)),
    Headline("pp2_m16", "pipeline, 2 ranks, 1F1B, m = 16: speedup over serial", "pp",
             (">=", 1.6), _pp_speedup(2, 16)),
    *(Headline(f"pp2_m16_rows256_{name}", f"pipeline, 2 ranks, {name.upper()}, m = 16 of 256 "
               "rows: speedup over serial", "pp_wide", (">=", 1.6),
               _pp_speedup(2, 16, name, "pp_rows256.csv")) for name in ("1f1b", "zb-h1")),
]


ONCE = ("wait",)  # minutes per launch: launched once, on its own; its CSV has its own rounds


def benches():
    """The benchmarks to launch again, in the order of the headlines."""
    return [b for b in dict.fromkeys(h.bench for h in HEADLINES) if b not in ONCE]


def machine_state(folder):
    """The load when the launch began (from its CSVs) and its bare-NumPy reference step."""
    load = _value(folder, "dp.csv", "loadavg_1min", mode="master", ranks=1)
    return {"loadavg_1min": load, "bare_numpy_ms": _value(folder, "engine.csv", "bare_numpy_ms")}


def collect(folders):
    """One row per headline per launch: the figure read from that launch's CSVs."""
    rows = []
    for launch, folder in enumerate(folders, 1):
        state = machine_state(folder)
        for h in HEADLINES:
            value = h.extract(folder)
            if value is not None:
                rows.append(dict(key=h.key, launch=launch, value=round(value, 4), **state))
    return rows


def with_launch_1(rows, folder):
    """``rows`` with launch 1's figures read afresh from ``folder`` (plots/, launch 1 by
    definition), so that a benchmark run again on its own into plots/ (``bench pp --out
    plots``) moves its headlines with the CSV the report's sections read; the other launches'
    figures stay. (The benchmarks run once keep theirs: :func:`with_once` reads them.)"""
    once = {h.key for h in HEADLINES if h.bench in ONCE}
    fresh = {r["key"]: r for r in collect([folder]) if r["key"] not in once}
    kept = [fresh.pop(r["key"], r) if int(r["launch"]) == 1 else r for r in rows]
    return kept + list(fresh.values())  # in place; a figure new to launch 1 at the end


def with_once(rows, folder):
    """``rows`` with the figures of the benchmarks run once, on their own (``ONCE``), read
    afresh from ``folder`` as launch 1 (they may be newer than the report's launches): one
    value per round of the benchmark where its CSV keeps them, so that its verdict and range
    are over its rounds as the others' are over their launches."""
    once = [h for h in HEADLINES if h.bench in ONCE]
    kept = [r for r in rows if r["key"] not in {h.key for h in once}]
    state = machine_state(folder)
    for h in once:
        kept += [dict(key=h.key, launch=1, value=round(v, 4), **state)
                 for v in h.extract(folder, rounds=True) or []]
    return kept


def meets(value, target):
    op, bound = target
    return value <= bound if op == "<=" else value >= bound


def verdict(values, target):
    if target is None:
        return ""
    if all(meets(v, target) for v in values):
        return "met"
    return "met by the median" if meets(statistics.median(values), target) else "not met"


def summary(rows):
    """Per headline: (headline, median, lowest, highest, launches, verdict)."""
    out = []
    for h in HEADLINES:
        values = [float(r["value"]) for r in rows if r["key"] == h.key]
        if values:
            out.append((h, statistics.median(values), min(values), max(values), len(values),
                        verdict(values, h.target)))
    return out


def table(rows):
    """The Markdown table of the report's first section."""
    lines = ["| figure | median | range over launches | launches | target | |",
             "|---|---|---|---|---|---|"]
    for h, med, lo, hi, n, result in summary(rows):
        target = f"{h.target[0]} {h.target[1]}" if h.target else "-"
        lines.append(f"| {h.text} | {med:.3f} | {lo:.3f} .. {hi:.3f} | {n} | {target} | "
                     f"{result} |")
    return lines


def state_line(rows):
    by_launch = {}
    for r in rows:
        by_launch[int(r["launch"])] = r
    parts = []
    for launch, r in sorted(by_launch.items()):
        load = "?" if r.get("loadavg_1min") in (None, "") else f"{float(r['loadavg_1min']):.2f}"
        bare = "?" if r.get("bare_numpy_ms") in (None, "") else f"{float(r['bare_numpy_ms']):.3f}"
        parts.append(f"launch {launch}: load {load}, bare-NumPy step {bare} ms")
    return "; ".join(parts) + f" ({os.cpu_count()} cores)."


def section(rows):
    """The report's first section: every headline with its spread, and its verdict."""
    if not rows:
        return []
    n = max(int(r["launch"]) for r in rows)
    return [
        "## Headlines and targets",
        "",
        f"Each figure over {n} launch{'es' if n > 1 else ''} of its benchmark (median and "
        "range; `headlines.csv`; `bench wait`'s over its rounds, each a launch of its own, "
        "as it runs on its own). A target is *met* when every launch meets it, *met by the "
        "median* when only the median does. The sections below read the CSVs committed "
        "beside the plots, launch 1's: a figure there is one launch's, anywhere in its "
        "headline's range. The machine during the launches: " + state_line(rows),
        "",
        *table(rows),
        "",
    ]
