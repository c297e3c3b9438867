"""Pipeline parallelism: the measured bubble beside (p-1)/(m+p-1), the activations each stage
stashes under GPipe and 1F1B, and the step time beside the serial trainer's, the speedup split
into its factors (bubble, micro-batch efficiency, stage efficiency, span share: see
``decomposition``); zero-bubble ZB-H1 beside 1F1B in the same launch: its bubble beside
(p-1)/(3m+p-1), its stash and step time.

    python -m mpipar.tools.bench pp # pp.csv, pp_bubble.png, pp_memory.png, pp_timelines.png
    python -m mpipar.tools.bench pp --micro 16 --rows 256    # bigger micro-batches, the same bubble

Balanced stages, so that the formula applies: every stage holds the same LAYERS = 4 blocks of
Linear(W, W) + ReLU (W = 1024, float32, one BLAS thread per rank; every Linear computes its
input's gradient, so the first stage's backward costs what the others' does), micro-batches of
ROWS = 64 rows (the batch grows with m: 64 m rows). One stage's forward of one micro-batch is
0.54 GFLOP (about 5 ms on one core, backward about 12 ms), against one 256 KiB message each
way and about 0.1 ms of Python per message, so messaging costs a few percent of the step.
The last stage adds a mean squared error (under 1% of its work; a softmax cross-entropy over W
classes would add about 10%, and an unbalanced last stage raises the bubble).

One launch per P (2, then 4: 4 ranks on 2 cores are oversubscribed and marked so); in it, for
gpipe, 1f1b and zb-h1 with m in {1, 2, 4, 8, 16}, and naive up to m = 4 (its bubble is (p-1)/p
for any m): warm-up rounds, then timed rounds, each running every configuration once (barrier, the
step, the slowest rank's time), so that a slow spell of a shared machine spoils one sample of
many configurations, not every sample of a few; the median over rounds. The bubble of a step
comes from the trace (mpipar.mpi.trace): 1 - (sum over ranks of forward + backward time) /
(P * span from the first forward to the last backward, W's counted as backward), the median
over steps. Here dx and dW of a Linear cost the same FLOPs as its forward, so F, B and W take
about equal times, as ZB-H1's formula assumes; each stage's measured F, B and W of one
micro-batch (the median of its instruction spans) go into pp.csv, and the schedule replayed
with them (:func:`replayed_bubble`: unequal stages, W unlike B) gives the bubble those times
allow, beside the measured one. The processes keep freed memory for reuse
(:func:`mpipar.engine.backend.steady_heap`, as a trainer does). The peak stash of a stage is the
most bytes
nn.Module.cached_bytes() showed after any forward or B, beside the prediction: the schedule's
peak micro-batches in flight times one micro-batch's stash (for zb-h1, schedules.peak_stash:
a micro-batch between its B and its W holds what W needs instead, each Linear's input and
output gradient, more than the forward's input and 1-byte ReLU mask). The serial step is timed
by rank 0 on the whole model and the same batch in the same rounds (the others wait), both
as one step on the whole batch and accumulated over the m micro-batches; their ratio, the
micro-batch efficiency, is one factor of the speedup (see ``decomposition``).
"""

import argparse
import math
import statistics

from mpipar.tools.bench.common import (
    bench_parser,
    cores,
    count_list,
    environment,
    number,
    pyplot,
    run_ranks,
    save_figure,
    too_big,
    write_csv,
    wrote,
)

WIDTH, ROWS, LAYERS = 1024, 64, 4  # per stage: LAYERS x (Linear(WIDTH, WIDTH), ReLU)
DEFAULT_ROWS = ROWS  # other --rows write pp_rows{ROWS}.csv, and no pictures
NAIVE_MAX_M = 4  # naive's bubble is (p-1)/p for every m, and its steps are the longest
MICRO = (1, 2, 4, 8, 16)
SCHEDULE_NAMES = ("naive", "gpipe", "1f1b", "zb-h1")
RANKS = (2, 4)
TIMELINE_M = 4


def build_model(n_stages):
    from mpipar.engine import nn

    layers = []
    for i in range(n_stages * LAYERS):
        layers += [(f"fc{i}", nn.Linear(WIDTH, WIDTH)), (f"act{i}", nn.ReLU())]
    return nn.Sequential(layers)


def batch(m):
    from mpipar.engine import backend as B
    from mpipar.engine import data

    x = data.synthetic(0, (ROWS * m, WIDTH))
    y = data.synthetic(1, (ROWS * m, WIDTH))  # regression targets for the MSE
    return B.asarray(x, dtype=B.dtype), B.asarray(y, dtype=B.dtype)


class SerialReference:
    """The whole model in one process, timed two ways on the batch of m micro-batches: the
    serial step (forward, loss, backward, update on all ROWS x m rows at once) and the same step
    accumulated over m micro-batches of ROWS rows (a forward and a backward per micro-batch,
    the gradients summed with +=, one update): what P = 1 with m micro-batches would compute.
    Their ratio is the micro-batch efficiency: the share of the serial speed that matrix
    products of ROWS rows keep (each micro-batch also adds its dW to the whole gradient).

    Beside them, in the same rounds, one Linear(WIDTH, WIDTH)'s three products in bare NumPy
    (forward x W, dx = dy W^T, dW = x^T dy), on the whole batch and over its m micro-batches
    with each dW added into the gradient as a stage adds it: their ratio, the BLAS efficiency,
    is the part of the micro-batch efficiency that the BLAS library sets, with no framework."""

    def __init__(self, n_stages, micro_counts):
        from mpipar import pipeline as PP
        from mpipar.engine import backend as B
        from mpipar.engine import data, nn, optim

        self.model = build_model(n_stages).init(0)
        self.opt = optim.SGD(self.model.parameters(), lr=1e-4)
        self.loss_fn = nn.MSE()
        self.batches = {m: batch(m) for m in micro_counts}
        self.micro = {m: (PP.micro_batches(x, m), PP.micro_batches(y, m))
                      for m, (x, y) in self.batches.items()}
        self.samples = {m: dict(serial=[], accumulated=[], products_whole=[],
                                products_micro=[]) for m in micro_counts}
        self.W = B.asarray(data.synthetic(2, (WIDTH, WIDTH)) / math.sqrt(WIDTH), dtype=B.dtype)
        self.dW = B.xp.zeros_like(self.W)

    def serial(self, m):
        from mpipar import serial

        serial.train_step(self.model, self.loss_fn, self.opt, *self.batches[m])

    def accumulated(self, m):
        xs, ys = self.micro[m]
        normalizer = self.batches[m][1].size
        self.opt.zero_grad()
        for k, (x, y) in enumerate(zip(xs, ys)):
            self.loss_fn.forward(self.model.forward(x, k), y, normalizer, k)
            self.model.backward(self.loss_fn.backward(1.0, k), k)
        self.opt.step()

    def products(self, xs):
        """One Linear's forward, dx and dW on each array of ``xs``, each dW added into one
        gradient (the output stands in for dy: the same shape, the same products)."""
        from mpipar.engine import backend as B

        for k, x in enumerate(xs):
            y = x @ self.W
            y @ self.W.T
            if k == 0:
                B.xp.matmul(x.T, y, out=self.dW)
            else:
                self.dW += x.T @ y

    def products_whole(self, m):
        self.products([self.batches[m][0]])

    def products_micro(self, m):
        self.products(self.micro[m][0])

    def time_round(self, keep):
        """Each m once, every way, alternating: a slow spell hits them alike."""
        from mpi4py import MPI

        for m, got in self.samples.items():
            for way in got:
                t0 = MPI.Wtime()
                getattr(self, way)(m)
                if keep:
                    got[way].append(MPI.Wtime() - t0)

    def medians(self, m):
        return {way: statistics.median(t) for way, t in self.samples[m].items()}


# ----------------------------------------------------------------------------- worker (mpirun)
def worker(micro_counts, steps, warmup):
    from mpi4py import MPI

    from mpipar import pipeline as PP
    from mpipar.engine import backend as B
    from mpipar.engine import nn, optim
    from mpipar.mpi import comm as C
    from mpipar.mpi.grid import Grid
    from mpipar.mpi.trace import TRACE, measured_bubble, median_step, step_summary
    from mpipar.parts.plan import stage_bounds
    from mpipar.parts.schedules import peak_in_flight, peak_stash, stage_schedule
    from mpipar.tools.bench.common import emit

    C.install_excepthook()
    B.use("numpy", "float32")
    B.steady_heap()  # as a trainer does (mpipar.train): a step reuses its pages
    pp = Grid(pp=C.world().size).pp_comm
    P, r = pp.size, pp.rank
    model = build_model(P)
    bounds = stage_bounds([2 * LAYERS] * P)[r]
    loss_fn = nn.MSE()

    probe = PP.build_stage(model, bounds, 0)  # one micro-batch's stash on this stage
    out = probe.forward(batch(1)[0], 0)
    per_micro = probe.cached_bytes()
    probe.backward_input(B.xp.ones_like(out), 0)  # and from its B to its W
    per_micro_w = probe.cached_bytes()

    configs = {}  # (schedule, m) -> what one configuration needs, built once
    for name in SCHEDULE_NAMES:
        for m in [m for m in micro_counts if name != "naive" or m <= NAIVE_MAX_M]:
            stage = PP.build_stage(model, bounds, 0)
            x, y = batch(m)
            configs[name, m] = dict(stage=stage, opt=optim.SGD(stage.parameters(), lr=1e-4),
                                    instructions=stage_schedule(name, P, r, m),
                                    normalizer=y.size,
                                    inputs=PP.micro_batches(x, m),
                                    targets=PP.micro_batches(y, m),
                                    samples=[], parts=[], traces=[], peak=0)
    # rank 0 also times the whole model in one process, in the same rounds (the others wait)
    reference = SerialReference(P, micro_counts) if r == 0 else None
    # every configuration once per round, rounds repeated: a slow spell of the machine spoils
    # one sample of many configurations rather than every sample of a few
    for step in range(warmup + steps):
        for (_, m), c in configs.items():
            pp.Barrier()
            TRACE.clear()
            t0 = MPI.Wtime()
            result = PP.run_pipeline(c["stage"], c["instructions"], pp, [ROWS] * m,
                                     inputs=c["inputs"] if r == 0 else None,
                                     targets=c["targets"] if r == P - 1 else None,
                                     loss_fn=loss_fn, normalizer=c["normalizer"],
                                     optimizer=c["opt"], measure_stash=step == 0)
            t = MPI.Wtime() - t0
            c["peak"] = max(c["peak"], result.peak_stash_bytes)  # the first round's: the
            # schedule repeats, and the walk over the modules after every F and B takes time
            if step >= warmup:
                c["samples"].append((t, step_summary(TRACE.events)))
                c["parts"].append(part_times(TRACE.events))
                if m == TIMELINE_M:  # JSON: the label as text; the micro-batch, and "weight"
                    c["traces"].append([(*e[:3], str(e[3]),  # for a W (its colour)
                                         {k: e[4][k] for k in ("micro", "part")
                                          if e[4].get(k) is not None})
                                        for e in TRACE.events
                                        if e[2] in ("forward", "backward", "optimizer")])
        if reference is not None:
            reference.time_round(keep=step >= warmup)
    for (name, m), c in configs.items():
        everyone = pp.gather_obj(dict(samples=c["samples"], peak=c["peak"],
                                      parts=[statistics.median(t) for t in zip(*c["parts"])],
                                      per_micro=per_micro,
                                      in_flight=peak_in_flight(c["instructions"]),
                                      predicted=peak_stash(c["instructions"], per_micro,
                                                           per_micro_w),
                                      traces=c["traces"] if m == TIMELINE_M else None))
        if r == 0:
            # the timeline shows the median step by duration, not one another process hit
            typical = median_step([[s[1] for s in e["samples"]] for e in everyone], skip=0)
            step_times = [max(e["samples"][i][0] for e in everyone) for i in range(steps)]
            bubbles = [measured_bubble([e["samples"][i][1] for e in everyone])
                       for i in range(steps)]
            spans = [max(e["samples"][i][1][1] for e in everyone)
                     - min(e["samples"][i][1][0] for e in everyone) for i in range(steps)]
            emit(dict(ranks=P, schedule=name, m=m, step_s=statistics.median(step_times),
                      bubble=statistics.median(bubbles), **reference.medians(m),
                      busy_s=[statistics.median(s[1][2] for s in e["samples"]) for e in everyone],
                      parts_s=[e["parts"] for e in everyone],
                      span_share=statistics.median(a / b for a, b in zip(spans, step_times)),
                      peaks=[e["peak"] for e in everyone],
                      per_micro=[e["per_micro"] for e in everyone],
                      in_flight=[e["in_flight"] for e in everyone],
                      predicted=[e["predicted"] for e in everyone],
                      events=[e["traces"][typical] for e in everyone]
                      if m == TIMELINE_M else None))


def part_times(events):
    """One rank's step: the median forward, backward (B where the schedule splits it) and W of
    one micro-batch (W 0 where there is none), from the trace's instruction spans."""
    def median(kind, part):
        spans = [e[1] - e[0] for e in events if e[2] == kind and e[4].get("part") == part]
        return statistics.median(spans) if spans else 0.0

    return median("forward", None), median("backward", None), median("backward", "weight")


def replayed_bubble(name, p, m, parts):
    """The bubble of the schedule replayed (:func:`mpipar.parts.schedules.simulate`, free messages)
    with each stage's measured forward, B and W of one micro-batch: what the schedule gives
    with these times, unequal stages and W unlike B included. The one-chunk case of
    :func:`mpipar.tools.bench.schedules.replayed`."""
    from mpipar.tools.bench.schedules import replayed

    return replayed(name, p, m, 1, [[(f, b + w, w / (b + w) if w else None)]
                                    for f, b, w in parts])


def zb_formula(p, m, tf, tb, tw):
    """ZB-H1's bubble from measured F, B and W (m >= p): each stage idles (p-1)(TF+TB-TW) of
    m(TF+TB+TW) + (p-1)(TF+TB-TW) (lessons/formulas.md); equal times give (p-1)/(3m+p-1)."""
    idle = (p - 1) * (tf + tb - tw)
    return idle / (m * (tf + tb + tw) + idle)


# ----------------------------------------------------------------------------- driver
def plot_bubble(rows, path):
    plt = pyplot()

    from mpipar.parts.schedules import bubble_formula

    fig, axes = plt.subplots(1, len(RANKS), figsize=(12, 4.4), sharey=True)
    markers = {"naive": "s", "gpipe": "o", "1f1b": "^", "zb-h1": "v"}
    for ax, p in zip(axes, RANKS):
        ms = sorted({r["m"] for r in rows if r["ranks"] == p})
        fine = [1 + i / 10 for i in range(10 * (max(ms) - 1) + 1)]
        ax.plot(fine, [bubble_formula(p, m) for m in fine], "k-", lw=1,
                label="(p-1)/(m+p-1)")
        ax.plot(fine, [bubble_formula(p, m, "naive") for m in fine], "k:", lw=1,
                label="(p-1)/p (naive)")
        ax.plot(fine, [bubble_formula(p, m, "zb-h1") for m in fine], "k--", lw=1,
                label="zb-h1: (p-1)/(3m+p-1) for m >= p")
        for name in SCHEDULE_NAMES:
            pts = [r for r in rows if r["ranks"] == p and r["schedule"] == name]
            ax.plot([r["m"] for r in pts], [r["bubble_measured"] for r in pts], markers[name],
                    ms=7, alpha=0.8, label=f"{name} measured")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms)
        ax.set_xticklabels(ms)
        ax.set_xlabel("micro-batches m")
        over = " (4 ranks on 2 cores: oversubscribed)" if rows and any(
            r["oversubscribed"] for r in rows if r["ranks"] == p) else ""
        ax.set_title(f"P = {p} stages{over}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("bubble (idle share of the step)")
    fig.suptitle(f"pipeline bubble, measured from traces: {LAYERS} x Linear({WIDTH},{WIDTH}) "
                 f"per stage, {ROWS} rows per micro-batch, float32")
    save_figure(fig, path)
    return path


def plot_memory(rows, path, p, m):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = [n for n in SCHEDULE_NAMES
             if any((r["ranks"], r["m"], r["schedule"]) == (p, m, n) for r in rows)]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        pts = sorted((r for r in rows if (r["ranks"], r["m"], r["schedule"]) == (p, m, name)),
                     key=lambda r: r["stage"])
        xs = [r["stage"] + (i - (len(names) - 1) / 2) * width for r in pts]
        ax.bar(xs, [r["peak_stash_bytes"] / 2**20 for r in pts], width, label=f"{name} measured")
        ax.plot(xs, [r["predicted_stash_bytes"] / 2**20 for r in pts], "k_", ms=16, mew=2)
    ax.plot([], [], "k_", ms=12, mew=2, label="predicted: in flight x one micro-batch (zb-h1: "
            "what W needs from B to W)")
    ax.set_xticks(range(p))
    ax.set_xticklabels([f"stage {s}" for s in range(p)])
    ax.set_ylabel("peak stashed activations (MiB)")
    ax.set_title(f"activation memory per stage, P = {p}, m = {m}: GPipe stashes m, 1F1B p - r, "
                 "ZB-H1 p on every stage", fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)  # headroom: the legend above the tallest bars
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)
    return path


def plot_timelines(results, p, path):
    plt = pyplot()

    from mpipar.mpi.trace import gantt
    from mpipar.parts.schedules import bubble_formula

    picked = [res for res in results if res["ranks"] == p and res["events"]]
    picked.sort(key=lambda res: SCHEDULE_NAMES.index(res["schedule"]))
    spans = [max(e[1] for ev in res["events"] for e in ev)
             - min(e[0] for ev in res["events"] for e in ev) for res in picked]
    fig, axes = plt.subplots(len(picked), 1, figsize=(11, 1.0 + 0.55 * p * len(picked)))
    for ax, res in zip(axes, picked):
        name = res["schedule"]
        gantt([[tuple(e) for e in ev] for ev in res["events"]], None, ax=ax,
              title=f"{name}: measured bubble {res['bubble']:.2f}, formula "
                    f"{bubble_formula(p, TIMELINE_M, name):.2f}")
        ax.set_xlim(0, max(spans) * 1e3 * 1.2)  # room on the right for the legend
    fig.suptitle(f"one step on {p} stages ({p} ranks on {cores()} cores), m = {TIMELINE_M} "
                 "micro-batches: real traces, the median step by duration")
    save_figure(fig, path)
    return path


def decomposition(res):
    """The factors of the speedup over serial, each a ratio of times from the same rounds:

        speedup = P x (1 - bubble) x micro-batch efficiency x stage efficiency x span share

    - micro-batch efficiency: serial step / accumulated step (SerialReference): the price of
      computing in micro-batches of ROWS rows rather than on the whole batch at once;
    - stage efficiency: accumulated step / (P x a stage's mean compute time, forward and
      backward from the trace): a stage against its share of the accumulated step, below 1
      when the P ranks slow each other (shared memory bandwidth, shared cores); the messages
      fall outside the compute spans, and unequal stages show in the bubble;
    - span share: first forward to last backward over the whole step (barrier to the slowest
      rank's end): the rest is the optimizer step and the messages around the span.
    The bubble is 1 - (sum of the stages' compute) / (P x span), so the product is the
    speedup exactly for one step; with the medians over steps, nearly."""
    p = res["ranks"]
    mean_busy = statistics.mean(res["busy_s"])
    parts = dict(micro_efficiency=res["serial"] / res["accumulated"],
                 stage_efficiency=res["accumulated"] / (p * mean_busy),
                 span_share=res["span_share"])
    parts["speedup_product"] = p * (1 - res["bubble"]) * math.prod(parts.values())
    return parts


def print_decomposition(by):
    """1F1B's speedup factor by factor, and the P = 2, m = 16 target."""
    print(f"speedup over serial = P x (1 - bubble) x micro-batch efficiency (ROWS = {ROWS} rows) "
          "x stage efficiency x span share (1f1b):")
    for (p, m, name), r in sorted(by.items()):
        if name == "1f1b":
            print(f"  P={p} m={m:2d}: {r['speedup_vs_serial']:5.2f} = {p} x "
                  f"{1 - r['bubble_measured']:.3f} x {r['micro_efficiency']:.3f} x "
                  f"{r['stage_efficiency']:.3f} x {r['span_share']:.3f} "
                  f"(product {r['speedup_product']:.2f})")
    if (2, 16, "1f1b") in by:
        r = by[2, 16, "1f1b"]
        ceiling = 2 * (1 - r["bubble_measured"]) * r["micro_efficiency"]
        print(f"target: at P=2 m=16 1f1b a speedup of at least 1.6: {r['speedup_vs_serial']:.2f}, "
              f"{'met' if r['speedup_vs_serial'] >= 1.6 else 'NOT met'}; the bubble and "
              f"micro-batches of {ROWS} rows leave P x (1 - bubble) x micro-batch efficiency = "
              f"{ceiling:.2f}; bare NumPy's products alone keep {r['blas_efficiency']:.3f} of "
              "the whole batch's speed in micro-batches (the BLAS efficiency)")


def parser():
    """bench pp's command line. ``--rows`` defaults to DEFAULT_ROWS, not to ROWS, which an
    earlier :func:`main` in the same process (make report runs pp_wide after pp, launch after
    launch) may have set."""
    ap = bench_parser("pp", "fewer micro-batch counts and steps")
    ap.sized("--steps", 8, 3, type=number(), help="timed steps per configuration")
    ap.sized("--micro", list(MICRO), [1, 4, 16], type=count_list(),
             help="micro-batch counts, comma-separated")
    ap.sized("--warmup", 2, 1, type=number(zero_ok=True), help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=number(), default=DEFAULT_ROWS,
                    help=f"rows per micro-batch (default {DEFAULT_ROWS}); the micro-batch "
                         "efficiency, and with it the speedup, grows with it (other than the "
                         "default: pp_rows<N>.csv, no pictures)")
    ap.add_argument("--ranks", type=count_list(), default=list(RANKS),
                    help="pipeline lengths P, one launch each (default 2,4)")
    return ap


def main(argv=None):
    global ROWS  # --rows: batch() and the worker read it; the workers get it as a flag
    ap = parser()
    args = ap.parse_args(argv)
    batches = 4 * 2 * WIDTH * args.rows * sum(args.micro) * max(args.ranks)  # inputs, targets
    if problem := too_big(batches, f"--rows {args.rows}, --micro {','.join(map(str, args.micro))}"
                                   f" and --ranks {max(args.ranks)}: the batches alone"):
        ap.error(problem)
    ROWS = args.rows
    micro = args.micro
    if args.worker:
        worker(micro, args.steps, args.warmup)
        return

    from mpipar.parts.schedules import bubble_formula

    results = []
    for p in args.ranks:
        results += run_ranks(p, "mpipar.tools.bench.pp", [
            "--worker", "--micro", ",".join(map(str, micro)), "--steps", args.steps,
            "--warmup", args.warmup, "--rows", ROWS])
    rows = []
    for res in results:
        p, m, name = res["ranks"], res["m"], res["schedule"]
        formula = bubble_formula(p, m, name)
        parts = decomposition(res)
        for stage in range(p):
            rows.append(dict(
                environment(ranks=p), bench="pp",
                model=f"{p * LAYERS} x Linear({WIDTH},{WIDTH})+ReLU", rows_per_micro=ROWS,
                dtype="float32", schedule=name, m=m, stage=stage,
                bubble_measured=round(res["bubble"], 4), bubble_formula=round(formula, 4),
                step_ms=round(res["step_s"] * 1e3, 3),
                serial_step_ms=round(res["serial"] * 1e3, 3),
                speedup_vs_serial=round(res["serial"] / res["step_s"], 3),
                accumulated_step_ms=round(res["accumulated"] * 1e3, 3),
                blas_efficiency=round(res["products_whole"] / res["products_micro"], 4),
                stage_compute_ms=round(res["busy_s"][stage] * 1e3, 3),
                **dict(zip(("forward_ms", "backward_ms", "weight_ms"),
                           (round(t * 1e3, 3) for t in res["parts_s"][stage]))),
                bubble_replayed=round(replayed_bubble(name, p, m, res["parts_s"]), 4),
                **{k: round(v, 4) for k, v in parts.items()},
                peak_stash_bytes=res["peaks"][stage], in_flight=res["in_flight"][stage],
                predicted_stash_bytes=res["predicted"][stage],
                steps_timed=args.steps))
    path = write_csv("pp.csv" if ROWS == DEFAULT_ROWS else f"pp_rows{ROWS}.csv", rows, args.out)
    per_config = [r for r in rows if r["stage"] == 0]
    pngs = []
    if ROWS == DEFAULT_ROWS and tuple(args.ranks) == RANKS:  # the pictures of the main run
        pngs = [plot_bubble(per_config, args.out / "pp_bubble.png"),
                plot_memory(rows, args.out / "pp_memory.png", 4, 8 if 8 in micro else max(micro))]
        if TIMELINE_M in micro:  # the timelines are drawn for m = TIMELINE_M only
            pngs.append(plot_timelines(results, 4, args.out / "pp_timelines.png"))
    print(f"{'P':>2} {'schedule':<7} {'m':>3} {'bubble':>7} {'formula':>8} {'step ms':>8} "
          f"{'serial ms':>9} {'speedup':>7}  peak stash per stage (KiB)")
    for r in per_config:
        peaks = [x["peak_stash_bytes"] // 1024 for x in rows
                 if (x["ranks"], x["schedule"], x["m"]) == (r["ranks"], r["schedule"], r["m"])]
        print(f"{r['ranks']:2d} {r['schedule']:<7} {r['m']:3d} {r['bubble_measured']:7.3f} "
              f"{r['bubble_formula']:8.3f} {r['step_ms']:8.1f} {r['serial_step_ms']:9.1f} "
              f"{r['speedup_vs_serial']:7.2f}  {peaks}"
              + ("  (oversubscribed)" if r["oversubscribed"] else ""))
    worst = max((abs(r["bubble_measured"] - r["bubble_formula"]) for r in per_config
                 if r["ranks"] == 2 and r["schedule"] in ("gpipe", "1f1b")), default=None)
    if worst is not None:
        print(f"target: at P=2 gpipe/1f1b within 0.05 of (p-1)/(m+p-1): worst gap {worst:.3f}, "
              f"{'met' if worst <= 0.05 else 'NOT met'}")
    by = {(r["ranks"], r["m"], r["schedule"]): r for r in per_config}
    for (p, m, name), zb in by.items():  # the same launch, the same rounds: side by side
        if name == "zb-h1" and (p, m, "1f1b") in by:
            one = by[p, m, "1f1b"]
            print(f"zb-h1 vs 1f1b, P={p} m={m}: bubble {zb['bubble_measured']:.3f} vs "
                  f"{one['bubble_measured']:.3f} (formulas {zb['bubble_formula']:.3f} vs "
                  f"{one['bubble_formula']:.3f}; replayed with the measured F, B, W "
                  f"{zb['bubble_replayed']:.3f} vs {one['bubble_replayed']:.3f}), step "
                  f"{zb['step_ms']:.1f} vs "
                  f"{one['step_ms']:.1f} ms ({zb['step_ms'] / one['step_ms']:.2f}x)")
    print_decomposition(by)
    mismatch = [r for r in rows if r["peak_stash_bytes"] != r["predicted_stash_bytes"]]
    print(f"peak stash equals the prediction on every stage: {not mismatch}")
    wrote(path, *pngs)


if __name__ == "__main__":
    main()
