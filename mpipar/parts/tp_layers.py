"""The tensor-parallel pieces (:mod:`mpipar.tensor_parallel` runs them as its Steps 1 to 3):
how a matrix is split (:func:`blocks`, :func:`head_columns`, :class:`Shard`), the layers that
compute with their shard (column-parallel and row-parallel Linear, the vocabulary-parallel
embedding), and the messages between them: Megatron's ``f`` (:class:`CopyToTP`) and ``g``
(:class:`ReduceFromTP`), the gather of column shards (:class:`GatherFromTP`) and the
vocabulary-parallel cross-entropy. Each layer's forward and backward are the serial layer's on
its shard, so the models built of them (:mod:`mpipar.parts.tp_models`) compute exactly the
serial model.
"""

import numpy as np
from mpi4py import MPI

from mpipar.engine import backend as B
from mpipar.engine import nn
from mpipar.engine.parameters import Piece, put, take
from mpipar.mpi import comm as C
from mpipar.mpi.bf16 import bf16_sum
from mpipar.parts.sequence_parallel import layer_name


# ----------------------------------------------------------------------------- index helpers
def _width(ranges):
    return sum(b - a for a, b in ranges)


# ----------------------------------------------------------------------------- Step 1's split
def blocks(n, p):
    """Index ranges of n entries dealt into p contiguous, nearly equal blocks, in rank order:
    a list (per rank) of lists of (start, stop)."""
    counts = C.split_rows(n, p)
    return [[(s, s + c)] for s, c in zip(C.offsets(counts), counts)]


def head_columns(d_model, p):
    """qkv's columns for each rank's heads. qkv is laid out [q | k | v], each d_model wide and
    split into heads of D columns, so an even split of d_model by p (p dividing the head count)
    is a split by heads, and rank r's shard is that block in each of q, k and v."""
    own = blocks(d_model, p)
    return [[(i * d_model + a, i * d_model + b) for i in range(3) for a, b in own[r]]
            for r in range(p)]


class Shard(nn.Parameter):
    """This rank's slice of a parameter: the full parameter's entries at ``ranges[rank]``
    along ``axis``. It carries the full parameter's canonical name, and its initial value is
    the matching slice of the full initial value, so a TP model starts at the serial weights.
    ``ranges`` lists every rank's ranges, so rank 0 can reassemble or split the full tensor."""

    def __init__(self, full_shape, axis, ranges, rank, init="normal", std=0.02):
        self.full_shape, self.axis, self.ranges, self.rank = tuple(full_shape), axis, ranges, rank
        super().__init__(*self.shard_shape(rank), init=init, std=std)

    def init_value(self, seed, name):
        full = nn.Parameter(*self.full_shape, init=self.init, std=self.std).init_value(seed, name)
        return self.select(full, self.rank)

    def shard_shape(self, r):
        shape = list(self.full_shape)
        shape[self.axis] = _width(self.ranges[r])
        return tuple(shape)

    def shard_size(self, r):
        return int(np.prod(self.shard_shape(r)))

    def select(self, full, r):
        """Rank r's shard of a full array (parameter, gradient or update)."""
        return take(full, ["axis", self.axis, self.ranges[r]])

    def place(self, full, part, r):
        """Write rank r's shard into a full array."""
        put(full, ["axis", self.axis, self.ranges[r]], part)

    def pieces(self):
        return [Piece(self.name, list(self.full_shape),
                      ["axis", self.axis, [list(r) for r in self.ranges[self.rank]]], None)]


def is_sharded(p):
    """True for a parameter split over the group, False for one replicated on every rank."""
    return isinstance(p, Shard)


def split_parameters(model):
    """(sharded, replicated): the model's parameters in canonical order, in two lists."""
    params = model.parameters()
    return [p for p in params if is_sharded(p)], [p for p in params if not is_sharded(p)]


# ----------------------------------------------------------------------------- Step 2's layers
class ColumnParallelLinear(nn.Linear):
    """y[:, cols_r] = x W[:, cols_r] + b[cols_r]: W split by output columns.

    The input goes through ``f`` (identity forward, Allreduce of dx backward). The output
    stays split (..., d_out/t), ready for an elementwise op and a row-parallel layer, unless
    ``gather_output`` Allgathers it (forward) and splits its gradient (backward).
    ``ranges`` chooses each rank's columns (default: contiguous, nearly equal blocks)."""

    def __init__(self, d_in, d_out, tp_comm, bias=True, std=None, input_grad=True,
                 gather_output=False, ranges=None):
        nn.Module.__init__(self)
        self.input_grad = input_grad
        std = 1.0 / np.sqrt(d_in) if std is None else std
        ranges = blocks(d_out, tp_comm.size) if ranges is None else ranges
        self.W = Shard((d_in, d_out), 1, ranges, tp_comm.rank, std=std)  # (d_in, d_out/t)
        if bias:
            self.b = Shard((d_out,), 0, ranges, tp_comm.rank, init="zeros")  # (d_out/t,)
        self.has_bias = bias
        self.f = CopyToTP(tp_comm, self)
        self.gather = GatherFromTP(tp_comm, ranges) if gather_output else None

    def forward(self, x, micro_id=0):
        y = super().forward(self.f.forward(x), micro_id)  # (..., d_out/t)
        return self.gather.forward(y) if self.gather else y

    def backward_input(self, dout, micro_id=0):
        """B (nn.Linear's, between the split of the gather and f); W is nn.Linear's."""
        if self.gather:
            dout = self.gather.backward(dout)  # (..., d_out/t)
        dx = super().backward_input(dout, micro_id)  # this rank's part of dx, or None
        return None if dx is None else self.f.backward(dx)


class RowParallelLinear(nn.Linear):
    """y = sum_r x[:, rows_r] W[rows_r, :] + b: W split by input rows.

    The input arrives split (..., d_in/t), as a column-parallel layer leaves it. The partial
    products go through ``g`` (Allreduce forward, identity backward); the bias is replicated
    and added once, after the sum. dx = dy W[rows_r, :]^T is this rank's slice: no message."""

    def __init__(self, d_in, d_out, tp_comm, bias=True, std=None):
        nn.Module.__init__(self)
        self.input_grad = True
        std = 1.0 / np.sqrt(d_in) if std is None else std
        self.W = Shard((d_in, d_out), 0, blocks(d_in, tp_comm.size), tp_comm.rank, std=std)
        if bias:
            self.b = nn.Parameter(d_out, init="zeros")  # replicated
        self.has_bias = bias
        self.g = ReduceFromTP(tp_comm, self)

    def forward(self, x, micro_id=0):
        self.save(micro_id, x)
        y = self.g.forward(x @ self.W.data)  # (..., d_out), summed over the ranks
        if self.has_bias:
            y += self.b.data
        return y

    def backward_input(self, dout, micro_id=0):
        """B and W are nn.Linear's after ``g``'s identity: dW = x_r^T dout is (d_in/t, d_out),
        dx = dout W[rows_r, :]^T is (..., d_in/t)."""
        return super().backward_input(self.g.backward(dout), micro_id)


class VocabParallelEmbedding(nn.Embedding):
    """Token table split by rows (the vocabulary). A rank looks up the ids in its rows and
    gives zeros for the others; ``g`` (Allreduce forward, identity backward) adds the t
    partial lookups, exactly one of which is not zero, so the sum is the serial lookup."""

    def __init__(self, n, d, tp_comm, std=0.02):
        nn.Module.__init__(self)
        ranges = blocks(n, tp_comm.size)
        self.W = Shard((n, d), 0, ranges, tp_comm.rank, std=std)  # (V/t, C)
        (self.lo, self.hi), = ranges[tp_comm.rank]
        self.g = ReduceFromTP(tp_comm, self)

    def forward(self, idx, micro_id=0):
        inside = (idx >= self.lo) & (idx < self.hi)  # (B, T) ids this rank owns
        local = B.xp.where(inside, idx - self.lo, 0)
        self.save(micro_id, local, inside)
        out = self.W.data[local] * inside[..., None]  # (B, T, C), zero rows for other ids
        return self.g.forward(out)

    def backward_input(self, dout, micro_id=0):
        local, inside = self.saved(micro_id)
        self.save(micro_id, local, inside, self.g.backward(dout))  # what W needs
        return None  # token ids have no gradient

    def backward_weight(self, micro_id=0):
        local, inside, dout = self.saved(micro_id)
        B.xp.add.at(self.W.grad, local[inside], dout[inside])


# ----------------------------------------------------------------------------- Step 3's messages
def allreduce(tp_comm, a, op=MPI.SUM, what="", storage=False):
    """Allreduce ``a`` over the group, in place on a contiguous array, and return it.
    A group of one rank makes no call (the result is ``a`` itself). ``storage``: an
    activation (or its gradient), which in mixed precision crosses in the 16-bit storage type,
    summed as bf16 words (:func:`mpipar.mpi.bf16.bf16_sum`) or as fp16 (MPICH's float16), and
    comes back as float32; the loss's statistics stay float32."""
    if tp_comm.size == 1:
        return a
    if storage and B.low:
        w = B.store(B.xp.ascontiguousarray(a))  # what travels: 16 bits a value
        if w.dtype.kind == "V":
            bf16_sum(tp_comm, w, what=what)
        else:
            tp_comm.Allreduce(w, op, what=what)
        return B.load(w)
    a = a if a.flags.c_contiguous else B.xp.ascontiguousarray(a)
    tp_comm.Allreduce(a, op, what=what)
    return a


class CopyToTP:
    """Megatron's ``f``, in front of a column-parallel layer.

    forward: identity (every rank already holds the whole input).
    backward: Allreduce (sum) of the input gradient, since each rank's gradient is only the
    part that flows through its own columns."""

    def __init__(self, tp_comm, layer):
        self.tp_comm, self.layer = tp_comm, layer  # the layer it serves, to name its calls

    def forward(self, x):
        return x

    def backward(self, dx):
        return allreduce(self.tp_comm, dx, what=f"f: input gradient of {layer_name(self.layer)}",
                         storage=True)


class ReduceFromTP:
    """Megatron's ``g``, after a row-parallel layer.

    forward: Allreduce (sum) of the partial outputs x_r W_r into x W.
    backward: identity (the gradient of a sum is the same for every term)."""

    def __init__(self, tp_comm, layer):
        self.tp_comm, self.layer = tp_comm, layer

    def forward(self, y):
        return allreduce(self.tp_comm, y, what=f"g: partial outputs of {layer_name(self.layer)}",
                         storage=True)

    def backward(self, dy):
        return dy


class GatherFromTP:
    """Put the column shards of an activation back together along the last axis.

    forward: Allgather of every rank's (..., n/t) block into (..., n).
    backward: keep this rank's columns of the gradient (a split, no message)."""

    def __init__(self, tp_comm, ranges):
        if len({_width(r) for r in ranges}) != 1:
            raise ValueError("gather_output needs equal column shards on every rank")
        self.tp_comm, self.ranges = tp_comm, ranges

    def forward(self, y):
        p = self.tp_comm.size
        if p == 1:
            return y
        rows = B.xp.ascontiguousarray(y.reshape(-1, y.shape[-1]))  # (N, n/t)
        parts = B.xp.empty((p * rows.shape[0], rows.shape[1]), dtype=rows.dtype)
        self.tp_comm.Allgather(rows, parts, what="column shards of an output")  # (t*N, n/t)
        parts = parts.reshape(p, rows.shape[0], rows.shape[1])
        full = B.xp.empty((rows.shape[0], sum(b - a for a, b in self.ranges[0]) * p),
                          dtype=rows.dtype)
        for r in range(p):
            put(full, ["axis", 1, self.ranges[r]], parts[r])
        return full.reshape(y.shape[:-1] + (full.shape[1],))  # (..., n)

    def backward(self, dy):
        return take(dy, ["axis", dy.ndim - 1, self.ranges[self.tp_comm.rank]])


class VocabParallelCrossEntropy(nn.Module):
    """Softmax cross-entropy on logits split by vocabulary columns, without gathering them.

    forward: three Allreduces of one number per row: MAX of the local max logit, SUM of the
    target logit (only the rank owning the target's column has it), SUM of the local sums of
    exp; loss = log(sum exp) - target logit, divided by ``normalizer`` (the global count).
    backward: local, no message: softmax - onehot on this rank's columns.
    The interface is nn.SoftmaxCrossEntropy's, so a pipeline's last stage can use it."""

    def __init__(self, vocab, tp_comm):
        super().__init__()
        self.tp_comm, self.vocab = tp_comm, vocab
        (self.lo, self.hi), = blocks(vocab, tp_comm.size)[tp_comm.rank]

    KEEP_FULL = True  # the loss and its softmax in float32, whatever the storage type

    def forward(self, logits, targets, normalizer=None, micro_id=0):
        z = nn._rows(B.load(logits))  # (N, V/t), in float32 from 16-bit logits
        t = targets.reshape(-1)  # (N,)
        nn.check_targets(t, self.vocab)  # every rank checks the same targets
        normalizer = t.shape[0] if normalizer is None else normalizer
        zmax = allreduce(self.tp_comm, z.max(axis=1), MPI.MAX,
                         what="cross-entropy: MAX of the logits")  # (N,) the global max
        z = z - zmax[:, None]
        rows = B.xp.arange(z.shape[0])
        inside = (t >= self.lo) & (t < self.hi)  # (N,) targets in this rank's columns
        local_t = B.xp.where(inside, t - self.lo, 0)
        target = allreduce(self.tp_comm, z[rows, local_t] * inside,
                           what="cross-entropy: the target logit")  # (N,)
        sumexp = allreduce(self.tp_comm, B.xp.exp(z).sum(axis=1),
                           what="cross-entropy: SUM of exp")  # (N,)
        logsumexp = B.xp.log(sumexp)
        loss = (logsumexp - target).sum() / normalizer
        self.save(micro_id, z, local_t, inside, logsumexp, logits.shape, normalizer)
        return float(loss)

    def backward(self, dout=1.0, micro_id=0):
        z, local_t, inside, logsumexp, shape, normalizer = self.saved(micro_id)
        dz = B.xp.exp(z - logsumexp[:, None])  # (N, V/t) this rank's columns of the softmax
        rows = B.xp.arange(z.shape[0])
        dz[rows[inside], local_t[inside]] -= 1.0
        dz *= dout / normalizer
        return dz.reshape(shape)
