"""The section "Across an emulated link" of ``plots/REPORT.md``, read from ``plots/link.csv``
(``python -m mpipar.tools.bench.link --out plots``, which needs root: :mod:`mpipar.tools.cluster`).

1. The table: per rate, the across-hosts latency (8 B one way) and 4 MiB one way, then per
   mode the measured data-parallel step, its exposed communication, the prediction of
   :func:`mpipar.tools.bench.link.predict_step` with its error, and the speedup over the serial
   trainer's step on the same model and batch.
2. The text: how many predictions are within 20% and, for those that are not, the spread of
   the measured steps; the rate below which communication dominates (:func:`crossover_bits`);
   what overlap gains; the machine's load.

:mod:`mpipar.tools.report` calls :func:`link_section` with a note when this run could not measure
the link (no root, no namespaces): the section then keeps the committed CSV and says so.
"""

from mpipar.tools.bench.common import PLOTS, csv_rows
from mpipar.tools.bench.common import csv_float as _f
from mpipar.tools.cluster import burst_bytes, format_rate, parse_rate

MODES = ("allreduce", "allreduce+overlap")  # mpipar.tools.bench.link.MODES, without importing MPI
SCHEMES = {"data parallelism, the other sync modes": ("master", "ring"),  # link.OTHERS
           "tensor parallelism": ("tensor_parallel",), "pipeline": ("pipeline",)}
TARGET = 0.2  # the prediction's target: within 20% of the measured step


def link_rows(folder=PLOTS):
    """link.csv's rows, or [] when it has not been written."""
    return csv_rows(folder, "link.csv")


def _bits(rate):
    return parse_rate(rate) or float("inf")  # none: no limit, the fastest


def dp_rows(rows):
    """{(rate, mode): the data-parallel row}, and the rates, fastest first."""
    dp = {(r["bandwidth"], r["mode"]): r for r in rows if r["kind"] == "dp"}
    return dp, sorted({rate for rate, _ in dp}, key=lambda rate: -_bits(rate))


def crossover_bits(rows, p=2):
    """The rate (bits/s) at which the allreduce's bandwidth term, 2(p-1)/p n x 8 / R, equals the
    compute of a step (link.csv's compute_seconds, mode allreduce): below it communication
    takes longer than compute."""
    r = next(r for r in rows if r["kind"] == "dp" and r["mode"] == "allreduce")
    return 2 * (p - 1) / p * 8 * _f(r, "bytes") / _f(r, "compute_seconds")


def outlasts_bits(rows, mode):
    """The rate (bits/s) below which one mode's predicted communication (predicted step less
    compute) outlasts its compute: that communication is a + b / R at the two slowest limited
    rates of link.csv (a line through them in 1/R), set equal to the compute. None where the
    latency part a alone outlasts it, or the bytes' part b is not positive."""
    mine = sorted((r for r in rows if r["kind"] in ("dp", "scheme") and r["mode"] == mode
                   and parse_rate(r["bandwidth"])), key=lambda r: _bits(r["bandwidth"]))[:2]
    (x1, c1), (x2, c2) = ((1 / _bits(r["bandwidth"]),
                           _f(r, "predicted_seconds") - _f(r, "compute_seconds")) for r in mine)
    b = (c1 - c2) / (x1 - x2)
    a, compute = c1 - b * x1, _f(mine[0], "compute_seconds")
    return b / (compute - a) if compute > a and b > 0 else None


def _ms(row, key):
    return f"{_f(row, key) * 1e3:.0f}"


def _cell(row):
    """One step's cell: step, exposed, predicted (error), and its speedup where measured."""
    speedup = f", {_f(row, 'speedup'):.2f}x" if row.get("speedup") else ""
    return (f"{_ms(row, 'seconds')} ms, {_ms(row, 'exposed_seconds')} ms, "
            f"{_ms(row, 'predicted_seconds')} ms ({100 * _f(row, 'prediction_error'):+.0f}%)"
            + speedup)


def _head(mode, rows):
    return f"{mode}: step, exposed, predicted (error)" + (
        ", speedup" if rows and rows[0].get("speedup") else "")


def _table(rows):
    dp, rates = dp_rows(rows)
    across = {(r["bandwidth"], r["bytes"]): r for r in rows
              if r["kind"] == "pingpong" and r["where"] == "across hosts"}
    lines = ["| link | 8 B one way | 4 MiB one way | " + " | ".join(
                _head(m, list(dp.values())) for m in MODES) + " |",
             "|---|---|---|" + "---|" * len(MODES)]
    for rate in rates:
        small, big = across[rate, "8"], across[rate, str(2**22)]
        lines.append(f"| {format_rate(parse_rate(rate))} | {_f(small, 'seconds') * 1e6:.1f} us "
                     f"| {_f(big, 'seconds') * 1e3:.2f} ms "
                     f"({8 * 2**22 / _f(big, 'seconds') / 1e9:.2f} Gbit/s) | "
                     + " | ".join(_cell(dp[rate, m]) for m in MODES) + " |")
    return lines


def _scheme_tables(rows):
    """A table per scheme of bench link's second table: per rate and mode the measured step,
    its exposed communication, the prediction (error) and the compute it starts from."""
    at = {(r["bandwidth"], r["mode"]): r for r in rows if r["kind"] == "scheme"}
    _, rates = dp_rows(rows)
    lines = []
    for scheme, modes in SCHEMES.items():
        lines += [f"*{scheme}*", "", "| link | " + " | ".join(
            _head(m, list(at.values())) for m in modes) + " |", "|---|" + "---|" * len(modes)]
        lines += [f"| {format_rate(parse_rate(rate))} | " + " | ".join(
            _cell(at[rate, m]) for m in modes) + " |" for rate in rates]
        lines.append("")
    return lines


def _dominates(rows):
    """Per mode, the compute and the rate below which its communication outlasts it."""
    said = []
    for r in (r for r in rows if r["kind"] == "scheme" and r["bandwidth"] == r["compute_from"]):
        bits = outlasts_bits(rows, r["mode"])
        said.append(f"{r['mode']} ({_ms(r, 'compute_seconds')} ms of compute, "
                    f"{_f(r, 'bytes') / 1e6:.2f} MB per step): "
                    + (f"below {bits / 1e6:.0f} Mbit/s" if bits else "at every rate"))
    return "; ".join(said)


def _schemes(rows):
    """The part on the other sync modes and schemes ([] in a link.csv without them)."""
    if not any(r["kind"] == "scheme" for r in rows):
        return []
    at = {r["mode"]: r for r in rows if r["kind"] == "scheme"}
    tp, pp = at["tensor_parallel"], at["pipeline"]
    return [
        "The same link under the other schemes (bench link's second table, 2 ranks, one per "
        f"host): data parallelism's master (the seed's Reduce to rank 0 + Bcast) and "
        f"hand-written ring on the same MLP; tensor parallelism on a GPT ({tp['messages']} "
        f"Allreduces, {_f(tp, 'bytes') / 1e6:.2f} MB per step, counted from the trace); a "
        f"2-stage 1F1B pipeline on a GPT ({pp['messages']} messages, "
        f"{_f(pp, 'bytes') / 1e6:.2f} MB per stage and step).",
        "",
        *_scheme_tables(rows),
        "Their predictions (`mpipar.tools.bench.link`): master = compute + 2 (alpha + n beta), a "
        "Reduce and a Bcast of the n gradient bytes (2 lg p (alpha + n beta) for p ranks); "
        "ring = compute + 2(p-1) alpha + 2(p-1)/p n beta; tensor parallel = its compute (the "
        "step less its MPI time) + each Allreduce of the trace at the ring formula; pipeline = "
        "the 1F1B schedule replayed by `mpipar.parts.schedules.simulate` with each stage's forward "
        "and backward measured at that rate and alpha + n beta per message, plus what the "
        "step does outside the schedule. Each compute is that rate's own, as above. The "
        "replay lets messages in the same "
        "direction pass the link at once, where the link carries them one after another: "
        "where a message takes longer than a forward it undercounts. What the pipeline does "
        "outside its schedule is its step less the replay at "
        f"{format_rate(parse_rate(pp['compute_from']))}, so there its prediction is its step by "
        "construction. " + _misses(rows, "scheme"),
        "",
        "Where communication starts to dominate (the rate below which the predicted "
        "communication the step waits for, a + b/R through the predictions at the two slowest "
        "rates, outlasts the compute; below the slowest rate, extrapolated): "
        + _dominates(rows) + ".",
        "",
    ]


def _computes(rows):
    """The compute of the one-Allreduce steps at each rate, as words: how far it moved."""
    dp, rates = dp_rows(rows)
    return ", ".join(f"{_ms(dp[rate, MODES[0]], 'compute_seconds')} ms at "
                     f"{format_rate(parse_rate(rate))}" for rate in rates)


def _why(r):
    """Why one prediction missed, from its row: the communication it predicted (the step
    less the compute) against what the step spent beyond its compute, and the steps' spread."""
    return (f"{r['mode']} at {format_rate(parse_rate(r['bandwidth']))}: predicted "
            f"{_ms(r, 'predicted_seconds')} ms ({100 * _f(r, 'prediction_error'):+.0f}%), steps "
            f"from {_ms(r, 'least_seconds')} to {_ms(r, 'most_seconds')} ms; communication "
            f"predicted {(_f(r, 'predicted_seconds') - _f(r, 'compute_seconds')) * 1e3:.0f} ms, "
            f"exposed {_ms(r, 'exposed_seconds')} ms")


def _misses(rows, kind="dp"):
    """How many predictions (of one kind of row) are within the target; why each other one
    is not."""
    dp = [r for r in rows if r["kind"] == kind]
    missed = [r for r in dp if abs(_f(r, "prediction_error")) > TARGET]
    said = f"{len(dp) - len(missed)} of the {len(dp)} predictions are within 20% of the step. "
    if not missed:
        return said
    return said + "Outside it: " + "; ".join(map(_why, missed)) + ". "


def _gain(dp, rate):
    """Overlap's step against one Allreduce's at one rate, as words."""
    one, over = (_f(dp[rate, m], "seconds") for m in MODES)
    return (f"{one * 1e3:.0f} to {over * 1e3:.0f} ms ({100 * (over / one - 1):+.0f}%) at "
            f"{format_rate(parse_rate(rate))}")


def _burst(rates):
    """Why beta is the 4 MiB message's: the rates whose token bucket holds a whole 1 MiB
    message, which passes in one burst there, faster than the rate."""
    big = [rate for rate in rates if parse_rate(rate) and burst_bytes(parse_rate(rate)) >= 2**20]
    if not big:
        return ""
    return ("Beta is the 4 MiB message's time per byte: at " + ", ".join(
        format_rate(parse_rate(rate)) for rate in big) + " the token bucket holds 1 ms of "
        "traffic (" + ", ".join(f"{burst_bytes(parse_rate(rate)) / 1e6:.2f} MB" for rate in big)
        + "), more than 1 MiB, so a 1 MiB message passes in one burst, faster than the rate, "
        "where a step's megabytes of gradients and a 4 MiB message do not.")


def _speedups(rows):
    """The serial steps the speedups divide, as words ("" in a link.csv without them)."""
    steps = {r.get("scheme") or "data_parallel": r for r in rows
             if r["kind"] in ("dp", "scheme") and r.get("serial_seconds")}
    if not steps:
        return ""
    return ("The speedup is over the serial trainer's step on the same model and batch, one "
            "process and no link (" + ", ".join(f"{k.replace('_', ' ')} {_ms(r, 'serial_seconds')}"
                                                f" ms" for k, r in steps.items()) + "). ")


def link_section(note=None, folder=PLOTS):
    """The section's markdown lines ([] without link.csv); ``note``: why this run did not
    measure the link, said under the heading."""
    rows = link_rows(folder)
    if not rows:
        return []
    dp, rates = dp_rows(rows)
    first = dp[rates[0], MODES[0]]
    return [
        "## Across an emulated link",
        "",
        *([f"*{note}*", ""] if note else []),
        "![link](link.png)",
        "",
        "`python -m mpipar.tools.bench.link` (root: network namespaces, "
        "`mpipar/tools/cluster.py`) joins 2 "
        "emulated hosts by a link that tc's token bucket limits, at each rate of: "
        + ", ".join(format_rate(parse_rate(rate)) for rate in rates) + ". It times a "
        "ping-pong across the hosts and the data-parallel step of the "
        f"{_f(first, 'bytes') / 1e6:.1f} MB-gradient MLP on 2 ranks, one per host, with one "
        "Allreduce after the backward and with 2 MiB buckets overlapped with it (`link.csv`: "
        f"medians of {first['samples']} steps per rate and mode; load average "
        f"{_f(first, 'loadavg_1min'):.1f} on {first['cores']} cores at the end of the run; the "
        "hosts share these cores).",
        "",
        *_table(rows),
        "",
        "The prediction (`mpipar.tools.bench.link.predict_step`) adds to the step's compute (each "
        "rate's steps less their exposed communication: " + _computes(rows) + ") the ring "
        "formula 2(p-1) alpha + 2(p-1)/p n beta with each rate's alpha and beta from the "
        "ping-pong; with overlap each bucket starts when the backward posts it, and only what "
        "is left after the backward counts. What it predicts is the communication: the link "
        "changes nothing else, while the machine's other work moves the compute from rate to "
        "rate. " + _misses(rows) + _speedups(rows) + _burst(rates),
        "",
        f"Communication takes longer than compute below {crossover_bits(rows) / 1e6:.0f} "
        f"Mbit/s: there the allreduce's n x 8 / R seconds (2(p-1)/p = 1 for p = 2) equal the "
        f"{_ms(first, 'compute_seconds')} ms of compute. Overlap took the step from "
        + "; ".join(_gain(dp, rate) for rate in rates) + ": it can hide the communication only "
        "behind the backward" + (", and its layer-by-layer backward costs a little where there "
                                 "is little to hide." if _f(dp[rates[0], MODES[1]], "seconds")
                                 > _f(first, "seconds") else "."),
        "",
        *_schemes(rows),
    ]


def warmup_section(folder=PLOTS):
    """The interleaved schedule's two warm-ups across the link (warmup.csv, ``bench warmup``):
    per rate, each warm-up's median bubble and the spread over the launches; [] without it."""
    import statistics

    rows = csv_rows(folder, "warmup.csv")
    if not rows:
        return []
    rates = list(dict.fromkeys(r["rate"] for r in rows))

    def got(rate, warmup):
        values = sorted(_f(r, "bubble") for r in rows
                        if r["rate"] == rate and r["warmup"] == warmup)
        return f"{statistics.median(values):.3f} ({values[0]:.3f}-{values[-1]:.3f})"

    stash = {w: next(r["stash"] for r in rows if r["warmup"] == w) for w in ("production", "lean")}
    launches = max(int(r["launch"]) for r in rows)
    return [
        "## The interleaved warm-ups across the link",
        "",
        "![warm-ups](warmup.png)",
        "",
        "`python -m mpipar.tools.bench warmup` (root, as bench link) runs the GPT's interleaved "
        "1F1B on 2 emulated hosts, one stage each, 2 chunks and 8 micro-batches, with "
        "`--warmup production` and `--warmup lean` at each rate, " + f"{launches} launches "
        "(`warmup.csv`; the bubble each run measures from its trace, median over the "
        "launches and their range; varies). " + "; ".join(
            f"{rate}: production {got(rate, 'production')}, lean {got(rate, 'lean')}"
            for rate in rates) + ". A slower link makes each message arrive later, and the "
        "lean list, whose steady-state steps each wait for the message just sent, loses more "
        "to it than the production list, which sent it one step earlier "
        "(`lessons/figures/warmup.png` replays both at latencies 0 to 1 chunk-forward). The "
        f"production warm-up holds more: stash per stage {stash['production']} against "
        f"{stash['lean']}. With only 2 stages the warm-ups differ by one chunk-forward on "
        "stage 0, so the gap is small until the message costs a good part of a forward.",
        "",
    ]
