"""The speedup report: run every benchmark, check the cost model against them, extrapolate,
and write ``plots/REPORT.md`` with each plot and what it shows.

    make report                      # or: python -m mpipar.report   (about 8 minutes on 2 cores)
    python -m mpipar.report --plots-only   # redraw and rewrite from the CSVs already in plots/

Every number in the report is read from a CSV that this run (or an earlier one) wrote; the cost
model's numbers are labelled as predictions. The benchmarks run one after another, never at the
same time, with one BLAS thread per rank.
"""

import argparse
import importlib
import math
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

BENCHES = ["engine", "flops", "net", "dp", "tp", "pp", "hybrid"]


def _f(row, key):
    return float(row[key])


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


# ----------------------------------------------------------------------------- cost model check
def fit_power(flops, seconds):
    """(fixed, a, e) of t = fixed + a flops^e fitted to one-rank step times (relative errors,
    like alpha and beta; e on a grid of 0.6 to 1). A fixed FLOP rate (e = 1) misses both ends:
    BLAS runs small products well below its peak, so the rate grows with their size (e < 1);
    a tensor-parallel rank's products are 1/P the size, and run at their own, lower rate."""
    import numpy as np

    f, t = np.asarray(flops, dtype=float), np.asarray(seconds, dtype=float)
    best = None
    for e in np.linspace(0.6, 1.0, 81):
        A = np.stack([1.0 / t, f**e / t], axis=1)
        coef, *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
        err = float(np.sum((A @ coef - 1) ** 2))
        if coef[1] > 0 and (best is None or err < best[0]):
            best = (err, max(float(coef[0]), 0.0), float(coef[1]), float(e))
    return best[1:]


UPDATE_CSV = "update_cost.csv"  # the update times of the run, kept for --plots-only
_update_times = {}  # (model, optimizer) -> seconds per parameter, measured or read back


def update_cost(model, momentum=0.9, repeats=9, name=None):
    """Seconds per parameter of ``model``'s zero_grad + SGD update (with ``momentum``, as the
    benchmark's trainer; or the optimizer ``name`` as the trainers build it: sgd, adam or
    adamw), timed here (float32): work that grows with the parameters, whatever the batch,
    and that every replica does whole. Measured once per run of the benchmarks and written to
    plots/update_cost.csv, which ``--plots-only`` reads back, so that it redraws the same
    predictions."""
    from mpipar import backend as B
    from mpipar import optim
    from mpipar.bench.common import median_time

    B.use("numpy", "float32")
    shapes = [p.shape for p in model.parameters()]
    key = (f"{type(model).__name__}: {sum(math.prod(s) for s in shapes)} values in "
           f"{len(shapes)} tensors", name or f"sgd, momentum {momentum}")
    if not _update_times and (PLOTS / UPDATE_CSV).exists():
        _update_times.update({(r["model"], r["optimizer"]): _f(r, "seconds_per_value")
                              for r in read_csv(UPDATE_CSV)})
    if key in _update_times:
        return _update_times[key]
    model.init(0)
    opt = (optim.make(name, model.parameters(), 1e-4) if name else
           optim.SGD(model.parameters(), lr=1e-4, momentum=momentum))

    def update():
        model.zero_grad()
        opt.step()

    _update_times[key] = median_time(update, repeats) / sum(p.size for p in model.parameters())
    write_csv(UPDATE_CSV, [dict(environment(), bench="update", model=m, optimizer=o,
                                seconds_per_value=t) for (m, o), t in _update_times.items()])
    return _update_times[key]


def oversubscribed_alpha_beta():
    """alpha and beta that a 4-rank job on fewer cores really sees: fitted with the ring
    formula 6 alpha + 1.5 n beta to what an MPI Allreduce costs between computations there
    (the "allreduce-lockstep" rows of plots/net.csv: ranks take turns on the cores, and each
    step of the collective waits for a partner to be woken)."""
    from mpipar.bench.net import fit_alpha_beta

    rows = [r for r in read_csv("net.csv") if r["kind"] == "allreduce-lockstep"]
    a, b = fit_alpha_beta([int(r["bytes"]) for r in rows], [_f(r, "seconds") for r in rows])
    return a / 6, max(b, 0.0) / 1.5


def lockstep_allreduce():
    """seconds(n_bytes, ranks) of an allreduce between computations with more ranks than
    cores, from what the "allreduce-lockstep" rows of plots/net.csv measured (4 ranks):
    interpolated between the measured sizes, the smallest size's cost below them, the last
    two sizes' slope beyond them; a group of p ranks makes lg p of lg 4 dependent exchanges
    (MPICH's recursive doubling and halving), each waiting for a partner to be woken."""
    import numpy as np

    rows = [r for r in read_csv("net.csv") if r["kind"] == "allreduce-lockstep"]
    ranks = int(rows[0]["ranks"])
    n, t = zip(*sorted((int(r["bytes"]), _f(r, "seconds")) for r in rows))

    def cost(n_bytes, p):
        if n_bytes > n[-1]:
            c = t[-1] + (n_bytes - n[-1]) * (t[-1] - t[-2]) / (n[-1] - n[-2])
        else:
            c = float(np.interp(n_bytes, n, t))
        return c * math.log2(p) / math.log2(ranks)

    return cost


def validation_rows():
    """Measured step time of every benchmarked configuration beside the cost model's.

    Everything the model is given is measured in the same run: the FLOP rate from one-rank
    step times of the benchmark's own model, less the optimizer update (:func:`update_cost`,
    which every replica or stage does whole; a tensor-parallel rank updates its shards: the
    update's cost per value divides, its cost per call does not), with, for tensor
    parallelism, a fixed cost per step and a rate that grows with the size of the products
    (:func:`fit_power`, fitted over the sizes, taken at the size of one rank's share), scaled by
    plots/flops.csv for the ranks computing at once: every rank where they all compute
    together, and, with more ranks than cores, by how many compute at each moment of the
    pipeline replay (:func:`mpipar.simulate.shared_replay`). alpha and beta come from the
    ping-pong, or, for runs with more ranks than cores, from allreduces between computations
    on 4 ranks (:func:`oversubscribed_alpha_beta`), where the allreduces between layers cost
    what those measured at their size (:func:`lockstep_allreduce`)."""
    from mpipar import simulate as S
    from mpipar.bench.net import fit_alpha_beta
    from mpipar.bench.net import predict as allreduce_time

    flops = read_csv("flops.csv")
    shared, each = {}, {}  # ranks -> the share with every rank computing, or with more ranks
    for p in {int(r["ranks"]) for r in flops}:  # than cores, by the number of ranks computing
        rows = [r for r in flops if int(r["ranks"]) == p]
        table = {int(r["computing"]): _f(r, "share_of_one") for r in rows}
        shared[p] = table if p > cores() and len(table) == p else table[p]
        if "share_mean" in rows[0] and isinstance(shared[p], dict):
            each[p] = {int(r["computing"]): _f(r, "share_mean") for r in rows}
    over_alpha, over_beta = oversubscribed_alpha_beta()
    lockstep = lockstep_allreduce()
    out = []

    def links(ranks, alpha, beta):
        return (over_alpha, over_beta) if ranks > cores() else (alpha, beta)

    def machine(rate, ranks, alpha, beta, **kw):  # this machine, as a run of `ranks` sees it
        if ranks > cores():  # allreduces between layers at their measured cost there
            return S.this_machine(rate, over_alpha, over_beta, allreduce=lockstep, **kw)
        return S.this_machine(rate, alpha, beta, **kw)

    # data parallelism: MLP, P replicas; compute from the simulator, exchange by algorithm
    dp = read_csv("dp.csv")
    algo = {"master": "master", "allreduce": "mpi", "ring": "ring", "zero1": "zero",
            "allreduce+overlap": "mpi"}
    t_param = {}  # MLP widths -> seconds per parameter of zero_grad + the SGD update
    for r in dp:
        sizes = tuple(int(v) for v in r["model"].split()[1].split(","))
        spec, batch, p = S.MLPSpec(sizes), int(r["batch"]), int(r["ranks"])
        if sizes not in t_param:
            t_param[sizes] = update_cost(spec.model())
        one = next(x for x in dp if x["mode"] == r["mode"] and x["ranks"] == "1")
        # every replica zeroes its gradients and updates all its parameters (ZeRO-1: 1/P of
        # them); the rest of the one-rank step is the forward and backward, which P divides
        n_params = int(r["params"])
        update_one = n_params * t_param[sizes]
        # backward ~ 2 forwards; the factor cancels, since the rate is measured on this model
        flops = 3 * sum(t["flops"] for t in S.layer_table(spec, batch))
        rate = flops / (_f(one, "step_ms") / 1e3 - update_one)
        alpha, beta = links(p, _f(r, "alpha"), _f(r, "beta"))
        hw = S.this_machine(rate, alpha, beta, update_per_param=t_param[sizes])
        pred = S.predict(spec, hw, dp=p, global_batch=batch, dtype_bytes=4,
                         zero=int(r["mode"] == "zero1"), compute_share=shared[p])["compute_s"]
        # one exchange of every gradient per step, after all the compute: each algorithm's
        # formula (with more ranks than cores, alpha and beta fitted to lockstep allreduces)
        pred += allreduce_time(algo[r["mode"]], p, n_params * 4, alpha, beta, _f(r, "gamma"))
        out.append(dict(bench="dp", config=f"{r['mode']}, P={p}", ranks=p,
                        measured_ms=_f(r, "step_ms"), predicted_ms=pred * 1e3))

    # pipeline: the bench's balanced stack of Linear(W, W) + ReLU, replayed schedule
    net = read_csv("net.csv")
    alpha, beta = _f(net[0], "alpha"), _f(net[0], "beta")
    pp = [r for r in read_csv("pp.csv") if r["stage"] == "0"]

    def pp_spec(r):
        width = int(r["model"].split("Linear(")[1].split(",")[0])
        return S.MLPSpec(tuple([width] * (int(r["model"].split(" x ")[0]) + 1)))

    # every stage holds the same layers: one micro-batch through one stage is 1/P of the
    # serial step on one micro-batch (m = 1, timed in the benchmark's run), less the update
    serial_one = {int(r["ranks"]): _f(r, "serial_step_ms") / 1e3 for r in pp if r["m"] == "1"}
    pp_param = update_cost(pp_spec(pp[0]).model(), momentum=0.0)  # the bench's plain SGD
    for r in pp:
        p, m, rows = int(r["ranks"]), int(r["m"]), int(r["rows_per_micro"])
        spec = pp_spec(r)
        table = S.layer_table(spec, rows)
        t_micro = (serial_one[p] - sum(t["params"] for t in table) * pp_param) / p
        hw = machine(3 * sum(t["flops"] for t in table) / p / t_micro, p, alpha, beta,
                     update_per_param=pp_param)
        pred = S.predict(spec, hw, pp=p, global_batch=rows * m, n_micro=m,
                         schedule=r["schedule"], dtype_bytes=4, compute_share=shared[p],
                         stage_share=each.get(p))
        out.append(dict(bench="pp", config=f"{r['schedule']}, P={p}, m={m}", ranks=p,
                        measured_ms=_f(r, "step_ms"), predicted_ms=pred["step_s"] * 1e3))

    # tensor parallelism: one transformer block, 4 allreduces of b*s*h per step
    tp = read_csv("tp.csv")

    def block(r):
        return S.GPTSpec(0, int(r["hidden"]), int(r["heads"]), 1, int(r["seq"]),
                         blocks_only=True)

    # the update of a block: a cost per call (Python, per parameter tensor; every rank makes
    # the same calls) plus a cost per value (which TP divides), fitted over the hidden sizes
    sizes = sorted({int(x["hidden"]): x for x in tp}.items())
    n_values = {h: sum(t["params"] for t in S.layer_table(block(x), 1)) for h, x in sizes}
    t_update = {h: update_cost(block(x).model(), momentum=0.0) * n_values[h] for h, x in sizes}
    per_call = max(fit_alpha_beta(list(n_values.values()), list(t_update.values()))[0], 0.0)
    tp_param = {h: max(t_update[h] - per_call, 0.0) / n_values[h] for h in t_update}

    for r in tp:
        h, b, s, p = int(r["hidden"]), int(r["batch"]), int(r["seq"]), int(r["ranks"])
        spec = block(r)
        ones = [x for x in tp if x["batch"] == r["batch"] and x["ranks"] == "1"]
        fixed, scale, power = fit_power(
            [3 * S.layer_table(block(x), b)[0]["flops"] for x in ones],
            [_f(x, "step_ms") / 1e3 - tp_param[int(x["hidden"])] * n_values[int(x["hidden"])]
             for x in ones])
        work = 3 * S.layer_table(spec, b)[0]["flops"] / p  # one rank's share
        rate = work / (scale * work**power)  # the rate at the size of a rank's products
        hw = machine(rate, p, _f(r, "alpha"), _f(r, "beta"),
                     layer_overhead=fixed / 3,  # one block: forward + 2 x backward
                     update_per_param=tp_param[h])
        pred = S.predict(spec, hw, tp=p, global_batch=b, dtype_bytes=4, compute_share=shared[p])
        out.append(dict(bench="tp", config=f"h={h}, b={b}, s={s}, P={p}", ranks=p,
                        measured_ms=_f(r, "step_ms"), predicted_ms=pred["step_s"] * 1e3))
    # hybrid: the course's GPT on every layout of 4 ranks, rate from the serial step
    if (PLOTS / "hybrid.csv").exists():
        from mpipar.data import Text

        vocab = Text().vocab
        gpt_param = {}  # model -> seconds per parameter of zero_grad + the Adam update
        for r in read_csv("hybrid.csv"):
            d_model, heads, layers, seq = (int(v[1:]) for v in r["model"].split()[1:])
            spec = S.GPTSpec(vocab, d_model, heads, layers, seq)
            batch, m = int(r["batch"]), int(r["micro_batches"])
            if r["model"] not in gpt_param:  # the serial trainer's Adam, on every replica
                gpt_param[r["model"]] = update_cost(spec.model(), name="adam")
            update_one = int(r["params"]) * gpt_param[r["model"]]
            rate = 3 * sum(t["flops"] for t in S.layer_table(spec, batch)) / \
                (_f(r, "serial_step_ms") / 1e3 - update_one)
            hw = machine(rate, int(r["ranks"]), alpha, beta,
                         update_per_param=gpt_param[r["model"]])
            pred = S.predict(spec, hw, int(r["dp"]), int(r["tp"]), int(r["pp"]), batch, m,
                             r["schedule"], dtype_bytes=4, compute_share=shared[int(r["ranks"])],
                             stage_share=each.get(int(r["ranks"])))
            out.append(dict(bench="hybrid", config=r["layout"], ranks=int(r["ranks"]),
                            measured_ms=_f(r, "step_ms"), predicted_ms=pred["step_s"] * 1e3))
    for row in out:
        row["error"] = row["predicted_ms"] / row["measured_ms"] - 1
        row["oversubscribed"] = row["ranks"] > cores()
    return out


def plot_validation(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    colors = {"dp": "#4C72B0", "pp": "#DD8452", "tp": "#55A868", "hybrid": "#C44E52"}
    for bench, color in colors.items():
        for over in (False, True):
            pts = [r for r in rows if r["bench"] == bench and r["oversubscribed"] == over]
            if not pts:
                continue
            ax.scatter([r["measured_ms"] for r in pts], [r["predicted_ms"] for r in pts], s=18,
                       facecolors="none" if over else color, edgecolors=color,
                       label=f"{bench}{', oversubscribed' if over else ''} ({len(pts)})")
    lo = min(min(r["measured_ms"], r["predicted_ms"]) for r in rows) * 0.7
    hi = max(max(r["measured_ms"], r["predicted_ms"]) for r in rows) * 1.3
    xs = [lo, hi]
    ax.plot(xs, xs, "k-", lw=1, label="prediction = measurement")
    ax.fill_between(xs, [x * 0.8 for x in xs], [x * 1.2 for x in xs], color="gray", alpha=0.2,
                    label="within 20%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms), mpipar.simulate")
    fair = [r for r in rows if not r["oversubscribed"]]
    inside = sum(abs(r["error"]) <= 0.2 for r in fair)
    ax.set_title(f"Cost model: {inside} of {len(fair)} runs with a core per rank within 20%\n"
                 "(hollow: more ranks than cores)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
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

    def dp_speedup(mode, p):
        return next(_f(r, "speedup") for r in dp if r["mode"] == mode and int(r["ranks"]) == p)

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
        "beside its prediction (`dp.csv`).",
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
