"""The speedup report: run every benchmark, check the cost model against them, extrapolate,
and write ``plots/REPORT.md`` with each plot and what it shows.

    make report                      # or: python -m mpipar.report   (about 5 minutes on 2 cores)
    python -m mpipar.report --plots-only   # redraw and rewrite from the CSVs already in plots/

Every number in the report is read from a CSV that this run (or an earlier one) wrote; the cost
model's numbers are labelled as predictions. The benchmarks run one after another, never at the
same time, with one BLAS thread per rank.
"""

import argparse
import importlib
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from mpipar.bench.common import (  # noqa: E402 (after the thread settings above)
    PLOTS,
    cores,
    environment,
    pyplot,
    read_csv,
    save_figure,
    write_csv,
)
from mpipar.bench.common import csv_float as _f  # noqa: E402
from mpipar.validate import (  # noqa: E402
    UPDATE_CSV,
    plot_validation,
    validation_rows,
)

BENCHES = ["engine", "flops", "net", "dp", "tp", "pp", "hybrid"]


def _true(value):
    return str(value) == "True"


# ----------------------------------------------------------------------------- benchmarks
def run_benchmarks(quick):
    from tqdm import tqdm

    times = {}
    bar = tqdm(BENCHES, desc="benchmarks", file=sys.stderr)
    for name in bar:
        bar.set_postfix(running=name)
        t0 = time.time()
        importlib.import_module(f"mpipar.bench.{name}").main(["--quick"] if quick else [])
        times[name] = time.time() - t0
    return times


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
        for p, s, over in pts:
            if over:
                ax1.annotate("oversubscribed", (p, s), fontsize=7, xytext=(4, -3),
                             textcoords="offset points", color=line.get_color())
    ax1.plot([1, top], [1, top], "k--", lw=1, label="ideal")
    ax2.plot([1, top], [1, 1], "k--", lw=1)
    for ax in (ax1, ax2):
        ax.axvline(cores(), color="gray", ls=":", lw=1)
        ax.text(cores(), ax.get_ylim()[1] * 0.95, f" {cores()} cores", fontsize=8, color="gray",
                va="top")
        ax.set_xlabel("ranks")
        ax.set_xticks(sorted({r["ranks"] for r in rows}))
        ax.grid(alpha=0.3)
    ax1.set_ylabel("speedup over 1 rank")
    ax2.set_ylabel("efficiency (speedup / ranks)")
    ax1.legend(fontsize=8)
    fig.suptitle("Speedup of each scheme on this machine "
                 "(beyond the core count, ranks share cores)")
    save_figure(fig, path)


# ----------------------------------------------------------------------------- extrapolation
FAMILIES = [(8, 16), (8, 8), (8, 4), (4, 16), (8, 1), (1, 1)]  # (tp, pp); dp fills the rest


def extrapolation_rows(hardware=("a100", "h100")):
    from mpipar import simulate as S

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


# ----------------------------------------------------------------------------- the report
def _pct(x):
    return f"{100 * x:.0f}%"


def write_report(scaling, validation, extrapolation, bench_times):
    """plots/REPORT.md: every plot with what it shows; every number read from a CSV."""
    eng = read_csv("engine.csv")[0]
    flops = {(int(r["ranks"]), int(r["computing"])): r for r in read_csv("flops.csv")}
    net = read_csv("net.csv")[0]
    dp = read_csv("dp.csv")
    pp = [r for r in read_csv("pp.csv") if r["stage"] == "0"]
    tp = read_csv("tp.csv")
    env = environment()

    def dp_row(mode, p):
        return next(r for r in dp if r["mode"] == mode and int(r["ranks"]) == p)

    def dp_speedup(mode, p):
        return _f(dp_row(mode, p), "speedup")

    dp_modes = list(dict.fromkeys(r["mode"] for r in dp))

    def pp_gap(p):
        return max(abs(_f(r, "bubble_measured") - _f(r, "bubble_formula")) for r in pp
                   if int(r["ranks"]) == p and r["schedule"] in ("gpipe", "1f1b"))

    def crossover(batch):  # (measured, predicted) hidden size from which P = 2 pays off
        row = next(r for r in tp if r["batch"] == batch)
        return row["measured_crossover_hidden"], row["predicted_crossover_hidden"]

    smallest = min(int(r["hidden"]) for r in tp)
    big, small = crossover("4"), crossover("1")
    if big[0] and int(big[0]) <= smallest:
        big_text = (f"For a training-sized step (batch 4 x sequence 64) 2 ranks are faster at "
                    f"every size measured, from h = {smallest}")
    else:
        big_text = (f"For a training-sized step (batch 4 x sequence 64) 2 ranks pay off from "
                    f"a hidden size of about {big[0]}")
    inside = [r for r in validation if abs(r["error"]) <= 0.2]
    fair = [r for r in validation if not r["oversubscribed"]]
    fair_inside = [r for r in fair if abs(r["error"]) <= 0.2]
    over = [r for r in validation if r["oversubscribed"]]
    over_inside = [r for r in over if abs(r["error"]) <= 0.2]
    worst = sorted(fair, key=lambda r: -abs(r["error"]))[:3]
    worst_over = sorted((r for r in validation if r["oversubscribed"]),
                        key=lambda r: -abs(r["error"]))[:2]
    fits = [r for r in extrapolation if r["fits"]]
    best = max(fits, key=lambda r: r["tokens_per_s"]) if fits else None

    lines = [
        "# mpipar speedup report",
        "",
        f"Written by `make report` on {env['cores']} cores (Python {env['python']}, NumPy "
        f"{env['numpy']}, mpi4py {env['mpi4py']}, {env['mpi']}), one BLAS thread per rank. "
        "Every number below is read from the CSV beside its plot; the cost model's numbers are "
        "predictions and say so. Runs with more ranks than cores are marked *oversubscribed*: "
        "their ranks share cores, so they show the price of sharing, not a speedup.",
        "",
        "Benchmark run times: " + ", ".join(f"{k} {v:.0f} s" for k, v in bench_times.items())
        if bench_times else "Redrawn from the CSVs already in plots/ (`--plots-only`).",
        "",
        "## The engine",
        "",
        "![engine](engine.png)",
        "",
        f"One MLP training step through `mpipar.nn` takes {_f(eng, 'engine_ms'):.3f} ms against "
        f"{_f(eng, 'bare_numpy_ms'):.3f} ms for the same arithmetic in bare NumPy: a ratio of "
        f"{_f(eng, 'ratio'):.3f} (target at most 1.15; `engine.csv`). The layer abstraction costs "
        "little next to the matrix products.",
        "",
        f"While 2 ranks compute at once, each sustains {_pct(_f(flops[2, 2], 'share_of_one'))} of "
        "the FLOP rate of one rank alone, counted until the last of them is done; with 4 ranks "
        f"on {env['cores']} cores, "
        f"{_pct(_f(flops[4, 4], 'share_of_one'))}; with 4 ranks of which 2 compute while 2 wait, "
        f"{_pct(_f(flops[4, 2], 'share_of_one'))}: the waiting ranks' wake-ups take some "
        "of the cores (`flops.csv`). The cost model uses these shares.",
        "",
        "## Speedup of each scheme",
        "",
        "![scaling](scaling.png)",
        "",
        f"On 2 ranks, data parallelism with overlapped bucketed allreduce runs "
        f"{dp_speedup('allreduce+overlap', 2):.2f}x faster than on one rank, and the seed's "
        f"master scheme {dp_speedup('master', 2):.2f}x (`dp.csv`). "
        "Pipeline and tensor parallelism split one model rather than the batch, so they pay "
        "for the bubble and for allreduces inside every layer; their gain on this machine is "
        "smaller (`pp.csv`, `tp.csv`). At 4 ranks the two cores are shared, and the efficiency "
        "falls as it must.",
        "",
        "## Allreduce algorithms and the alpha-beta model",
        "",
        "![allreduce](net_allreduce.png)",
        "",
        f"A ping-pong in the same run fits alpha = {_f(net, 'alpha') * 1e6:.1f} us per message "
        f"and beta = {_f(net, 'beta') * 1e9:.3f} ns per byte ({1 / _f(net, 'beta') / 1e9:.2f} "
        "GB/s) (`net.csv`). The lines are the REFERENCE formulas with these values: the master "
        "scheme (Reduce then Bcast through one root) moves the most data; MPI's Allreduce and the "
        "hand-written ring track the bandwidth term for large messages. Small messages cost far "
        "more than alpha when ranks sleep while they wait.",
        "",
        "## Data parallelism",
        "",
        "![data parallel](dp_speedup.png)",
        "",
        "Speedup and efficiency per sync mode, and the gradient exchange's measured MPI time "
        "beside its prediction (`dp.csv`). On 2 ranks: " + ", ".join(
            f"{mode} {dp_speedup(mode, 2):.2f}x" for mode in dp_modes) +
        f" (target for allreduce with overlap: 1.8x). Forward and backward halve; what does "
        f"not is the optimizer update and the zeroing of the gradients, which every replica "
        f"runs on all {int(dp_row('allreduce', 2)['params']):,} parameters (ZeRO-1 updates "
        f"a 1/P shard), and the copies through "
        f"shared memory that MPI makes with the same cores that compute: on one machine "
        f"there is no idle core or network card to take the exchange, so overlapping it with "
        f"backward hides little (exposed exchange with overlap "
        f"{_f(dp_row('allreduce+overlap', 2), 'exposed_comm_ms'):.1f} ms of a "
        f"{_f(dp_row('allreduce+overlap', 2), 'step_ms'):.1f} ms step, but the backward "
        "itself runs slower while the Iallreduce progresses).",
        "",
        "## Pipeline parallelism",
        "",
        "![bubble](pp_bubble.png)",
        "",
        f"The bubble measured from the traces against (p-1)/(m+p-1): at P = 2 the largest gap "
        f"over GPipe and 1F1B is {pp_gap(2):.3f} (target 0.05); at P = 4 (oversubscribed) "
        f"{pp_gap(4):.3f}, since each message must wake a sleeping rank (`pp.csv`).",
        "",
        "![timelines](pp_timelines.png)",
        "",
        "Real traces of one step: naive runs one stage at a time; GPipe runs every forward, "
        "then every backward; 1F1B starts backwards early, with the same idle time.",
        "",
        "![activation memory](pp_memory.png)",
        "",
        "Peak stashed activations per stage, measured: GPipe holds all m micro-batches on every "
        "stage, 1F1B at most p - r on stage r, exactly as the schedules predict (`pp.csv`).",
        "",
        "## Tensor parallelism",
        "",
        "![tensor parallel](tp_comm_share.png)",
        "",
        f"Splitting one transformer block over 2 ranks adds 4 allreduces of b*s*h values per "
        f"step. {big_text} (the alpha-beta model: from about {big[1]}); for 16 tokens (batch "
        f"1 x sequence 16) from about h = {small[0]} (the model: about {small[1]}) "
        "(`tp.csv`).",
        "",
    ]
    if (PLOTS / "memory.png").exists():
        lines += [
            "## Memory per rank, every layout of 4 ranks",
            "",
            "![memory](memory.png)",
            "",
            "The same GPT on 4 ranks: data parallelism keeps everything on every rank; tensor "
            "and pipeline parallelism divide parameters, gradients and optimizer state; the "
            "pipeline's first stages also hold more micro-batches' activations (`hybrid.csv`).",
            "",
        ]
    if (PLOTS / "hybrid.png").exists():
        lines += ["![hybrid](hybrid.png)", "",
                  "Step time and communication per group type for each layout (`hybrid.csv`).",
                  ""]
    lines += [
        "## The cost model against the measurements",
        "",
        "![cost model](model_validation.png)",
        "",
        f"`python -m mpipar.simulate` predicts {len(fair_inside)} of the {len(fair)} "
        "benchmarked configurations that have a core per rank within 20% of their measured step "
        f"time, and {len(inside)} of all {len(validation)} (`model_validation.csv`). Its inputs "
        "are measured in the same run: the FLOP rate from each benchmark's one-rank steps (less "
        "the optimizer update, which does not divide, `update_cost.csv`; for tensor "
        "parallelism a rate that grows with the size of the products, fitted over the sizes, "
        "so that a rank's half-size products run at their own rate), scaled by `flops.csv` for "
        "the ranks "
        "computing at once; alpha and beta from the ping-pong; the pipeline's time comes from "
        "replaying the actual schedule. The largest misses with a core per rank: " + "; ".join(
            f"{r['bench']} {r['config']}: predicted {r['predicted_ms']:.2f} ms, measured "
            f"{r['measured_ms']:.2f} ms ({100 * r['error']:+.0f}%)" for r in worst) + ". "
        f"With more ranks than cores, {len(over_inside)} of {len(over)} are within 20%. There "
        "the model shares the cores among the ranks that compute at each moment of the "
        "replayed schedule, at the speeds `flops.csv` measured for that many computing ranks: "
        "the pace of the last of them for ranks in lockstep (replicas, tensor-parallel peers), "
        "the mean for pipeline stages of one rank, which do not wait for one another. It "
        "prices a collective at what an allreduce between computations costs there "
        "(`net.csv`, lockstep rows: a millisecond or more, against microseconds with a core "
        "per rank, since each step of it waits for a partner to be woken). The largest misses "
        "there: " +
        "; ".join(f"{r['bench']} {r['config']}: {100 * r['error']:+.0f}%" for r in worst_over)
        + ".",
        "",
    ]
    if best:
        lines += [
            "## Extrapolation (prediction)",
            "",
            "![extrapolation](extrapolation.png)",
            "",
            "The same model with published A100 and H100 figures, derated to 50% of peak "
            "(`mpipar/simulate.py > PRESETS`), for GPT-3 175B from 8 to 1024 devices "
            f"(`extrapolation.csv`). The best predicted layout is TP {best['tp']} x PP "
            f"{best['pp']} x DP {best['dp']} on {best['devices']} {best['hardware'].upper()}s: "
            f"{best['tokens_per_s']:,.0f} tokens/s at {_pct(best['efficiency'])} of peak. "
            "Small device counts cannot hold the model at all; tensor parallelism stays inside "
            "a node of 8, and pipeline depth trades bubble for memory.",
            "",
        ]
    (PLOTS / "REPORT.md").write_text("\n".join(lines))
    return PLOTS / "REPORT.md"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mpipar.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="each benchmark's short version")
    ap.add_argument("--plots-only", action="store_true",
                    help="skip the benchmarks: redraw and rewrite from the CSVs in plots/")
    args = ap.parse_args(argv)
    if args.plots_only:  # the times of the run that wrote the CSVs, if it recorded them
        times = read_csv("bench_times.csv") if (PLOTS / "bench_times.csv").exists() else []
        bench_times = {r["bench"]: float(r["seconds"]) for r in times}
    else:
        bench_times = run_benchmarks(args.quick)
        (PLOTS / UPDATE_CSV).unlink(missing_ok=True)  # time the updates afresh, in this run
        write_csv("bench_times.csv", [dict(environment(), bench=k, seconds=round(v, 1))
                                      for k, v in bench_times.items()])

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
    path = write_report(scaling, validation, extrapolation, bench_times)
    fair = [r for r in validation if not r["oversubscribed"]]
    print(f"cost model within 20%: {sum(abs(r['error']) <= 0.2 for r in fair)} of {len(fair)} "
          f"configurations with a core per rank, {sum(abs(r['error']) <= 0.2 for r in validation)}"
          f" of all {len(validation)}")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
