"""What each scheme's run says at its end: the run's summary line, and each scheme's own
report (data parallelism's sync mode and bytes, the pipeline's stages, bubble, activation stash
and timeline, the hybrid's grid), built by :func:`mpipar.train.main` from ``REPORTS``.

A report is made before the first step (``Report(a, task, trainer, grid, start)``), is told of
every step (``record``), and says its lines at the end; a scheme without one of its own gets
:class:`Report`.
"""

import os
from collections import deque

from mpipar.engine import backend as B
from mpipar.mpi import comm
from mpipar.mpi.grid import Grid
from mpipar.mpi.trace import TRACE, gantt, median_bubble, median_step, step_summary
from mpipar.parts.schedules import (
    SPLIT,
    V_SHAPED,
    bubble_formula,
    holder,
    peak_in_flight,
    placement_of,
)
from mpipar.runner import checkpoint
from mpipar.runner.cli import layer_names

DRAWN = ("forward", "backward", "optimizer")  # trace kinds on the timeline; the rest is idle
WINDOW = 500  # steps whose traces the pipeline's report keeps (the last ones)


# ----------------------------------------------------------------------------- reports
class Report:
    """What the runner prints around a scheme's training: ``header()`` before it (world rank 0
    prints it), ``after_step()`` after each step, and ``lines()`` after it: (lines before the
    final-loss line, lines after it) on world rank 0. ``lines()`` is called on every rank,
    since a report may gather from them all."""

    def __init__(self, a, task, trainer, grid, start=0):
        self.a, self.task, self.trainer, self.grid, self.start = a, task, trainer, grid, start
        self.n_params = sum(p.size for p in task.build_model().parameters())
        self.desc = {"data_parallel": f"dp x{a.dp}", "tensor_parallel": f"tp x{a.tp}",
                     "expert_parallel": f"ep {a.ep} x{a.n // a.ep}",
                     "context_parallel": f"cp {a.cp} {a.cp_algo} x{a.dp}",
                     "hybrid": f"hybrid {a.dp}x{a.tp}x{a.pp}"}.get(a.scheme, a.scheme)
        self.after_step = None
        self.failed = []  # outputs that could not be written: the run ends with them, code 1

    def training(self):
        a = self.a
        return f"{a.steps} steps of {'global ' * (a.dp > 1)}batch {a.batch_size}"

    def tail(self):
        a = self.a
        if getattr(a, "precision", "fp32") == "fp32":
            return f"{a.optim} lr {a.lr}, {a.dtype}"
        return (f"{a.optim} lr {a.lr}, {a.precision} storage, float32 compute and master weights"
                + (f", loss scale from {a.loss_scale:g}" if a.precision == "fp16" else ""))

    def header(self):
        a = self.a
        experts = (f" ({a.experts} experts a block, top-{a.top_k}, aux loss coefficient "
                   f"{a.aux_loss_coef:g})" if a.model == "gpt" and a.experts else "")
        return f"{a.scheme}: {a.model} with {self.n_params:,} parameters{experts}, " \
               f"{self.training()}, {self.tail()}"

    def lines(self):
        return [], expert_lines(getattr(self.trainer, "model", None))


def scaler_lines(scaler, steps):
    """fp16's loss scale at the end, and the steps its overflows skipped."""
    if scaler is None:
        return []
    return [f"loss scale {scaler.scale:g} at the end; {scaler.skipped} of {steps} steps "
            f"skipped (a gradient overflowed)"]


def expert_lines(model):
    """The routing of the last training step, per MoE layer: tokens per expert (a token counts
    once for each of its k experts) and the load imbalance, the busiest expert's over the
    mean."""
    lines = []
    for name, layer in getattr(model, "layers", []):
        counts = getattr(getattr(layer, "mlp", None), "tokens_per_expert", None)
        if counts is not None:
            lines.append(f"{name}: tokens per expert {B.to_numpy(counts).tolist()}, max / mean "
                         f"{counts.max() / counts.mean():.2f}")
    return ["routing of the last step:"] + lines if lines else []


class DataParallelReport(Report):
    def header(self):
        a = self.a
        mode = a.sync + (f", buckets of {a.bucket_mb:g} MiB" if a.bucket_mb else "")
        mode += (", overlap" if a.overlap else "") + (f", ZeRO-{a.zero}" if a.zero else "")
        return (f"data_parallel: {a.model} with {self.n_params:,} parameters on {a.dp} ranks "
                f"(sync {mode}), {self.training()} (rows per rank "
                f"{comm.split_rows(a.batch_size, a.dp)}, {a.micro_batches} micro-batch(es)), "
                f"{self.tail()}")

    def lines(self):
        state = self.grid.dp_comm.gather_obj(self.trainer.optimizer_state_bytes())
        return [f"optimizer state bytes per rank: {state}"], []


class TensorParallelReport(Report):
    def header(self):
        a = self.a
        local = sum(p.size for p in self.trainer.model.parameters())
        return (f"tensor parallel: {a.model} with {self.n_params:,} parameters split over "
                f"{a.tp} ranks ({local:,} on rank 0), update {a.update}, {self.training()}, "
                f"{self.tail()}")


def stage_lines(a, task, trainer, where):
    """One line per pipeline stage (or piece): its layers and its share of the FLOPs."""
    names = layer_names(task)
    total = max(sum(trainer.flops), 1)
    return [f"  {where(x)}: {', '.join(names[lo:hi]):<34} {sum(trainer.flops[lo:hi]) / 1e6:8.2f} "
            f"MFLOP forward per micro-batch ({sum(trainer.flops[lo:hi]) / total:4.0%})"
            for x, (lo, hi) in enumerate(trainer.bounds)]


class PipelineReport(Report):
    def __init__(self, *args):
        super().__init__(*args)
        # the last WINDOW steps only: a long run's memory stays flat
        self.summaries, self.step_events = deque(maxlen=WINDOW), deque(maxlen=WINDOW)
        self.n_recorded = 0
        self.after_step = self.record

    def record(self):
        self.summaries.append(step_summary(TRACE.events))
        self.step_events.append([e for e in TRACE.events if e[2] in DRAWN])
        self.n_recorded += 1

    def header(self):
        a, p, v = self.a, self.a.stages, self.a.chunks
        rows = "/".join(map(str, sorted(set(self.trainer.micro_rows), reverse=True)))
        head = (f"pipeline: {a.model} with {self.n_params:,} parameters on {p} stages, "
                f"schedule {a.schedule}" + (f" with {v} chunks per stage" if v > 1 else "")
                + (f", {self.trainer.warmup} warm-up" if a.schedule == "interleaved" else "")
                + f", {a.micro_batches} micro-batches of {rows} rows, {self.training()}, "
                f"{self.tail()}")
        at = lambda x: holder(placement_of(a.schedule), p, x)  # noqa: E731
        where = (lambda x: f"stage {x} (rank {x})") if v == 1 else \
            (lambda x: f"piece {x} (rank {at(x)[0]}, chunk {at(x)[1]})")
        return "\n".join([head] + stage_lines(a, self.task, self.trainer, where))

    def lines(self):
        pp_comm = self.grid.pp_comm
        summaries = pp_comm.gather_obj(list(self.summaries))
        peaks = pp_comm.gather_obj(self.trainer.peak_stash_bytes)
        step_events = pp_comm.gather_obj(list(self.step_events))
        if pp_comm.rank != 0:
            return [], []
        a, p, v, m = self.a, self.a.stages, self.a.chunks, self.a.micro_batches
        in_flight = [peak_in_flight(self.trainer.schedule_of(s)) for s in range(p)]
        shared = f" ({p} ranks on {B.cores()} cores)" if p > B.cores() else ""
        kept = len(summaries[0])
        if not kept:  # resumed at --steps: no step ran
            return [], [f"no step ran (resumed after step {a.steps}, the last of --steps): no "
                        "trace, so no bubble measured and no timeline drawn"]
        first = a.steps - kept  # the steps before the first one kept
        skip = 1 if first == self.start and kept > 1 else 0  # the run's first step warms up
        steps = f"steps {first + skip + 1}..{a.steps}" if a.steps > first + skip + 1 else \
            f"step {a.steps}" + (", the only one" if kept == 1 else "")
        after = [f"bubble measured from the trace {median_bubble(summaries, skip):.3f} (median "
                 f"over {steps}), " + formula_text(a.schedule, p, m, v)
                 + f" = {bubble_formula(p, m, a.schedule, v):.3f}{shared}",
                 "peak activation stash per stage: " + ", ".join(
                     f"{_fmt_bytes(b)} ({k} {'chunk ' if v > 1 else ''}micro-batch"
                     f"{'es' if k > 1 else ''})" for b, k in zip(peaks, in_flight))]
        if a.timeline and a.timeline.lower() != "none":
            i = median_step(summaries, skip)
            title = (f"{a.model}, {a.schedule}, {p} stages" + (f" x {v} chunks" if v > 1 else "")
                     + f", {m} micro-batches: step {first + i + 1} of {a.steps}, the median step "
                     "by duration")
            _, problem = written("--timeline", a.timeline, lambda: checkpoint.write_atomically(
                a.timeline, lambda f: gantt([events[i] for events in step_events], f, title=title)))
            self.failed += [problem] if problem else []
            after += [] if problem else [f"timeline of step {first + i + 1} (the median by "
                                         f"duration): {os.path.abspath(a.timeline)}"]
        return [], after


class HybridReport(Report):
    def header(self):
        a, grid, trainer = self.a, self.grid, self.trainer
        buckets = trainer.update.sync and len(trainer.update.sync.buckets)
        sync = "" if a.dp == 1 else ", dp ZeRO-1 (Reduce_scatter, Allgather)" if a.zero == 1 else (
            f", dp ZeRO-2 (Reduce_scatter, Allgather) in {buckets} bucket(s)" if a.zero else
            f", dp gradient sum in {buckets} bucket(s)") + (" overlapped" if a.overlap else "")
        head = (f"hybrid: {a.model} with {self.n_params:,} parameters on {grid.world.size} "
                f"ranks = dp {a.dp} x tp {a.tp} x pp {a.pp}, schedule {a.schedule}, "
                f"{a.micro_batches} micro-batch(es) per replica{sync}; {self.training()} "
                f"(rows per replica {trainer.rows}), {self.tail()}")
        ranks = lambda s: [Grid.rank_of(d, s, t, (a.dp, a.tp, a.pp))  # noqa: E731
                           for d in range(a.dp) for t in range(a.tp)]
        names = layer_names(self.task)
        total = max(sum(trainer.flops), 1)
        if a.cp > 1:
            head += (f"\n  context: each sequence over cp groups of {a.cp} replicas "
                     f"({a.seq_len // a.cp} of its {a.seq_len} tokens a rank), {a.cp_algo} "
                     f"attention; rows per data-parallel group "
                     f"{comm.split_rows(a.batch_size, a.dp // a.cp)}")
        if a.experts:
            head += (f"\n  experts: {a.experts} a block over ep groups of {a.ep} replicas "
                     f"({a.experts // a.ep} a rank), top-{a.top_k}, aux loss coefficient "
                     f"{a.aux_loss_coef:g}, all-to-all {a.a2a}")
        return "\n".join([head] + [
            f"  stage {s} (ranks {ranks(s)}): {', '.join(names[lo:hi]):<28} "
            f"{sum(trainer.flops[lo:hi]) / total:4.0%} of the forward FLOPs"
            for s, (lo, hi) in enumerate(trainer.bounds)])

    def lines(self):
        memory = self.grid.world.gather_obj(self.trainer.memory())
        if memory is None:
            return [], []
        totals = [sum(m.values()) for m in memory]
        return [], ["bytes per rank (parameters, gradients, optimizer state, peak activations): "
                    f"max {max(totals):,}, min {min(totals):,}"]


class ExpertParallelReport(Report):
    def header(self):
        a = self.a
        return (f"expert_parallel: {a.model} with {self.n_params:,} parameters ({a.experts} "
                f"experts a block, top-{a.top_k}, aux loss coefficient {a.aux_loss_coef:g}) on "
                f"{a.n} ranks: ep groups of {a.ep} ({a.experts // a.ep} experts a rank, each "
                f"on {a.n // a.ep} rank(s)), all-to-all {a.a2a}, {self.training()} (rows per "
                f"rank {comm.split_rows(a.batch_size, a.n)}, {a.micro_batches} "
                f"micro-batch(es)), {self.tail()}")


class ContextParallelReport(Report):
    """The context-parallel run, and after it each rank's traced attention compute a step
    against the balance the layout allows."""

    def __init__(self, *args):
        super().__init__(*args)
        self.attention = deque(maxlen=WINDOW)  # seconds of attention compute, step by step
        self.after_step = lambda: self.attention.append(
            sum(t1 - t0 for t0, t1, kind, _, _ in TRACE.events if kind == "attention"))

    def lines(self):
        steps = list(self.attention)[1:] or list(self.attention)  # the first warms up
        mine = sorted(steps)[len(steps) // 2]
        times = self.grid.dp_comm.gather_obj(mine)
        if times is None:
            return [], []
        a, g = self.a, self.a.cp
        bound = {"ring": f"G/(2G-1) = {g / (2 * g - 1):.3f} for the causal work, "
                         f"(G+1)/(2G) = {(g + 1) / (2 * g):.3f} for the blocks computed here "
                         f"(a diagonal block whole)"}.get(a.cp_algo, "1: every rank the same "
                                                                    "work")
        return [], [f"attention compute per rank (traced, median of {len(steps)} step(s); "
                    f"varies): {', '.join(f'{1e3 * t:.2f}' for t in times)} ms a step; mean "
                    f"over the busiest {sum(times) / len(times) / max(max(times), 1e-12):.2f}, "
                    f"where the layout allows {bound}"]

    def header(self):
        a = self.a
        return (f"context_parallel: {a.model} with {self.n_params:,} parameters on {a.n} "
                f"ranks: cp groups of {a.cp} ({a.cp_algo} attention, "
                f"{a.seq_len // a.cp} of each sequence's {a.seq_len} tokens a rank), {a.dp} "
                f"replica(s), {self.training()} (rows per replica "
                f"{comm.split_rows(a.batch_size, a.dp)}, {a.micro_batches} micro-batch(es)), "
                f"{self.tail()}")


REPORTS = {"serial": Report, "data_parallel": DataParallelReport,
           "tensor_parallel": TensorParallelReport, "pipeline": PipelineReport,
           "hybrid": HybridReport, "expert_parallel": ExpertParallelReport,
           "context_parallel": ContextParallelReport}


def formula_text(schedule, p, m, v):
    """How the pipeline's bubble formula reads for this schedule (its value follows)."""
    if schedule in SPLIT:
        return "(p-1)/(3m+p-1)" if m >= p else "(2p-m-1)/(2m+2p-1)"
    if schedule in V_SHAPED:
        return "(p-1)/(6m+p-1)"
    return "(p-1)/p" if schedule == "naive" else \
        "(p-1)/(m+p-1)" if v == 1 else "(p-1)/(v*m+p-1)"


def _fmt_bytes(n):
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def written(flag, path, write):
    """``write()``, an atomic write of an output file: (what it returns, None), or (None, the
    line that says why it failed: a full disk), any previous file whole."""
    try:
        return write(), None
    except OSError as err:
        return None, f"{flag} {path}: cannot write it ({err.strerror or err}); nothing was saved"
