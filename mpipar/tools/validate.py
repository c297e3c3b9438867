"""The cost model against the benchmarks: what the benchmarks' CSVs say about this machine, and
the prediction of :mod:`mpipar.tools.simulate` beside every configuration they measured.

    python -m mpipar.tools.report --plots-only   # rewrites plots/model_validation.csv and .png

What it reads, all written by the same ``make report`` run: each benchmark's one-rank steps
(the FLOP rate of its own model; for tensor parallelism on 2 ranks, the one-rank block timed
while the other rank computes its own, since two ranks computing at once run slower than one
alone: :func:`tp_calibration`), the optimizer update (:func:`update_cost`, timed here once per
run and kept in plots/update_cost.csv), the share of a core k computing ranks get
(plots/flops.csv), alpha and beta from the ping-pong, and what an allreduce between
computations costs with more ranks than cores (the lockstep rows of plots/net.csv). Run it
through the report, which sets one BLAS thread before NumPy loads (the update timings must
see what the benchmarks saw).
:func:`validation_rows` puts each measured step time beside the model's; :mod:`mpipar.tools.report`
plots them and writes the summary into plots/REPORT.md.
"""

import math

from mpipar.tools.bench.common import (
    PLOTS,
    cores,
    environment,
    pyplot,
    read_csv,
    save_figure,
    write_csv,
)
from mpipar.tools.bench.common import csv_float as _f


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


def tp_calibration(ones, ranks, share, flops_of, update_of):
    """(fixed, a, e, share): a tensor-parallel rank's compute on ``ranks`` ranks is
    fixed + a (F / ranks)^e / share, from :func:`fit_power` over the one-rank rows ``ones`` of
    plots/tp.csv (one step shape), each less its update (``update_of``; ``flops_of`` its FLOPs).

    One rank (P = 1): the one-rank block's step times (``step_ms``), share 1. P > 1: the same
    block timed while the other rank runs its own at the same moment, between the same
    barriers, with no messages (``step_both_ms``): both ranks computing at once on shared
    cores and memory run slower than one alone, by more than plots/flops.csv's share says for
    one large product timed at another moment; these times hold that slowdown, measured in the
    same rounds as the P = 2 steps, so the share is 1. A CSV written without that column
    falls back to the idle-partner times scaled by ``share`` (flops.csv's), the earlier method."""
    column = "step_ms"
    if ranks > 1 and ones and ones[0].get("step_both_ms") not in (None, ""):
        column, share = "step_both_ms", 1.0
    fit = fit_power([flops_of(x) for x in ones],
                    [_f(x, column) / 1e3 - update_of(x) for x in ones])
    return (*fit, share if ranks > 1 else 1.0)


UPDATE_CSV = "update_cost.csv"  # the update times of the run, kept for --plots-only
_update_times = {}  # (model, optimizer) -> seconds per parameter, measured or read back


def update_cost(model, momentum=0.9, repeats=9, name=None):
    """Seconds per parameter of ``model``'s zero_grad + SGD update (with ``momentum``, as the
    benchmark's trainer; or the optimizer ``name`` as the trainers build it: sgd, adam or
    adamw), timed here (float32): work that grows with the parameters, whatever the batch,
    and that every replica does whole. Measured once per run of the benchmarks and written to
    plots/update_cost.csv, which ``--plots-only`` reads back, so that it redraws the same
    predictions."""
    from mpipar.engine import backend as B
    from mpipar.engine import optim
    from mpipar.tools.bench.common import median_time

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


def lockstep_rows():
    """The "allreduce-lockstep" rows of plots/net.csv: an allreduce between computations."""
    return [r for r in read_csv("net.csv") if r["kind"] == "allreduce-lockstep"]


def oversubscribed_alpha_beta():
    """alpha and beta that a 4-rank job on fewer cores really sees: fitted with the ring
    formula 6 alpha + 1.5 n beta to what an MPI Allreduce costs between computations there
    (the "allreduce-lockstep" rows of plots/net.csv: ranks take turns on the cores, and each
    step of the collective waits for a partner to be woken)."""
    from mpipar.tools.bench.net import fit_alpha_beta

    rows = lockstep_rows()
    a, b = fit_alpha_beta([int(r["bytes"]) for r in rows], [_f(r, "seconds") for r in rows])
    return a / 6, max(b, 0.0) / 1.5


def lockstep_allreduce():
    """seconds(n_bytes, ranks) of an allreduce between computations with more ranks than
    cores, from what the "allreduce-lockstep" rows of plots/net.csv measured (4 ranks):
    interpolated between the measured sizes, the smallest size's cost below them, the last
    two sizes' slope beyond them; a group of p ranks makes lg p of lg 4 dependent exchanges
    (MPICH's recursive doubling and halving), each waiting for a partner to be woken."""
    import numpy as np

    rows = lockstep_rows()
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
    (:func:`fit_power`, fitted over the sizes, taken at the size of one rank's share); on 2
    ranks fitted to the one-rank block timed while the other rank computes its own at the same
    moment (:func:`tp_calibration`). Elsewhere the rate is scaled by
    plots/flops.csv for the ranks computing at once: every rank where they all compute
    together, and, with more ranks than cores, by how many compute at each moment of the
    pipeline replay (:func:`mpipar.tools.simulate.shared_replay`). alpha and beta come from the
    ping-pong, or, for runs with more ranks than cores, from allreduces between computations
    on 4 ranks (:func:`oversubscribed_alpha_beta`), where the allreduces between layers cost
    what those measured at their size (:func:`lockstep_allreduce`); with a core per rank they
    cost what MPI's Allreduce measured back to back on as many ranks at their size
    (:func:`mpipar.tools.hardware.allreduce_table`, the formula outside the measured sizes)."""
    from mpipar.tools import simulate as S
    from mpipar.tools.bench.net import fit_alpha_beta
    from mpipar.tools.bench.net import predict as allreduce_time
    from mpipar.tools.hardware import allreduce_table

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
    measured = allreduce_table(read_csv("net.csv"))  # MPI's Allreduce, by ranks and size
    out = []

    def links(ranks, alpha, beta):
        return (over_alpha, over_beta) if ranks > cores() else (alpha, beta)

    def machine(rate, ranks, alpha, beta, **kw):  # this machine, as a run of `ranks` sees it
        if ranks > cores():  # allreduces between layers at their measured cost there
            return S.this_machine(rate, over_alpha, over_beta, allreduce=lockstep, **kw)
        return S.this_machine(rate, alpha, beta, measured=measured, **kw)  # as net.csv timed

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

    fits = {}  # (batch, ranks) -> (fixed, a, e, share) from that step shape's one-rank blocks
    for r in tp:
        h, b, s, p = int(r["hidden"]), int(r["batch"]), int(r["seq"]), int(r["ranks"])
        spec = block(r)
        if (b, p) not in fits:  # P = 2: as fast as one rank computes while its partner does
            fits[b, p] = tp_calibration(
                [x for x in tp if x["batch"] == r["batch"] and x["ranks"] == "1"], p, shared[p],
                lambda x: 3 * S.layer_table(block(x), int(x["batch"]))[0]["flops"],
                lambda x: tp_param[int(x["hidden"])] * n_values[int(x["hidden"])])
        fixed, scale, power, share = fits[b, p]
        work = 3 * S.layer_table(spec, b)[0]["flops"] / p  # one rank's share
        rate = work / (scale * work**power)  # the rate at the size of a rank's products
        hw = machine(rate, p, _f(r, "alpha"), _f(r, "beta"),
                     layer_overhead=fixed / 3,  # one block: forward + 2 x backward
                     update_per_param=tp_param[h])
        pred = S.predict(spec, hw, tp=p, global_batch=b, dtype_bytes=4, compute_share=share)
        out.append(dict(bench="tp", config=f"h={h}, b={b}, s={s}, P={p}", ranks=p,
                        measured_ms=_f(r, "step_ms"), predicted_ms=pred["step_s"] * 1e3))
    # hybrid: the course's GPT on every layout of 4 ranks, rate from the serial step
    if (PLOTS / "hybrid.csv").exists():
        from mpipar.engine.data import Text

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
    ax.set_ylabel("predicted step time (ms), mpipar.tools.simulate")
    fair = [r for r in rows if not r["oversubscribed"]]
    inside = sum(abs(r["error"]) <= 0.2 for r in fair)
    ax.set_title(f"Cost model: {inside} of {len(fair)} runs with a core per rank within 20%\n"
                 "(hollow: more ranks than cores)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path)
