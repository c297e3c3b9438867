"""The memory ledger: the bytes each rank holds, by kind, counted from the arrays it holds.

    mpirun -n 4 python -m mpipar.data_parallel --sync allreduce --zero 3 --optim adam --memory
    mpirun -n 2 python -m mpipar.pipeline --recompute --memory --timeline none

A scheme's docstring says what a rank should hold (ZeRO-3: 1/P of everything); this module
finds what it does hold, from the arrays the trainer references, with no formula:

1. Find the arrays, by kind (:func:`arrays_of`): parameters, gradients, optimizer state,
   stashed activations (every layer's cache and the loss's) and communication buffers (the
   flat buffers a trainer keeps: gradient buckets, ZeRO's padded buffers, the Bcast buffer).
   Every trainer declares them through one interface (:mod:`mpipar.runner.trainer`: its
   parameters, optimizers, units and buffers), so the ledger never asks which trainer it
   counts. A pipeline stage's received activations are its first layer's stash: counted there.
2. Count each buffer once (:func:`count`). Arrays alias: a gradient is a view into its
   bucket's flat buffer, attention's q, k and v are views into one array, a micro-batch is a
   view into the batch. Each array is traced to the array that owns its memory (NumPy's
   ``base``) and that owner's bytes are counted once and whole (a view keeps all of it alive),
   under the first kind in :data:`KINDS` that names it.
3. Find a step's peak (:class:`Probe`): activations exist only during a step, and ZeRO-3
   gathers a layer's parameters only while the layer runs (with --overlap, also while its
   neighbour runs: the prefetch's receive buffer is the parameters' storage, counted). For
   one step the probe wraps the forward and backward (both halves, where a backward is split)
   of every top-level layer (a pipeline stage is one unit, as its schedule runs it) and of
   the loss, and counts after each call: each kind's peak, and the peak of their sum at one
   moment.
4. Gather every rank's ledger to world rank 0 (small metadata, pickled) and print one table,
   beside the cost model's prediction for the same layout (:func:`lines`).

Left out: the temporaries inside one layer's forward or backward and inside the optimizer's
update (the probe counts between calls: with --recompute, a layer's recomputed cache lives
only inside its own backward), a pipeline's received buffers not yet consumed by a forward,
MPI's internal buffers, the allocator's overhead and the Python objects.
"""

import numpy as np

from mpipar.engine import backend as B
from mpipar.mpi import comm

KINDS = ("params", "grads", "optimizer", "activations", "buffers")  # in the order they claim
HEADINGS = ("parameters", "gradients", "optimizer", "activations", "buffers")
CALLS = ("forward", "backward", "backward_input", "backward_weight")  # the probe counts after

# ----------------------------------------------------------------------------- 1. the arrays
def units_of(trainer):
    """The modules whose caches hold the activations, as the trainer calls them
    (:meth:`~mpipar.runner.trainer.Trainer.units`), and the loss."""
    loss = trainer.loss_fn
    return trainer.units() + ([loss] if loss is not None else [])


def parameters_of(trainer):
    """Every Parameter this rank references, each once: the model's as the trainer declares
    them, its optimizers' (a ZeRO shard, the master's full tensors) and its units' (ZeRO-3's
    layers, whose values exist while they run)."""
    found = {}
    for p in trainer.parameters() + [p for o in trainer.optimizers() for p in o.params] \
            + [p for unit in trainer.units() for p in unit.parameters()]:
        found.setdefault(id(p), p)
    return list(found.values())


def arrays_of(trainer):
    """{kind: the arrays of that kind this rank's trainer references now} (None: freed)."""
    params = parameters_of(trainer)
    return {"params": [p.data for p in params],
            "grads": [p.grad for p in params],
            "optimizer": [a for o in trainer.optimizers() for s in o.state.values() for a in s],
            "activations": [a for unit in units_of(trainer) for m in unit.modules()
                            for saved in m._cache.values() for a in saved],
            "buffers": trainer.buffers()}


# ----------------------------------------------------------------------------- 2. counting
def owner(a):
    """The array that owns ``a``'s memory: a view's ``base``, followed to its end."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def count(arrays):
    """{kind: bytes} of {kind: arrays}: each owner counted once, whole, under the first kind
    of KINDS that holds it or a view of it. Entries without bytes (None, a shape) are skipped."""
    seen, out = set(), {}
    for kind in KINDS:
        out[kind] = 0
        for a in arrays.get(kind, ()):
            if not hasattr(a, "nbytes"):
                continue
            base = owner(a)
            if id(base) not in seen:  # every array is alive during the count: ids are unique
                seen.add(id(base))
                out[kind] += int(base.nbytes)
    return out


# ----------------------------------------------------------------------------- 3. the peak
class Probe:
    """The ledger counted through the trainer's next step: after each call in CALLS of each
    unit of :func:`units_of` (a backward split in two, input then weight gradients, counts
    after each half) and at the step's end; then the probe takes itself away
    (later steps run untouched). ``peak``: each kind's largest count in that step;
    ``peak_sum``: the largest sum of the kinds at one moment, less the optimizer's state (which
    the first step makes in its update, after the last layer: :meth:`ledger` adds its size)."""

    def __init__(self, trainer):
        self.trainer, self.wrapped = trainer, []
        self.peak, self.peak_sum = dict.fromkeys(KINDS, 0), 0
        for unit in units_of(trainer):
            for name in CALLS:
                if hasattr(unit, name):
                    self._wrap(unit, name)
        self._wrap(trainer, "step", last=True)

    def _wrap(self, obj, name, last=False):
        inner, own = getattr(obj, name), name in vars(obj)  # own: an instance attribute already

        def call(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.sample()
            if last:
                self.remove()
            return out
        self.wrapped.append((obj, name, inner, own))
        setattr(obj, name, call)

    def remove(self):
        for obj, name, inner, own in reversed(self.wrapped):
            if own:
                setattr(obj, name, inner)
            else:
                delattr(obj, name)  # the class's method again
        self.wrapped = []

    def sample(self):
        now = count(arrays_of(self.trainer))
        self.peak = {k: max(self.peak[k], now[k]) for k in KINDS}
        self.peak_sum = max(self.peak_sum, sum(now[k] for k in KINDS if k != "optimizer"))

    def ledger(self):
        """This rank's bytes: parameters, gradients, optimizer state and buffers now (between
        steps), activations at their peak in the probed step; ``peak``: the step's largest sum
        at one moment; ``step_params``, ``step_grads``: those kinds' peaks in the step."""
        now = count(arrays_of(self.trainer))
        return dict(now, activations=self.peak["activations"],
                    peak=self.peak_sum + now["optimizer"], step_params=self.peak["params"],
                    step_grads=self.peak["grads"])


# ----------------------------------------------------------------------------- 4. the table
def where(grid):
    """A rank's place in the job: its coordinates along the grid's axes of more than one rank."""
    if grid is None:
        return "serial"
    axes = [(name, getattr(grid, f"{name}_rank"), getattr(grid, f"{name}_size"))
            for name in getattr(grid, "axes", ("dp", "tp", "pp"))]
    return " ".join(f"{name} {r}" for name, r, size in axes if size > 1) or "rank 0"


def prediction(a, task):
    """The cost model's bytes per rank for this run's layout (its largest rank), or None where
    it has no model of the run: it counts Adam's two moments, stages (and their model chunks)
    cut where the FLOPs balance, the schedule it replays, and each rank updating its own
    parameters."""
    from mpipar.tools import simulate as S

    if a.optim == "sgd" or a.partition or getattr(a, "sync", "") == "master" \
            or getattr(a, "update", "local") == "master":
        return None

    spec = S.MLPSpec(tuple(a.sizes)) if a.model == "mlp" else \
        S.GPTSpec(task.data.vocab, a.d_model, a.n_heads, a.n_layers, a.seq_len,
                  experts=a.experts, top_k=a.top_k)
    r = S.predict(spec, S.this_machine(1e9, 0.0, 0.0), a.data_groups, a.tp, a.pp, a.batch_size,
                  a.micro_batches, getattr(a, "schedule", "1f1b"), np.dtype(B.dtype).itemsize,
                  getattr(a, "zero", 0), a.recompute, ep=getattr(a, "ep", None) or 1,
                  cp=a.cp, cp_algo=a.cp_algo, n_chunks=getattr(a, "chunks", 1),
                  warmup=getattr(a, "warmup", None) or "production")
    return {k: round(r[f"mem_{k}_bytes"]) for k in KINDS[:4]}


def lines(probe, a, task, grid):
    """Every rank's ledger as a table on world rank 0 ([] elsewhere), with the cost model's
    prediction. A collective: every rank calls it."""
    rows = comm.world().gather_obj((where(grid), probe.ledger()), what="every rank's ledger")
    if rows is None:
        return []
    head = ["rank", "where"] + list(HEADINGS) + ["step peak"]
    out = ["memory per rank in bytes, counted from the arrays each rank holds (each buffer "
           "once): activations at their peak in the first step, the rest between steps; step "
           "peak: the most held at once in that step",
           f"{head[0]:>4}  {head[1]:<12}" + "".join(f"{h:>13}" for h in head[2:])]
    for rank, (place, row) in enumerate(rows):
        out.append(f"{rank:>4}  {place:<12}" + "".join(f"{row[k]:>13,}" for k in KINDS)
                   + f"{row['peak']:>13,}")
    predicted = prediction(a, task)
    out.append("cost model (mpipar/tools/simulate.py > predict), its largest rank: " + (
        ", ".join(f"{h} {predicted[k]:,}" for h, k in zip(HEADINGS, KINDS) if k in predicted)
        if predicted else "no prediction (it models Adam, the balanced partition, "
                          "its schedules and a local update)"))
    return out
