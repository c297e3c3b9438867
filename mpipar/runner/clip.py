"""Gradient clipping by the global norm, in every scheme: each parameter counted once.

    python -m mpipar.serial --model gpt --clip-grad 0.5
    mpirun -n 8 python -m mpipar.hybrid --dp 2 --tp 2 --pp 2 --clip-grad 0.5

Before each update, the gradients are scaled by max_norm / (norm + 1e-6) when the global norm
``norm = sqrt(sum over every parameter of the model of sum(g^2))`` exceeds ``max_norm`` (as
PyTorch's clip_grad_norm_). In a parallel run each rank holds part of the gradient, and the
norm must count every entry of the serial model once:

- a rank's own gradient entries are summed locally (a tensor-parallel shard, a pipeline
  stage's layers, a ZeRO shard), then the partial sums are added over the groups that split
  the model (one Allreduce of one number over ``tp_comm``, then ``pp_comm``, or ``dp_comm`` for
  ZeRO's shards);
- a tensor replicated across a group (LayerNorms and biases in tensor parallelism; the whole
  model in each data-parallel replica) is counted by ONE rank of that group, since every copy
  holds the same summed gradient.

Counting a replicated tensor on every rank is the bug production systems have shipped more
than once: the norm comes out too large, the clipping too strong, and a run still trains, just
differently. ``tests/test_clip.py`` shows that mistake failing the comparison with the serial
trainer that the right count passes.

The clipping wraps the ``step`` of the optimizer each trainer updates with (:func:`apply`),
after the gradients are summed and before the update, so the scheme files need no change.
"""

import math

import numpy as np

EPS = 1e-6  # PyTorch's: keeps the scale finite for a zero gradient


def sum_of_squares(params):
    return sum(float((p.grad * p.grad).sum()) for p in params)


def summed(value, groups):
    """``value`` added over every group in ``groups`` (one Allreduce of one number each)."""
    for g in groups:
        if g.size > 1:
            buf = np.array([value])
            g.Allreduce(buf, what="gradient norm: sum of squares")
            value = float(buf[0])
    return value


def norm_rule(trainer):
    """(optimizer, norm(params)) pairs: the optimizers to clip and how each finds the global
    norm from the rank's gradients, by the trainer's scheme."""
    kind = type(trainer).__name__
    local = lambda params: math.sqrt(sum_of_squares(params))  # noqa: E731 (whole gradients)
    if kind in ("Serial", "Pipeline", "MasterScheme", "AllreduceScheme"):
        groups = [trainer.comm] if kind == "Pipeline" else []  # stages split the model
        if trainer.opt is None:  # a data-parallel worker: the master updates
            return []
        return [(trainer.opt, lambda ps: math.sqrt(summed(sum_of_squares(ps), groups)))]
    if kind == "ZeroScheme":
        dp = trainer.comm
        return [(trainer.opt.opt, lambda ps: math.sqrt(summed(sum_of_squares(ps), [dp])))]
    if kind in ("Zero2Scheme", "Zero3Scheme"):
        dp = trainer.comm
        return [(trainer.opt, lambda ps: math.sqrt(summed(sum_of_squares(ps), [dp])))]
    if kind == "TensorParallel":
        update = trainer.updater
        if hasattr(update, "master"):  # the seed's master update: whole tensors on rank 0
            return [(update.opt, local)] if update.master is not None else []
        return [(update.opt, split_norm(trainer.comm, [trainer.comm]))]
    if kind == "Hybrid":
        g = trainer.grid
        return [(trainer.update.local.opt, split_norm(g.tp_comm, [g.tp_comm, g.pp_comm]))]
    raise TypeError(f"no gradient clipping for {kind}")


def split_norm(tp_comm, groups):
    """The norm over tensor-parallel shards (summed over the group) and replicated tensors
    (counted by the group's rank 0 only), then over the other groups that split the model."""
    def norm(params):
        shards = [p for p in params if hasattr(p, "full_shape")]
        replicated = [p for p in params if not hasattr(p, "full_shape")]
        mine = sum_of_squares(shards) + (sum_of_squares(replicated) if tp_comm.rank == 0 else 0)
        return math.sqrt(summed(mine, groups))
    return norm


def clip(params, norm, max_norm):
    """Scale the gradients so that their global norm is at most max_norm; returns the norm."""
    if norm > max_norm:
        scale = max_norm / (norm + EPS)
        for p in params:
            p.grad *= scale
    return norm


def apply(trainer, max_norm):
    """Clip before every update of the trainer's optimizers (their ``step``, in place)."""
    for opt, norm in norm_rule(trainer):
        def step(opt=opt, norm=norm, update=opt.step):
            trainer.grad_norm = clip(opt.params, norm(opt.params), max_norm)
            update()
        opt.step = step
    return trainer
