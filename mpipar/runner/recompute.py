"""Activation recomputation: keep only a module's input per micro-batch, and run its forward
again during the backward.

    python -m mpipar.serial --model gpt --recompute
    python -m mpipar.serial --model gpt --recompute selective   # attention's softmax only
    mpirun -n 4 python -m mpipar.pipeline --recompute          # a stage keeps its inputs only

A layer's backward needs what its forward computed (the input of a matrix product, the
softmax of attention, a mask); held for every micro-batch in flight, these are most of a
pipeline stage's memory. :class:`Recomputed` wraps a module: its forward runs the module and
then drops everything the module cached, keeping the input alone; its backward runs the
forward once more from that input (the same arithmetic, so the same bits) and then the
module's backward. Memory falls to one input per wrapped module and micro-batch; the price is
one more forward per step, about a third more compute (Chen et al. 2016, "Training deep nets
with sublinear memory cost", arXiv:1604.06174; Megatron-LM's full recomputation, Korthikanti
et al. 2022, arXiv:2205.05198, section 5).

What is wrapped (:func:`apply`): each unit the trainer runs in turn
(:meth:`mpipar.runner.trainer.Trainer.units`): each layer of the serial and the
tensor-parallel model (the GPT's embedding, blocks and head; the MLP's layers), and each
pipeline stage (or model chunk) as a whole, in the pipeline and the hybrid. A tensor-parallel
layer's recomputed forward makes its Allreduces again (as Megatron's does): one more ``g`` per
block and micro-batch.

``--recompute selective`` (:func:`selective`, Korthikanti et al. 2022, section 5) recomputes
only the attention core: the scores q k^T, the causal mask, the softmax and the product with
v. Each attention keeps its core's input (q, k and v, one (B, T, 3C) array, which it held
anyway) instead of that and the (B, H, T, T) softmax, and runs the core again at the start of
its backward; every other layer keeps its stash. The softmax is what grows with the square of
the sequence, and the core is a small part of the FLOPs (4 B T^2 C of a block's
24 B T C^2 + 4 B T^2 C forward), so memory falls by H T^2 values per row and block for little
compute. It works in every scheme that takes --recompute, the split backward (B, W) included.

In mixed precision (``--precision``) the wrapped module's input is kept in the 16-bit type
it arrived in (exactly, so the recomputation is bit for bit), and the selective core's input
in float32, as the core first used it (16 bits would round q, k and v and change the result).

Left out: keeping a layer's output from its recomputation to its backward across stages, and
selecting more than attention's core (the GELU's 4C-wide input is as cheap to remake; like
Megatron, selective recomputation here keeps it).
"""

from mpipar.engine import nn


class Recomputed(nn.Module):
    """``inner``, holding only its input between forward and backward. Its parameters keep
    their canonical names (the wrapper adds no level to them)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def named_parameters(self, prefix=""):
        return self.inner.named_parameters(prefix)

    def forward(self, x, micro_id=0):
        y = self.inner.forward(x, micro_id)
        for m in self.inner.modules():  # drop what the forward cached for this micro-batch
            m._cache.pop(micro_id, None)
        self.save(micro_id, x)
        return y

    def backward(self, dout, micro_id=0):
        (x,) = self.saved(micro_id)
        self.inner.forward(x, micro_id)  # the same forward again: the caches come back
        return self.inner.backward(dout, micro_id)


class SelectiveCore:
    """Mixed into an attention module (:func:`selective`): its core keeps only its input, and
    its backward runs the core again first."""

    def attend(self, qkv, micro_id):
        y = super().attend(qkv, micro_id)
        self.saved(micro_id)  # drop q, k, v (views into qkv) and the softmax p
        self._cache[micro_id] = (qkv,)  # (B, T, 3C), as computed: in mixed precision float32,
        # not rounded to 16 bits as save() would, so that the core's second run is the first's
        return y

    def attend_backward(self, dy, micro_id):
        (qkv,) = self.saved(micro_id)
        super().attend(qkv, micro_id)  # the same arithmetic: q, k, v and p come back, bit for bit
        return super().attend_backward(dy, micro_id)


SELECTIVE = {}  # attention class -> its selective subclass


def selective(modules):
    """Every attention in ``modules`` (and below) recomputes its core in backward."""
    for module in modules:
        for m in module.modules():
            cls = type(m)
            if isinstance(m, nn.CausalSelfAttention) and not isinstance(m, SelectiveCore):
                if cls not in SELECTIVE:
                    SELECTIVE[cls] = type(f"Selective{cls.__name__}", (SelectiveCore, cls), {})
                m.__class__ = SELECTIVE[cls]


def apply(trainer, how="full"):
    """Turn recomputation on in a trainer (before its first step): ``how`` "full" (each of its
    units, :meth:`~mpipar.runner.trainer.Trainer.units`: a layer, a stage, a model chunk) or
    "selective" (attention's core, in every unit)."""
    if how == "selective":
        selective(trainer.units())
    else:
        trainer.wrap_units(Recomputed)
    return trainer
