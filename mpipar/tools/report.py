"""The speedup report: run every benchmark, check the cost model against them, extrapolate,
and write ``plots/REPORT.md`` with each plot and what it shows.

    make report                    # or: python -m mpipar.tools.report (about 35 minutes, 2 cores)
    python -m mpipar.tools.report --plots-only   # redraw and rewrite from the CSVs in plots/

Every number in the report is read from a CSV that this run (or an earlier one) wrote; the cost
model's numbers are labelled as predictions. The benchmarks run one after another, never at the
same time, with one BLAS thread per rank, each told ``--out`` plots/ (or ``$MPIPAR_PLOTS``):
this is the one run that replaces the committed results, where a benchmark run on its own
writes into a scratch folder.
"""

import argparse
import importlib
import os
import shutil
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from mpipar.tools import headlines  # noqa: E402
from mpipar.tools.bench.common import (  # noqa: E402 (after the thread settings above)
    PLOTS,
    SCRATCH,
    OneLineParser,
    cores,
    csv_rows,
    environment,
    number,
    pyplot,
    read_csv,
    save_figure,
    write_csv,
)
from mpipar.tools.bench.common import csv_float as _f  # noqa: E402
from mpipar.tools.bench.schedules import section as schedules_section  # noqa: E402
from mpipar.tools.report_gpu import gpu_section  # noqa: E402
from mpipar.tools.report_link import link_section, warmup_section  # noqa: E402
from mpipar.tools.report_speed import speed_section  # noqa: E402
from mpipar.tools.report_text import write_report  # noqa: E402 (the text of REPORT.md, by section)
from mpipar.tools.validate import (  # noqa: E402
    UPDATE_CSV,
    plot_validation,
    validation_rows,
)

# bench wait (about 4 minutes) is run on its own; its section reads the CSV it left in plots/.
# bench link (about 5 minutes) and bench warmup (under a minute) run after these when this
# machine can emulate hosts (root, network namespaces: run_link); otherwise their sections keep
# the committed link.csv and warmup.csv
BENCHES = ["engine", "overhead", "flops", "net", "dp", "tp", "pp", "pp_wide", "schedules", "hybrid",
           "experts", "context", "precision", "ckpt", "memory"]


def _true(value):
    return str(value) == "True"


# ----------------------------------------------------------------------------- benchmarks
def run_benchmarks(quick, names=BENCHES, out=PLOTS, desc="benchmarks"):
    from tqdm import tqdm

    times = {}
    bar = tqdm(names, desc=desc, file=sys.stderr)
    for name in bar:
        bar.set_postfix(running=name)
        t0 = time.time()
        argv = ["--out", str(out)] + (["--quick"] if quick else [])  # where this reads
        importlib.import_module(f"mpipar.tools.bench.{name}").main(argv)
        times[name] = time.time() - t0
    return times


def run_link(quick, times):
    """bench link into plots/ when this machine can emulate hosts (its time goes into
    ``times``); otherwise the note its section then carries: why, and that link.csv is older."""
    from mpipar.tools import cluster

    reason = cluster.unavailable()
    if reason:
        return f"Not measured by this run ({reason}): the numbers of an earlier link.csv."
    times.update(run_benchmarks(quick, ["link", "warmup"], desc="bench link, warmup"))
    return None


def launch_again(quick, launches):
    """Launches 2.. of the headline benchmarks, each into its own scratch folder; returns
    every launch's folder, plots/ first (see :mod:`mpipar.tools.headlines`)."""
    folders = [PLOTS]
    for k in range(2, launches + 1):
        folder = SCRATCH / f"launch-{k}"
        shutil.rmtree(folder, ignore_errors=True)  # no figure from an earlier report's launch
        folder.mkdir(parents=True)
        run_benchmarks(quick, headlines.benches(), folder, desc=f"launch {k} of {launches}")
        folders.append(folder)
    return folders


# ----------------------------------------------------------------------------- scaling
def scaling_rows():
    """Speedup over one rank, per scheme and rank count, from the benchmarks' CSVs."""
    rows = []
    for r in read_csv("dp.csv"):
        if r["mode"] in ("allreduce", "allreduce+overlap", "master"):
            rows.append(dict(scheme=f"data parallel ({r['mode']})", ranks=int(r["ranks"]),
                             speedup=_f(r, "speedup"), oversubscribed=_true(r["oversubscribed"])))
    pp = [r for r in read_csv("pp.csv") if r["schedule"] == "1f1b" and r["stage"] == "0"]
    m_max = max(int(r["m"]) for r in pp)
    rows.append(dict(scheme=f"pipeline (1F1B, m={m_max})", ranks=1, speedup=1.0,
                     oversubscribed=False))
    for r in pp:
        if int(r["m"]) == m_max:
            rows.append(dict(scheme=f"pipeline (1F1B, m={m_max})", ranks=int(r["ranks"]),
                             speedup=_f(r, "speedup_vs_serial"),
                             oversubscribed=_true(r["oversubscribed"])))
    tp = [r for r in read_csv("tp.csv") if r["batch"] == "4"]
    h_max = max(int(r["hidden"]) for r in tp)
    for r in tp:
        if int(r["hidden"]) == h_max:
            rows.append(dict(scheme=f"tensor parallel (block, h={h_max})", ranks=int(r["ranks"]),
                             speedup=_f(r, "speedup"), oversubscribed=_true(r["oversubscribed"])))
    return rows


def plot_scaling(rows, path):
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    top = max(r["ranks"] for r in rows)
    for name in schemes:
        pts = sorted((r["ranks"], r["speedup"], r["oversubscribed"]) for r in rows
                     if r["scheme"] == name)
        xs = [p for p, _, _ in pts]
        line, = ax1.plot(xs, [s for _, s, _ in pts], "o-", label=name)
        ax2.plot(xs, [s / p for p, s, _ in pts], "o-", color=line.get_color())
    over = [r["ranks"] for r in rows if r["oversubscribed"]]
    ax1.plot([1, top], [1, top], "k--", lw=1, label="ideal")
    ax2.plot([1, top], [1, 1], "k--", lw=1)
    for ax in (ax1, ax2):
        if over:  # one shaded band and one label, not a label per line
            ax.axvspan(cores() + 0.5, top + 0.3, color="gray", alpha=0.12, lw=0)
            ax.text(top + 0.25, ax.get_ylim()[1], "oversubscribed\n(ranks > cores) ",
                    fontsize=8, color="gray", ha="right", va="top")
        ax.axvline(cores(), color="gray", ls=":", lw=1)
        ax.text(cores(), ax.get_ylim()[0], f" {cores()} cores", fontsize=8, color="gray",
                va="bottom")
        ax.set_xlabel("ranks")
        ax.set_xticks(sorted({r["ranks"] for r in rows}))
        ax.grid(alpha=0.3)
    ax1.set_ylabel("speedup over 1 rank")
    ax2.set_ylabel("efficiency (speedup / ranks)")
    ax1.legend(fontsize=8, loc="upper left")  # where no point is: the cores' label is below
    fig.suptitle("Speedup of each scheme on this machine "
                 "(beyond the core count, ranks share cores)")
    save_figure(fig, path)


# ----------------------------------------------------------------------------- extrapolation
FAMILIES = [(8, 16), (8, 8), (8, 4), (4, 16), (8, 1), (1, 1)]  # (tp, pp); dp fills the rest


def extrapolation_rows(hardware=("a100", "h100")):
    from mpipar.tools import simulate as S

    out = []
    for hw in hardware:
        for r in S.extrapolate(hw):
            if (r["tp"], r["pp"]) in FAMILIES:
                keep = {k: r[k] for k in ("dp", "tp", "pp", "devices", "n_micro", "step_s",
                                          "compute_s", "tp_comm_s", "pp_comm_s", "bubble_s",
                                          "dp_comm_s", "tokens_per_s", "efficiency", "fits",
                                          "mem_total_bytes")}
                out.append(dict(hardware=hw, **keep))
    return out


def plot_extrapolation(rows, path):
    plt = pyplot()
    hardware = list(dict.fromkeys(r["hardware"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {"a100": "-", "h100": "--"}
    colors = {}
    for hw in hardware:
        for tp, pp in FAMILIES:
            pts = sorted((r["devices"], r["tokens_per_s"], r["efficiency"]) for r in rows
                         if r["hardware"] == hw and r["tp"] == tp and r["pp"] == pp and r["fits"])
            if not pts:
                continue
            label = f"TP {tp} x PP {pp} x DP rest"
            kw = dict(color=colors.get(label), ls=styles.get(hw, "-"), marker="o", ms=3)
            line, = axes[0].plot([d for d, _, _ in pts], [t for _, t, _ in pts],
                                 label=f"{label}, {hw.upper()}", **kw)
            colors.setdefault(label, line.get_color())
            axes[1].plot([d for d, _, _ in pts], [e for _, _, e in pts],
                         **dict(kw, color=colors[label]))
    axes[0].set_ylabel("predicted tokens / s")
    axes[1].set_ylabel("model FLOPs / peak FLOPs")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle("Cost model (prediction): GPT-3 175B, global batch 1536, 1F1B with activation "
                 "recomputation, ZeRO-1; layouts that fit in 80 GB only")
    save_figure(fig, path)


# ----------------------------------------------------------------------------- memory
def plot_memory(path):
    """Memory per rank of each layout of 4 ranks, from plots/hybrid.csv."""
    rows = read_csv("hybrid.csv")
    parts = [k for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")
             if k in rows[0]]
    if not parts:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"DP{r['dp']} TP{r['tp']} PP{r['pp']}" for r in rows]
    bottom = [0.0] * len(rows)
    for part in parts:
        vals = [_f(r, part) / 2**20 for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=part.replace("_bytes", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB per rank (the largest rank)")
    ax.set_title("Memory per rank for each layout of 4 ranks, same GPT")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return path


def main(argv=None):
    ap = OneLineParser(prog="python -m mpipar.tools.report", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="each benchmark's short version")
    ap.add_argument("--plots-only", action="store_true",
                    help="skip the benchmarks: redraw and rewrite from the CSVs in plots/")
    ap.add_argument("--launches", type=number(), default=3, metavar="R",
                    help="launch the headline benchmarks R times in all, for their spread "
                         "(default 3; 1: only the main run)")
    args = ap.parse_args(argv)
    link_note = None  # bench link's section: why this run did not measure the link
    if args.plots_only:  # the times of the run that wrote the CSVs, if it recorded them
        times = csv_rows(PLOTS, "bench_times.csv")
        bench_times = {r["bench"]: float(r["seconds"]) for r in times}
    else:
        bench_times = run_benchmarks(args.quick)
        link_note = run_link(args.quick, bench_times)
        (PLOTS / UPDATE_CSV).unlink(missing_ok=True)  # time the updates afresh, in this run
        write_csv("bench_times.csv", [dict(environment(), bench=k, seconds=round(v, 1))
                                      for k, v in bench_times.items()])
        write_csv("headlines.csv", headlines.collect(launch_again(args.quick, args.launches)))
    headline_rows = csv_rows(PLOTS, "headlines.csv")
    headline_rows = headlines.with_launch_1(headline_rows, PLOTS)  # a benchmark run again
    headline_rows = headlines.with_once(headline_rows, PLOTS)  # bench wait's, if newer
    write_csv("headlines.csv", headline_rows)

    scaling = scaling_rows()
    write_csv("scaling.csv", scaling)
    plot_scaling(scaling, PLOTS / "scaling.png")

    validation = validation_rows()
    write_csv("model_validation.csv", validation)
    plot_validation(validation, PLOTS / "model_validation.png")

    extrapolation = extrapolation_rows()
    write_csv("extrapolation.csv", extrapolation)
    plot_extrapolation(extrapolation, PLOTS / "extrapolation.png")

    if (PLOTS / "hybrid.csv").exists():
        plot_memory(PLOTS / "memory.png")
    path = write_report(validation, extrapolation, bench_times,
                        headlines.section(headline_rows), speed_section(),
                        link_section(link_note) + warmup_section() + schedules_section(),
                        gpu_section())
    fair = [r for r in validation if not r["oversubscribed"]]
    print(f"cost model within 20%: {sum(abs(r['error']) <= 0.2 for r in fair)} of {len(fair)} "
          f"configurations with a core per rank, {sum(abs(r['error']) <= 0.2 for r in validation)}"
          f" of all {len(validation)}")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
