"""Activation recomputation: keep only a module's input per micro-batch, and run its forward
again during the backward.

    python -m mpipar.serial --model gpt --recompute
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

What is wrapped (:func:`apply`): each layer of the serial and the tensor-parallel model (the
GPT's embedding, blocks and head; the MLP's layers), and each pipeline stage (or model chunk)
as a whole, in the pipeline and the hybrid. A tensor-parallel layer's recomputed forward makes
its Allreduces again (as Megatron's does): one more ``g`` per block and micro-batch.

Left out: selective recomputation (only attention's softmax part, Korthikanti et al. 2022)
and keeping a layer's output from its recomputation to its backward across stages.
"""

from mpipar import nn


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


def wrap_layers(model):
    """Every layer of an nn.Sequential recomputed on its own."""
    model.layers = [(name, Recomputed(layer)) for name, layer in model.layers]
    return model


def apply(trainer):
    """Turn recomputation on in a trainer (before its first step)."""
    kind = type(trainer).__name__
    if kind in ("Serial", "TensorParallel"):
        wrap_layers(trainer.model)
    elif kind in ("Pipeline", "Hybrid"):
        chunks = trainer.module if isinstance(trainer.module, list) else None
        trainer.module = [Recomputed(c) for c in chunks] if chunks else Recomputed(trainer.module)
    else:
        raise TypeError(f"no recomputation for {kind}")
    return trainer
