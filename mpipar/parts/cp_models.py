"""Context parallelism inside the hybrid's tensor-parallel model: the attention of each block
and the embedding made to work on this rank's tokens of every sequence, over ``grid.cp_comm``
(:mod:`mpipar.context_parallel` for the algorithms, :mod:`mpipar.hybrid` for where they run)."""

from mpipar import context_parallel as CP
from mpipar.engine import backend as B
from mpipar.parts import sequence_parallel as SP
from mpipar.parts import tp_models


class RingParallelAttention(CP.RingAttention, tp_models.ParallelCausalSelfAttention):
    """Tensor-parallel attention (this rank's H/t heads) whose core runs the ring over the
    sequence's chunks on ``cp_comm``: the two compose, the ring on the local heads."""

    def __init__(self, d_model, n_heads, tp_comm, cp_comm, algo):
        tp_models.ParallelCausalSelfAttention.__init__(self, d_model, n_heads, tp_comm)
        self.comm, self.algo = cp_comm, algo


class UlyssesParallelAttention(CP.UlyssesAttention, tp_models.ParallelCausalSelfAttention):
    """Tensor-parallel attention whose H/t heads are shared out again over ``cp_comm`` by
    Ulysses' all-to-alls: H/(t cp) heads a rank, every token of the sequence."""

    def __init__(self, d_model, n_heads, tp_comm, cp_comm):
        tp_models.ParallelCausalSelfAttention.__init__(self, d_model, n_heads, tp_comm)
        self.comm = cp_comm
        self.n_local_heads //= cp_comm.size


class ParallelContextEmbedding(CP.ContextParallelEmbedding, tp_models.ParallelGPTEmbedding):
    """The vocabulary-parallel embedding of this rank's tokens: the position vectors of the
    positions it holds (``held``)."""

    def __init__(self, vocab, d_model, seq_len, tp_comm, held):
        tp_models.ParallelGPTEmbedding.__init__(self, vocab, d_model, seq_len, tp_comm)
        self.held = held


class SequenceParallelContextEmbedding(tp_models.SequenceParallelGPTEmbedding):
    """With sequence parallelism too: the tp rank's part of this cp rank's tokens, so its
    positions are a slice of ``held``."""

    def __init__(self, vocab, d_model, seq_len, tp_comm, held):
        super().__init__(vocab, d_model, seq_len, tp_comm)
        self.held = held

    def forward(self, idx, micro_id=0):
        lo, hi = SP.sequence_rows(idx.shape[1], self.tp_comm)
        return self.tok.forward(idx, micro_id) + self.pos.data[B.asarray(self.held[lo:hi])]

    def backward_weight(self, micro_id=0):
        (dout,) = self.saved(micro_id)  # (B, n/t, C): this rank's rows of its tokens
        lo = self.tp_comm.rank * dout.shape[1]
        self.pos.grad[B.asarray(self.held[lo:lo + dout.shape[1]])] += dout.sum(axis=0)
        self.tok.backward_weight(micro_id)


def over_context(tp_model, args, grid, vocab):
    """The tensor-parallel model's attention and embedding made context parallel over
    ``grid.cp_comm`` (``--cp``, ``--cp-algo``): every block's core is the ring (or Ulysses)
    on its tp heads, and the embedding adds the positions of this cp rank's tokens."""
    held = CP.positions(grid.cp_rank, grid.cp_size, args.cp_algo, args.seq_len)
    embed = SequenceParallelContextEmbedding if args.sequence_parallel else \
        ParallelContextEmbedding
    for i, (name, layer) in enumerate(tp_model.layers):
        if name == "embed":
            tp_model.layers[i] = (name, embed(vocab, args.d_model, args.seq_len,
                                              grid.tp_comm, held))
        elif name.startswith("blocks."):
            layer.attn = UlyssesParallelAttention(args.d_model, args.n_heads, grid.tp_comm,
                                                  grid.cp_comm) \
                if args.cp_algo == "ulysses" else \
                RingParallelAttention(args.d_model, args.n_heads, grid.tp_comm, grid.cp_comm,
                                      args.cp_algo)
            if args.sequence_parallel:  # f' and g' around it, as SequenceParallelBlock's
                layer.attn.qkv.f = SP.GatherFromSequence(grid.tp_comm, layer.attn.qkv)
                layer.attn.proj.g = SP.ScatterToSequence(grid.tp_comm, layer.attn.proj)
    return held
