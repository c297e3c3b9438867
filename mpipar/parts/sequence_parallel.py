"""Sequence parallelism: tensor parallelism whose LayerNorm regions are split along the sequence.

    mpirun -n 2 python -m mpipar.tensor_parallel --model gpt --sequence-parallel
    mpirun -n 8 python -m mpipar.hybrid --dp 2 --tp 2 --pp 2 --sequence-parallel

In tensor parallelism (:mod:`mpipar.tensor_parallel`) every rank of the group holds the whole
(B, T, C) activation between the layers: the LayerNorms and the residual adds run t times over,
on t copies. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198, section 4.2.2) split those regions along the sequence instead: rank
r keeps rows r*T/t .. (r+1)*T/t - 1 of every sequence, (B, T/t, C). It is the seed's TP Step 3
taken literally: the ranks shard and gather the activations to pass the partial results on.
An Allreduce is a reduce-scatter followed by an allgather, so the same bytes move, cut in two:

- ``g'`` (:class:`ScatterToSequence`), in place of ``g`` after a row-parallel layer and after
  the vocabulary-parallel lookup: forward, a reduce-scatter along the sequence (the partial
  sums added, each rank keeping its rows); backward, an allgather of the rows' gradients.
- ``f'`` (:class:`GatherFromSequence`), in place of ``f`` before a column-parallel layer (qkv,
  the MLP's first Linear, the output layer): forward, an allgather along the sequence (the
  layer needs every position); backward, a reduce-scatter of the partial input gradients.

The GPT so assembled is in :mod:`mpipar.parts.tp_models` (``parallel_gpt(..., sequence_parallel=
True)``): embedding -> g' -> [LayerNorm on T/t rows -> f' -> attention (column ... row) -> g'
-> residual add on T/t rows] -> the same for the MLP -> ... -> final LayerNorm on T/t rows ->
f' -> the vocabulary-parallel output layer and cross-entropy, unchanged. The position table
is added to this rank's rows only.

The LayerNorms' parameters (and the position table) stay replicated, but each rank now sees
other rows, so each holds only its rows' part of their gradient: :func:`allreduce_sequence_grads`
sums those over the group once per step, before the update (and before clipping, which then
counts them once as replicated tensors again). Forgetting that sum is the classic mistake:
every matrix still trains exactly, the LayerNorms do not. A row-parallel layer's bias needs no
sum: g' gathers its output gradient before the bias gradient is taken.

Communication per rank per step (GPT: L blocks, b batch, s sequence, h width, w bytes per
element; a reduce-scatter or allgather of an n-byte activation moves (t-1)/t * n per rank with a
ring, half an Allreduce's 2(t-1)/t * n): (4L + 2) reduce-scatters and (4L + 2) allgathers of
b*s*h*w bytes, in place of tensor parallelism's (4L + 2) Allreduces, so the same volume;
the cross-entropy's 3 Allreduces of b*s*w bytes unchanged; plus one Allreduce of the LayerNorm
and position gradients, (2L + 1) * 2h + s*h numbers. What shrinks is the LayerNorm regions'
activations (their caches are (B, T/t, C)), and their compute, by t.

On one rank (tensor parallel on 1 rank, or the hybrid's ``--tp 1``) the flag is allowed and
changes nothing: no call is made. The MLP has no sequence, and a sequence length that the t
ranks do not divide is refused (mpipar/runner/cli.py's FLAG_RULES).

Left out: dropout (the model has none; its masks would be split the same way); keeping the
column-parallel layers' inputs split and gathering them again in their backward (Megatron
does, which divides their caches by t too); overlapping the allgathers with the matrix products.
"""


from mpi4py import MPI

from mpipar.engine import backend as B
from mpipar.mpi import bf16
from mpipar.mpi import comm as C

SEQ = 1  # the sequence axis of a (B, T, C) activation


def layer_name(layer):
    """A layer's canonical name (its weight's, less ".W"), to say which layer a call serves."""
    return (layer.W.name or "a layer").rsplit(".", 1)[0]


def sequence_rows(T, tp_comm):
    """(lo, hi): the positions of a T-long sequence that this rank of the group keeps."""
    if T % tp_comm.size:
        raise ValueError(f"a sequence of {T} is not divisible by {tp_comm.size} ranks")
    n = T // tp_comm.size
    return tp_comm.rank * n, (tp_comm.rank + 1) * n


def mark(*modules):
    """Flag the parameters of these replicated modules as seeing only this rank's rows: their
    gradients are summed over the group by :func:`allreduce_sequence_grads`."""
    for m in modules:
        for p in (m.parameters() if hasattr(m, "parameters") else [m]):
            p.sequence_parallel = True


def scatter_sequence(tp_comm, x, what):
    """The sum over the group of every rank's (B, T, ...) ``x``, of which this rank keeps its
    rows (B, T/t, ...): one Reduce_scatter. The comm layer splits along axis 0, so the
    sequence axis goes first for the call and back after it. In mixed precision the partial
    sums cross in the 16-bit storage type, as tensor parallelism's do (bf16 through
    :func:`mpipar.mpi.bf16.bf16_op`, fp16 as MPICH's float16), and come back as float32."""
    # -- TP Step 3: the ranks shard and gather the activations along the sequence --
    if tp_comm.size == 1:
        return x
    rows = B.store(B.xp.ascontiguousarray(B.xp.moveaxis(x, SEQ, 0)))  # (T, B, ...)
    mine = B.xp.empty((rows.shape[0] // tp_comm.size,) + rows.shape[1:], dtype=rows.dtype)
    op = bf16.bf16_op() if rows.dtype.kind == "V" else MPI.SUM  # bf16: its own sum
    tp_comm.Reduce_scatter(rows, mine, op=op, what=what)  # (T/t, B, ...)
    return B.load(B.xp.moveaxis(mine, 0, SEQ))  # (B, T/t, ...)


def gather_sequence(tp_comm, x, what):
    """Every rank's rows (B, T/t, ...) put together in rank order, (B, T, ...): one Allgather."""
    if tp_comm.size == 1:
        return x
    rows = B.store(B.xp.ascontiguousarray(B.xp.moveaxis(x, SEQ, 0)))  # (T/t, B, ...), 16 bits
    whole = B.xp.empty((rows.shape[0] * tp_comm.size,) + rows.shape[1:], dtype=rows.dtype)
    tp_comm.Allgather(rows, whole, what=what)  # (T, B, ...)
    return B.load(B.xp.moveaxis(whole, 0, SEQ))  # (B, T, ...)


class GatherFromSequence:
    """``f'``, before a column-parallel layer, in place of ``f``.

    forward: Allgather along the sequence, (B, T/t, C) -> (B, T, C): the layer needs every
    position, and each rank holds its rows only.
    backward: Reduce-scatter along the sequence, (B, T, C) -> (B, T/t, C): each rank's input
    gradient is the part through its own columns; summed over the group, each keeps its rows."""

    def __init__(self, tp_comm, layer):
        self.tp_comm, self.layer = tp_comm, layer  # the layer it serves, to name its calls

    def forward(self, x):
        return gather_sequence(self.tp_comm, x, f"f': the rows of the input of "
                                                f"{layer_name(self.layer)}")

    def backward(self, dx):
        return scatter_sequence(self.tp_comm, dx, f"f': input gradient of "
                                                  f"{layer_name(self.layer)}, by rows")


class ScatterToSequence:
    """``g'``, after a row-parallel layer (or the vocabulary-parallel lookup), in place of ``g``.

    forward: Reduce-scatter along the sequence, (B, T, C) -> (B, T/t, C): the partial outputs
    summed, each rank keeping its rows.
    backward: Allgather along the sequence, (B, T/t, C) -> (B, T, C): every position's output
    gradient, which the layer's (whole-sequence) weight and input gradients need."""

    def __init__(self, tp_comm, layer):
        self.tp_comm, self.layer = tp_comm, layer

    def forward(self, y):
        return scatter_sequence(self.tp_comm, y, f"g': partial outputs of "
                                                 f"{layer_name(self.layer)}, by rows")

    def backward(self, dy):
        return gather_sequence(self.tp_comm, dy, f"g': the rows of the output gradient of "
                                                 f"{layer_name(self.layer)}")


def allreduce_sequence_grads(params, tp_comm):
    """Sum over the group the gradients of the replicated parameters that saw only this rank's
    rows (:func:`mark`): one Allreduce of them packed flat, once per step, after the last
    backward. They are then whole and equal on every rank, as tensor parallelism's are."""
    mine = [p for p in params if getattr(p, "sequence_parallel", False)]
    if not mine or tp_comm.size == 1:
        return
    C.narrate(f"TP Step 3 (sequence parallel): Allreduce of the {len(mine)} LayerNorm and "
              "position gradients, each rank's from its own rows")
    flat, what = C.flatten([p.grad for p in mine]), "sequence parallel: LayerNorm and position " \
        "gradients"
    if flat.dtype.itemsize == 2:  # 16-bit gradients: summed in float32 (MPI has no bf16 sum)
        bf16.fp32_sum(tp_comm, flat, what=what)
    else:
        tp_comm.Allreduce(flat, what=what)
    C.unflatten(flat, [p.grad for p in mine])
