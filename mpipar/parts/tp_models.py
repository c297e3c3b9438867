"""The GPT and the MLP built from the tensor-parallel layers of :mod:`mpipar.parts.tp_layers`: the
same flat nn.Sequential and canonical names as :mod:`mpipar.engine.nn`'s models, so a pipeline can
cut them into stages, and each shard starts at its slice of the serial initial weights.

How the models are split is in the docstring of :mod:`mpipar.tensor_parallel` (Step 1);
:func:`mpipar.parts.plan.tp_size_problem` says why a model cannot be split over t ranks (the runner
refuses it).
With ``--sequence-parallel`` the GPT's blocks, embedding and head swap ``f`` and ``g`` for the
sequence-splitting ``f'`` and ``g'`` of :mod:`mpipar.parts.sequence_parallel` (its docstring says
how).
"""

import numpy as np

from mpipar.engine import nn
from mpipar.parts.sequence_parallel import (
    GatherFromSequence,
    ScatterToSequence,
    mark,
    sequence_rows,
)
from mpipar.parts.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    head_columns,
)


def build_tp_model(task, tp_comm):
    """The task's model with its large matrices split over ``tp_comm``: the same flat
    nn.Sequential and canonical names as ``task.build_model()``, so a pipeline can cut it into
    stages. Uninitialised like that one: call ``.init(seed)`` (each shard then takes its slice
    of the serial initial value)."""
    a = task.args
    if task.kind == "mlp":
        return parallel_mlp(a.sizes, tp_comm)
    return parallel_gpt(task.data.vocab, a.d_model, a.n_heads, a.n_layers, a.seq_len, tp_comm,
                        getattr(a, "sequence_parallel", False))


def tp_loss(task, tp_comm):
    """The loss that goes with :func:`build_tp_model`: vocabulary-parallel cross-entropy for
    the GPT (its logits stay split), plain cross-entropy for the MLP (its classifier is
    replicated, so its logits are whole on every rank)."""
    if task.kind == "mlp":
        return nn.SoftmaxCrossEntropy()
    return VocabParallelCrossEntropy(task.data.vocab, tp_comm)


class ParallelCausalSelfAttention(nn.CausalSelfAttention):
    """Attention with each rank owning n_heads/t heads: qkv column-parallel by heads (``f``
    in front), the attention core unchanged on the local heads, the output projection
    row-parallel (``g`` after). Forward and backward are the serial ones."""

    def __init__(self, d_model, n_heads, tp_comm):
        nn.Module.__init__(self)
        self.n_local_heads = n_heads // tp_comm.size  # this rank's heads, H/t
        self.head_dim = d_model // n_heads  # D, as in the whole layer
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, tp_comm, std=0.02,
                                        ranges=head_columns(d_model, tp_comm.size))
        self.proj = RowParallelLinear(d_model, d_model, tp_comm, std=0.02)


class ParallelFeedForward(nn.FeedForward):
    """The transformer's MLP: column-parallel Linear(C, 4C), GELU on the local columns (it is
    elementwise, so no message), row-parallel Linear(4C, C)."""

    def __init__(self, d_model, tp_comm, d_hidden=None):
        nn.Module.__init__(self)
        d_hidden = 4 * d_model if d_hidden is None else d_hidden
        self.fc = ColumnParallelLinear(d_model, d_hidden, tp_comm, std=0.02)
        self.act = nn.GELU()
        self.proj = RowParallelLinear(d_hidden, d_model, tp_comm, std=0.02)


class ParallelBlock(nn.Block):
    """The pre-LayerNorm block with parallel attention and MLP. LayerNorms are replicated:
    their inputs and (after ``f``'s Allreduce) their output gradients are equal on every rank,
    so their parameter gradients are too. 2 Allreduces forward, 2 backward, of (B, T, C)."""

    def __init__(self, d_model, n_heads, tp_comm):
        nn.Module.__init__(self)
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = ParallelCausalSelfAttention(d_model, n_heads, tp_comm)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = ParallelFeedForward(d_model, tp_comm)


class ParallelGPTEmbedding(nn.GPTEmbedding):
    """Vocabulary-parallel token embedding plus the replicated position embedding."""

    def __init__(self, vocab, d_model, seq_len, tp_comm):
        nn.Module.__init__(self)
        self.tok = VocabParallelEmbedding(vocab, d_model, tp_comm)
        self.pos = nn.Parameter(seq_len, d_model, std=0.02)


class ParallelGPTHead(nn.GPTHead):
    """Replicated final LayerNorm, then the output layer split by vocabulary columns: the
    logits stay split (B, T, V/t) for :class:`VocabParallelCrossEntropy`."""

    def __init__(self, d_model, vocab, tp_comm):
        nn.Module.__init__(self)
        self.ln = nn.LayerNorm(d_model)
        self.out = ColumnParallelLinear(d_model, vocab, tp_comm, std=0.02)


class SequenceParallelBlock(ParallelBlock):
    """The block with its LayerNorm regions split along the sequence (Korthikanti et al. 2022,
    Sec. 4.2.2): f' (Allgather) in place of f before qkv and the MLP's first Linear, g'
    (Reduce-scatter) in place of g after both projections, so the residual stream and the
    LayerNorms hold (B, T/t, C). The LayerNorms see this rank's rows only: their gradients are
    summed over the group once per step. 4 calls forward and 4 backward, of (B, T, C)."""

    def __init__(self, d_model, n_heads, tp_comm):
        super().__init__(d_model, n_heads, tp_comm)
        for column, row in ((self.attn.qkv, self.attn.proj), (self.mlp.fc, self.mlp.proj)):
            column.f = GatherFromSequence(tp_comm, column)
            row.g = ScatterToSequence(tp_comm, row)
        mark(self.ln1, self.ln2)


class SequenceParallelGPTEmbedding(ParallelGPTEmbedding):
    """The partial lookups reduce-scattered along the sequence (g'), and the position table's
    rows of this rank added: ids (B, T) -> (B, T/t, C). The position table sees this rank's
    rows only, so its gradient is summed over the group like a LayerNorm's."""

    def __init__(self, vocab, d_model, seq_len, tp_comm):
        super().__init__(vocab, d_model, seq_len, tp_comm)
        self.tok.g = ScatterToSequence(tp_comm, self.tok)
        self.tp_comm = tp_comm
        mark(self.pos)

    def forward(self, idx, micro_id=0):
        lo, hi = sequence_rows(idx.shape[1], self.tp_comm)
        return self.tok.forward(idx, micro_id) + self.pos.data[lo:hi]  # (B, T/t, C)

    def backward_weight(self, micro_id=0):
        (dout,) = self.saved(micro_id)  # (B, T/t, C): this rank's rows
        lo = self.tp_comm.rank * dout.shape[1]
        self.pos.grad[lo:lo + dout.shape[1]] += dout.sum(axis=0)
        self.tok.backward_weight(micro_id)


class SequenceParallelGPTHead(ParallelGPTHead):
    """The final LayerNorm on this rank's rows (B, T/t, C), then f' gathers the sequence for
    the vocabulary-parallel output layer: its logits (B, T, V/t) are tensor parallelism's."""

    def __init__(self, d_model, vocab, tp_comm):
        super().__init__(d_model, vocab, tp_comm)
        self.out.f = GatherFromSequence(tp_comm, self.out)
        mark(self.ln)


def parallel_gpt(vocab, d_model, n_heads, n_layers, seq_len, tp_comm, sequence_parallel=False):
    """nn.GPT split over tp_comm: embed, blocks.0 .. blocks.{L-1}, head; with
    ``sequence_parallel`` the LayerNorm regions are also split along the sequence."""
    embed, block, head = (SequenceParallelGPTEmbedding, SequenceParallelBlock,
                          SequenceParallelGPTHead) if sequence_parallel else \
        (ParallelGPTEmbedding, ParallelBlock, ParallelGPTHead)
    layers = [("embed", embed(vocab, d_model, seq_len, tp_comm))]
    layers += [(f"blocks.{i}", block(d_model, n_heads, tp_comm)) for i in range(n_layers)]
    layers.append(("head", head(d_model, vocab, tp_comm)))
    return nn.Sequential(layers)


def parallel_mlp(sizes, tp_comm):
    """nn.MLP split over tp_comm: fc0 column-parallel, fc1 row-parallel, fc2 column, ... with
    ReLU between (elementwise, so it runs on the column shards). An odd last Linear (the
    classifier) stays whole and replicated: its input is whole after the row-parallel
    Allreduce, so it needs no message, and the class count need not be divisible by t."""
    n = len(sizes) - 1
    layers = []
    for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        std = np.sqrt(2.0 / d_in)
        if i % 2 == 0 and i + 1 < n:
            fc = ColumnParallelLinear(d_in, d_out, tp_comm, std=std, input_grad=i > 0)
        elif i % 2 == 1:
            fc = RowParallelLinear(d_in, d_out, tp_comm, std=std)
        else:
            fc = nn.Linear(d_in, d_out, std=std, input_grad=i > 0)  # unpaired: replicated
        layers.append((f"fc{i}", fc))
        if i < n - 1:
            layers.append((f"act{i}", nn.ReLU()))
    return nn.Sequential(layers)
