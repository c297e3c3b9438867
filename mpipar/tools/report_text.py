"""The text of ``plots/REPORT.md``: one function per section, each reading its numbers from the
CSVs in plots/ and returning its lines, so that every number the report states is one a
committed CSV holds.

    python -m mpipar.tools.report --plots-only # redraws the plots and rewrites REPORT.md from them

:mod:`mpipar.tools.report` runs the benchmarks, makes the rows and the plots, and calls
:func:`write_report` last; the sections here only describe what those plots show. The cost
model's numbers come in as the rows :mod:`mpipar.tools.validate` and :mod:`mpipar.tools.simulate`
computed,
and the text calls them predictions.
"""

from mpipar.tools.bench.common import PLOTS, csv_rows, environment, read_csv, write_atomically
from mpipar.tools.bench.common import csv_float as _f
from mpipar.tools.report_dimensions import context_section, experts_section, precision_section
from mpipar.tools.report_pipeline import speedup_paragraph, wide_paragraph


def _pct(x):
    return f"{100 * x:.0f}%"


def _dp_row(dp, mode, p):
    return next(r for r in dp if r["mode"] == mode and int(r["ranks"]) == p)


def _dp_speedup(dp, mode, p):
    return _f(_dp_row(dp, mode, p), "speedup")


# ----------------------------------------------------------------------------- the sections
def header(env, bench_times):
    return [
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
    ]


def engine_section(env):
    eng = read_csv("engine.csv")[0]
    flops = {(int(r["ranks"]), int(r["computing"])): r for r in read_csv("flops.csv")}
    return [
        "## The engine",
        "",
        "![engine](engine.png)",
        "",
        f"One MLP training step through `mpipar.engine.nn` takes "
        f"{_f(eng, 'engine_ms'):.3f} ms against "
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
    ]


def speedup_section(dp):
    return [
        "## Speedup of each scheme",
        "",
        "![scaling](scaling.png)",
        "",
        f"On 2 ranks, data parallelism with overlapped bucketed allreduce runs "
        f"{_dp_speedup(dp, 'allreduce+overlap', 2):.2f}x faster than on one rank, and the seed's "
        f"master scheme {_dp_speedup(dp, 'master', 2):.2f}x (`dp.csv`). "
        "Pipeline and tensor parallelism split one model rather than the batch, so they pay "
        "for the bubble and for allreduces inside every layer; their gain on this machine is "
        "smaller (`pp.csv`, `tp.csv`). At 4 ranks the two cores are shared, and the efficiency "
        "falls as it must.",
        "",
    ]


def allreduce_section():
    net = read_csv("net.csv")[0]
    return [
        "## Allreduce algorithms and the alpha-beta model",
        "",
        "![allreduce](net_allreduce.png)",
        "",
        f"A ping-pong in the same run fits alpha = {_f(net, 'alpha') * 1e6:.1f} us per message "
        f"and beta = {_f(net, 'beta') * 1e9:.3f} ns per byte ({1 / _f(net, 'beta') / 1e9:.2f} "
        "GB/s) (`net.csv`). The lines are the formulas of `lessons/formulas.md#collectives` "
        "with these values: the master "
        "scheme (Reduce then Bcast through one root) moves the most data; MPI's Allreduce and the "
        "hand-written ring track the bandwidth term for large messages. Small messages cost far "
        "more than alpha when ranks sleep while they wait.",
        "",
    ]


def data_parallel_section(dp):
    modes = list(dict.fromkeys(r["mode"] for r in dp))
    overlap = _dp_row(dp, "allreduce+overlap", 2)
    return [
        "## Data parallelism",
        "",
        "![data parallel](dp_speedup.png)",
        "",
        "Speedup and efficiency per sync mode, and the gradient exchange's measured MPI time "
        "beside its prediction (`dp.csv`). On 2 ranks: " + ", ".join(
            f"{mode} {_dp_speedup(dp, mode, 2):.2f}x" for mode in modes) +
        f" (target for allreduce with overlap: 1.8x). Forward and backward halve; what does "
        f"not is the optimizer update and the zeroing of the gradients, which every replica "
        f"runs on all {int(_dp_row(dp, 'allreduce', 2)['params']):,} parameters (ZeRO-1 updates "
        f"a 1/P shard), and the copies through "
        f"shared memory that MPI makes with the same cores that compute: on one machine "
        f"there is no idle core or network card to take the exchange, so overlapping it with "
        f"backward hides little (exposed exchange with overlap "
        f"{_f(overlap, 'exposed_comm_ms'):.1f} ms of a "
        f"{_f(overlap, 'step_ms'):.1f} ms step, but the backward "
        "itself runs slower while the Iallreduce progresses).",
        "",
    ]


def pipeline_section():
    pp = [r for r in read_csv("pp.csv") if r["stage"] == "0"]

    def gap(p):  # the largest |measured - formula| bubble over GPipe and 1F1B on p ranks
        return max(abs(_f(r, "bubble_measured") - _f(r, "bubble_formula")) for r in pp
                   if int(r["ranks"]) == p and r["schedule"] in ("gpipe", "1f1b"))

    return [
        "## Pipeline parallelism",
        "",
        "![bubble](pp_bubble.png)",
        "",
        f"The bubble measured from the traces against (p-1)/(m+p-1): at P = 2 the largest gap "
        f"over GPipe and 1F1B is {gap(2):.3f} (target 0.05); at P = 4 (oversubscribed) "
        f"{gap(4):.3f}, since each message must wake a sleeping rank (`pp.csv`).",
        *speedup_paragraph(pp), *wide_paragraph(csv_rows(PLOTS, "pp_rows256.csv"), pp),
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
    ]


def tensor_parallel_section():
    tp = read_csv("tp.csv")

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
    return [
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


def layouts_section():
    """Memory and step time per layout of 4 ranks, for the plots the hybrid benchmark left."""
    lines = []
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
    return lines


def checkpoint_section():
    """Checkpoint write and read time against the model's size (ckpt.csv), when measured."""
    if not (PLOTS / "ckpt.csv").exists():
        return []
    rows = read_csv("ckpt.csv")
    big = max((r for r in rows if r["scheme"] == "serial"), key=lambda r: int(r["params"]))
    pipe = max((r for r in rows if r["scheme"] == "pipeline"), key=lambda r: int(r["params"]))
    mib = _f(big, "bytes_total") / 2**20
    return [
        "## Checkpoints",
        "",
        "![checkpoint time](ckpt.png)",
        "",
        f"A checkpoint of the GPT with Adam holds every parameter and its two moments: "
        f"{int(big['params']):,} parameters are {mib:.1f} MiB, written in "
        f"{_f(big, 'write_ms'):.0f} ms by one process ({mib / _f(big, 'write_ms') * 1e3:.0f} "
        f"MiB/s, the flush to disk and the SHA-256 of the manifest included) and read back in "
        f"{_f(big, 'read_ms'):.0f} ms. As a 2-stage pipeline each rank writes only its own "
        f"stage ({_f(pipe, 'bytes_per_rank_max') / 2**20:.1f} MiB at most) into its own file, "
        f"in {_f(pipe, 'write_ms'):.0f} ms for the slower rank; its read, "
        f"{_f(pipe, 'read_ms'):.0f} ms, includes rank 0's check of every file's SHA-256 before "
        "any rank loads (`ckpt.csv`: medians of the repeats, with the spread of the writes).",
        "",
    ]


def memory_section():
    """What each rank holds, counted by the memory ledger (memory_bench.csv), when measured."""
    if not (PLOTS / "memory_bench.csv").exists():
        return []
    rows = {(r["experiment"], int(r["ranks"]), r["config"], int(r["rank"])): r
            for r in read_csv("memory_bench.csv")}
    mib = lambda r, *keys: f"{sum(_f(r, k) for k in keys) / 2**20:.2f} MiB"  # noqa: E731
    ms = lambda r: "%.0f ms (%.0f-%.0f)" % tuple(_f(r, f"step_ms{k}") for k in ("", "_min", "_max"))  # noqa
    state = ("params_bytes", "grads_bytes", "optimizer_bytes")
    z, z2 = ({k: rows["zero", p, f"ZeRO-{k}", 0] for k in range(4)} for p in (4, 2))
    off, on = (rows["pipeline", 4, f"recompute {w}", 0] for w in ("off", "on"))
    over = lambda r: f"{round(sum(_f(r, k) for k in state) - _f(r, 'formula_bytes')):,}"  # noqa
    cost = [z2[3]] + [rows["pipeline", 2, f"recompute {w}", 0] for w in ("on", "selective")]
    said = lambda r: f"{r['config']} {_f(r, 'predicted_step_ms'):.0f} ms for {ms(r)}"  # noqa
    return [
        "## Memory per rank",
        "",
        "![memory per rank](memory_bench.png)",
        "",
        "`mpipar/runner/memory.py` counts what each rank holds from the arrays it references, each "
        "buffer once (`python -m mpipar.tools.bench memory`, `memory_bench.csv`). The GPT of "
        f"{int(z[0]['params']):,} parameters with Adam in float32 on 4 ranks: parameters, "
        "gradients and optimizer state take " + ", ".join(
            f"{mib(z[k], *state)} a rank with ZeRO-{k} (formula {mib(z[k], 'formula_bytes')})"
            for k in range(4)) + f". Beyond it ZeRO-1 holds {over(z[1])} and ZeRO-2 "
        f"{over(z[2])} bytes, the padding (a shard is a view into its whole buffers), ZeRO-0 the "
        f"flat buffer of Step 1's Bcast ({mib(z[0], 'buffers_bytes')}). The most a rank held "
        "at once in a step: " + ", ".join(f"{mib(z[k], 'peak_bytes')} with ZeRO-{k}"
                                         for k in range(4))
        + " (ZeRO-2's includes the whole gradient during the backward, ZeRO-3's one layer "
        f"gathered at a time), beside {mib(z[0], 'activations_bytes')} of activations.",
        "",
        f"Step time, median over rounds (min-max), load average {_f(z[0], 'loadavg_1min'):.1f} "
        f"at the start: on 2 ranks ZeRO-0 {ms(z2[0])}, ZeRO-3 {ms(z2[3])}; on 4 ranks "
        f"(oversubscribed) {ms(z[0])} and {ms(z[3])}.",
        "",
        f"Recomputation on a 4-stage pipeline (1F1B, 8 micro-batches): stage 0 held "
        f"{mib(off, 'activations_bytes')} of activations at their peak without it and "
        f"{mib(on, 'activations_bytes')} with it (the batch's token ids); its step peak fell "
        f"from {mib(off, 'peak_bytes')} to {mib(on, 'peak_bytes')}; a step took {ms(on)} with "
        f"it, {ms(off)} without. The cost model on 2 ranks (a core each), its FLOP rate fitted "
        "to ZeRO-0 and to recompute off there: " + ", ".join(map(said, cost)) + ".",
        "",
    ]


def cost_model_section(validation):
    inside = [r for r in validation if abs(r["error"]) <= 0.2]
    fair = [r for r in validation if not r["oversubscribed"]]  # a core per rank
    fair_inside = [r for r in fair if abs(r["error"]) <= 0.2]
    over = [r for r in validation if r["oversubscribed"]]
    over_inside = [r for r in over if abs(r["error"]) <= 0.2]
    worst = sorted(fair, key=lambda r: -abs(r["error"]))[:3]
    worst_over = sorted(over, key=lambda r: -abs(r["error"]))[:2]
    return [
        "## The cost model against the measurements",
        "", "![cost model](model_validation.png)", "",
        f"`python -m mpipar.tools.simulate` predicts {len(fair_inside)} of the {len(fair)} "
        "benchmarked configurations that have a core per rank within 20% of their measured step "
        f"time, and {len(inside)} of all {len(validation)} (`model_validation.csv`). Its inputs "
        "are measured in the same run: the FLOP rate from each benchmark's one-rank steps (less "
        "the optimizer update, which does not divide, `update_cost.csv`; for tensor "
        "parallelism a rate that grows with the size of the products, fitted over the sizes, "
        "so that a rank's half-size products run at their own rate), scaled by `flops.csv` for "
        "the ranks computing at once (2-rank tensor parallelism: fitted instead to its one-rank "
        "block timed while the other rank runs its own, `tp.csv` step_both_ms); each collective "
        "at what the same call measured (`net.csv`), alpha and beta from the ping-pong beyond "
        "it; the pipeline's time comes from replaying the actual schedule. The largest misses "
        "with a core per rank: " + "; ".join(
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


def extrapolation_section(extrapolation):
    """The best predicted layout that fits; no section when none fits."""
    fits = [r for r in extrapolation if r["fits"]]
    if not fits:
        return []
    best = max(fits, key=lambda r: r["tokens_per_s"])
    return [
        "## Extrapolation (prediction)",
        "",
        "![extrapolation](extrapolation.png)",
        "",
        "The same model with published A100 and H100 figures, derated to 50% of peak "
        "(`mpipar/tools/hardware.py > PRESETS`), for GPT-3 175B from 8 to 1024 devices "
        f"(`extrapolation.csv`). The best predicted layout is TP {best['tp']} x PP "
        f"{best['pp']} x DP {best['dp']} on {best['devices']} {best['hardware'].upper()}s: "
        f"{best['tokens_per_s']:,.0f} tokens/s at {_pct(best['efficiency'])} of peak. "
        "Small device counts cannot hold the model at all; tensor parallelism stays inside "
        "a node of 8, and pipeline depth trades bubble for memory.",
        "",
    ]


# ----------------------------------------------------------------------------- the report
def write_report(validation, extrapolation, bench_times, headline=(), speed_lines=(), link=(),
                 gpu=()):
    """plots/REPORT.md: every plot with what it shows; every number read from a CSV.

    ``validation`` and ``extrapolation`` are the rows the report wrote to model_validation.csv
    and extrapolation.csv; ``bench_times`` maps each benchmark to its seconds (empty when the
    plots were only redrawn); ``headline`` and ``speed_lines`` the sections of
    :mod:`mpipar.tools.headlines` and :mod:`mpipar.tools.report_speed`, ``link`` and ``gpu`` those
    of
    :mod:`mpipar.tools.report_link` and :mod:`mpipar.tools.report_gpu`. Returns the path written.
    """
    env = environment()
    dp = read_csv("dp.csv")
    lines = (header(env, bench_times) + list(headline) + engine_section(env)
             + list(speed_lines) + speedup_section(dp) + allreduce_section()
             + data_parallel_section(dp) + pipeline_section() + tensor_parallel_section()
             + layouts_section() + experts_section() + context_section()
             + precision_section() + checkpoint_section() + memory_section()
             + list(link)
             + list(gpu) + cost_model_section(validation) + extrapolation_section(extrapolation))
    return write_atomically(PLOTS / "REPORT.md", "\n".join(lines))
