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
- a tensor replicated across a group that is summed over (LayerNorms and biases in tensor
  parallelism) is counted by ONE rank of that group, since every copy holds the same summed
  gradient; a group that only replicates (the data-parallel replicas, each with the whole
  summed gradient) is not summed over at all.

Both come from the parameters' placements (:class:`mpipar.engine.parameters.Placement`): the
groups they are split over and those they are replicated over. The rule
(:func:`global_norm`) never asks which trainer it runs in.

Counting a replicated tensor on every rank is the bug production systems have shipped more
than once: the norm comes out too large, the clipping too strong, and a run still trains, just
differently. ``tests/test_clip.py`` shows that mistake failing the comparison with the serial
trainer that the right count passes.

The clipping wraps the ``step`` of each optimizer the trainer updates with
(:meth:`mpipar.runner.trainer.Trainer.optimizers`, :func:`apply`), after the gradients are
summed and before the update, so the scheme files need no change.
"""

import math

import numpy as np

from mpipar.engine import backend as B

EPS = 1e-6  # PyTorch's: keeps the scale finite for a zero gradient
ORDER = ("tp", "ep", "pp", "dp", "world")  # every rank adds over its groups in this one order


def summed(value, groups):
    """``value`` added over every group in ``groups`` (one Allreduce of one number each)."""
    for g in groups:
        if g.size > 1:
            buf = np.array([value])
            g.Allreduce(buf, what="gradient norm: sum of squares")
            value = float(buf[0])
    return value


def split_groups(trainer, params):
    """The groups whose ranks hold other parts of ``params``' model, in :data:`ORDER`: those
    the placements name, and those the trainer says split its model (a pipeline stage with no
    parameters still adds its zero)."""
    groups = {g.name: g for p in params for g in p.placement.split}
    groups.update((g.name, g) for g in trainer.split_groups())
    return [groups[name] for name in ORDER if name in groups]


def global_norm(params, groups):
    """sqrt of the sum of g^2 over every entry of the serial model, from this rank's
    ``params``: each counted here unless a copy on another rank of ``groups`` counts it (a
    tensor replicated over a group that is summed over is counted by that group's rank 0)."""
    mine = sum(float((g * g).sum()) for g in (B.load(p.grad) for p in params  # float32 of 16-bit
                                               if p.placement.first_of_replicas(groups)))
    return math.sqrt(summed(mine, groups))


def clip(params, norm, max_norm):
    """Scale the gradients so that their global norm is at most max_norm; returns the norm."""
    if norm > max_norm:
        scale = max_norm / (norm + EPS)
        for p in params:
            p.grad *= scale
    return norm


def apply(trainer, max_norm):
    """Clip before every update of the trainer's optimizers (their ``step``, in place)."""
    for opt in trainer.optimizers():
        groups = split_groups(trainer, opt.params)

        def step(opt=opt, groups=groups, update=opt.step):  # the norm of the unscaled gradients
            norm = global_norm(opt.params, groups) * getattr(opt, "unscale", 1.0)  # fp16: over S
            trainer.grad_norm = clip(opt.params, norm, max_norm)
            update()
        opt.step = step
    return trainer
