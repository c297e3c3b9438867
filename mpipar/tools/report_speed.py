"""The report's section on speed at learners' sizes: what the project's layers cost against the
bare calls, and what sharing 2 cores among 4 ranks costs. Every number is read from a CSV:
``overhead.csv`` (:mod:`mpipar.tools.bench.overhead`), ``dp.csv`` (:mod:`mpipar.tools.bench.dp`) and
``wait.csv`` (:mod:`mpipar.tools.bench.wait`); a CSV that is missing leaves its paragraph out.
"""

from mpipar.tools import headlines
from mpipar.tools.bench.common import PLOTS, csv_rows
from mpipar.tools.bench.wait import BARE


def _verdict(value, target):
    return "met" if float(value) <= float(target) else "**not met**"


def _rounds_verdict(row):
    """A wait.csv pair judged as the headlines judge it: met in every round, by the median
    only, or not met (an older CSV without its rounds: by its median)."""
    verdict = headlines.verdict(headlines.round_ratios(row), ("<=", float(row["target"])))
    return "**not met**" if verdict == "not met" else verdict


def _cell(row, median, low, high, digits):
    """A table cell: the median and its range over the rounds, in bold for the default."""
    text = f"{float(row[median]):.{digits}f} ({float(row[low]):.{digits}f}-" \
           f"{float(row[high]):.{digits}f})"
    return f"**{text}**" if row["default"] == "True" else text


def overhead_lines(folder=PLOTS):
    rows = csv_rows(folder, "overhead.csv")
    if not rows:
        return []
    lines = ["![overhead](overhead.png)", "",
             "| case | mpipar (ms) | bare (ms) | ratio: median (range over rounds) | target | |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {float(r['mine_ms']):.4f} | {float(r['base_ms']):.4f} | "
                     f"{float(r['ratio']):.2f} ({float(r['ratio_min']):.2f}..."
                     f"{float(r['ratio_max']):.2f}) | {r['target']} | "
                     f"{_verdict(r['ratio'], r['target'])} |")
    return lines + ["", "The comm wrapper against raw mpi4py (a ping-pong between 2 ranks, "
                    "one way) and the engine against the same MLP step in bare NumPy at the "
                    "micro-batch sizes of the lessons, the two sides alternating in one run "
                    "(`overhead.csv`). What the wrapper adds per call is its bookkeeping in "
                    "Python (checks, counters, the trace and the flight recorder): a fixed "
                    "cost that an 8-byte message shows and a 1 MiB one hides.", ""]


def dp_lines(folder=PLOTS):
    dp = csv_rows(folder, "dp.csv")
    bare = [r for r in dp if r.get("vs_bare")]
    over = [r for r in dp if r.get("vs_2_ranks")]
    lines = []
    if bare:
        lines.append("Data parallelism on 1 rank against a bare-NumPy loop doing the same "
                     "step (target at most 1.1; `dp.csv`): " + ", ".join(
                         f"{r['mode']} {float(r['vs_bare']):.2f} ({float(r['vs_bare_min']):.2f}"
                         f"..{float(r['vs_bare_max']):.2f})" for r in bare) + ".")
    if over:
        lines.append("The same model on 4 ranks (2 cores shared) against 2 ranks, the same "
                     "global batch: " + ", ".join(
                         f"{r['mode']} {float(r['vs_2_ranks']):.2f}x "
                         f"({float(r['vs_2_ranks_min']):.2f}..{float(r['vs_2_ranks_max']):.2f})"
                         for r in over) + " (target for allreduce at most 1.3).")
    return [" ".join(lines), ""] if lines else []


def wait_lines(folder=PLOTS):
    rows = csv_rows(folder, "wait.csv")
    if not rows:
        return []
    cells = [r for r in rows if not r.get("ratio")]
    pairs = [r for r in rows if r.get("ratio")]
    strategies = list(dict.fromkeys(r["strategy"] for r in cells))
    lines = ["![waiting](wait.png)", "",
             "Milliseconds per step on 4 ranks on 2 cores, per waiting strategy (`MPIPAR_WAIT`; "
             "median over rounds, with the range; each scheme's default in bold; `wait.csv`, "
             f"measured at load {float(rows[0]['loadavg_1min']):.2f}):", "",
             "| scheme | " + " | ".join(strategies) + " |", "|---" * (len(strategies) + 1) + "|"]
    for scheme in dict.fromkeys(r["scheme"] for r in cells):
        mine = {r["strategy"]: r for r in cells if r["scheme"] == scheme}
        lines.append(f"| {scheme} | " + " | ".join(
            _cell(mine[s], "step_ms", "min_ms", "max_ms", 1) for s in strategies) + " |")
    lines += ["", "Sharing the cores: " + "; ".join(
        f"{r['scheme']} {float(r['ratio']):.2f} ({float(r['ratio_min']):.2f}.."
        f"{float(r['ratio_max']):.2f}), " + (f"target at most {r['target']}: "
                                             f"{_rounds_verdict(r)}"
                                             if r["target"] else "no target")
        for r in pairs) + ".", ""]
    return lines + floor_lines(pairs) + main_job_lines(pairs)


def main_job_lines(pairs):
    """The main job's 4 / 2 ratio beside a perfect scheduler's (bench wait's ideal_ratio), and
    where the CPU time goes: its 2 ranks' when they sleep as they wait too, the context
    switches of each, and ALONE's 4 / 2 CPU time (wait.csv's cpu2_ms, switch counts and
    alone_cpu_ratio, where the run measured them)."""
    row = next((r for r in pairs if r.get("ideal_ratio")), None)
    if row is None:
        return []
    busy, ideal_busy = float(row["busy_share"]), float(row["ideal_busy_share"])
    cpu, cpu2 = float(row["cpu_ms"]), row.get("cpu2_ms")
    work = ("" if cpu2 in (None, "") else
            f" (on 2 ranks that also sleep as they wait, {float(cpu2):.1f} ms: 4 ranks spend "
            f"{cpu / float(cpu2):.2f}x the CPU time on the same step)")
    verdict = ("as busy as the perfect scheduler keeps them, or busier: what 4 ranks lose is "
               "not idle cores but CPU time that 2 ranks do not spend (waits that poll and "
               "sleep, three stage boundaries' messages instead of one, switches between "
               "ranks)"
               if busy >= ideal_busy - 0.05 else
               "less busy than the perfect scheduler keeps them: ranks whose input had arrived "
               "were still asleep or waiting for a core")
    switches = ("" if row.get("voluntary") in (None, "") else
                f" Context switches a step over the ranks: {float(row['voluntary']):.0f} "
                f"voluntary (a wait that sleeps) and {float(row['involuntary']):.0f} involuntary "
                f"(a rank preempted, as a waking rank takes the core) on 4 ranks, against "
                f"{float(row['voluntary2']):.0f} and {float(row['involuntary2']):.0f} on 2 "
                "ranks that sleep as they wait: each wake-up on a shared core interrupts the "
                "rank computing there.")
    if row.get("alone_cpu_ratio") not in (None, ""):
        switches += (f" With no messages at all, each rank training a whole copy of the same "
                     f"model on its own (`mpipar/tools/bench/wait.py > ALONE`), 4 ranks on 2 cores "
                     f"spend {float(row['alone_cpu_ratio']):.2f}x the CPU time a step and rank "
                     "of 2: that much of the difference is what sharing a core costs the "
                     "work itself, with no wait in it.")
    return [f"The main job on 4 ranks sharing 2 cores, replayed by a perfect scheduler "
            f"(switching free, a rank running the moment its input is there and a core is "
            f"free, the stages timed by their FLOPs; `mpipar/tools/bench/wait.py > "
            f"on_shared_cores`), "
            f"would take {float(row['ideal_ratio']):.2f} of the 2-rank step, the cores "
            f"{ideal_busy:.0%} busy: 4 shorter stages fill and drain the pipeline sooner. "
            f"Measured, {float(row['ratio']):.2f}, with {cpu:.1f} ms of CPU time a step over "
            f"the ranks{work}: the cores {busy:.0%} busy, {verdict}.{switches}", ""]


def floor_lines(pairs):
    """What the bare loop's 4 / 2 ratio says about the framework's (bench wait's BareDP)."""
    mine = {r["scheme"].split(":")[0]: r for r in pairs}
    bare, dp = mine.get(BARE), mine.get("dp allreduce")
    if not (bare and dp):
        return []
    return [f"The last is the floor: the same data-parallel step with no framework (bare NumPy "
            f"and raw mpi4py: this rank's rows, forward, backward, one Iallreduce of the "
            f"gradients and the loss, SGD), waiting the same way, takes "
            f"{float(bare['ratio']):.2f}x as long on 4 ranks as on 2; mpipar's step "
            f"{float(dp['ratio']):.2f}x, {float(dp['ratio']) / float(bare['ratio']):.2f} times "
            f"the floor's. A step of the default MLP is a fraction of a millisecond, and much of "
            f"it does not shrink with a rank's rows: every replica makes the global batch and "
            f"updates every parameter, so on 4 ranks each core does that work twice. And each "
            f"step ends in a collective that all 4 ranks must reach while 2 of them are "
            f"descheduled: the others wait for a turn of the scheduler. Those costs belong to "
            f"the machine and to data parallelism, not to the framework. The framework's own "
            f"cost shows in the step itself: on 4 ranks {float(dp['step_ms']):.2f} ms against "
            f"the bare loop's {float(bare['step_ms']):.2f} ms "
            f"({float(dp['step_ms']) / float(bare['step_ms']):.2f}x; its layers, checks and "
            f"trace are Python calls, which a step this small does not hide).", ""]


def busy_lines(folder=PLOTS):
    """The main job beside busy processes (bench wait's wait_busy.csv): each strategy's
    slowdown over the idle machine, and the default's verdict beside 2 of them."""
    rows = csv_rows(folder, "wait_busy.csv")
    if not rows:
        return []
    counts = list(dict.fromkeys(r["busy"] for r in rows))
    lines = ["![busy machine](wait_busy.png)", "",
             "The main job beside N busy processes (each a Python loop that never waits, at "
             "the ranks' priority), its step time over the idle machine's with the same "
             "strategy (median over rounds, with the range; the default in bold; "
             f"`wait_busy.csv`, measured at load {float(rows[0]['loadavg_1min']):.2f}):", "",
             "| strategy | " + " | ".join(f"N = {n}" for n in counts) + " |",
             "|---" * (len(counts) + 1) + "|"]
    for w in dict.fromkeys(r["strategy"] for r in rows):
        mine = {r["busy"]: r for r in rows if r["strategy"] == w}
        lines.append(f"| {w} | " + " | ".join(
            _cell(mine[n], "slowdown", "slowdown_min", "slowdown_max", 2) for n in counts) + " |")
    said = []
    for r in (r for r in rows if r["target"]):
        rounds = [float(v) for v in r["round_slowdowns"].split(";")]
        verdict = headlines.verdict(rounds, ("<=", float(r["target"])))
        said.append(f"Beside {r['busy']} busy processes the default ({r['strategy']}) takes "
                    f"{float(r['slowdown']):.2f}x the idle step, target at most {r['target']}: "
                    + ("**not met**" if verdict == "not met" else verdict) + ".")
    fastest = {n: min((r for r in rows if r["busy"] == n), key=lambda r: float(r["slowdown"]))
               for n in counts}
    said.append("Were the cores shared evenly between the 4 ranks and the N busy processes, "
                "the ranks' work would take (4 + N) / 4 of its idle time: " + ", ".join(
                    f"{(4 + int(n)) / 4:.2f} for N = {n}" for n in counts)
                + ". Fastest by the median: " + ", ".join(
                    f"{fastest[n]['strategy']} beside {n}" for n in counts) + ".")
    return lines + ["", " ".join(said), ""]


def speed_section(folder=PLOTS):
    body = overhead_lines(folder) + dp_lines(folder) + wait_lines(folder) + busy_lines(folder)
    return ["## Speed at learners' sizes", "", *body] if body else []
