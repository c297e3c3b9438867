"""Tensor parallelism (Megatron-LM style): every large weight matrix split across the ranks.

The P ranks of a tensor-parallel group all see the same batch; each holds a slice of every
large matrix and computes its slice of the layer, and small collectives between the layers put
the partial results together. The seed's steps:

1. Split weight matrices by row or column across the ranks: a column-parallel Linear keeps
   W[:, cols_r], a row-parallel Linear keeps W[rows_r, :]; attention heads, the token table's
   rows and the output layer's vocabulary columns are dealt out the same way.
2. Each rank computes the forward pass for its part of the tensors: x W[:, cols_r] gives its
   columns of the output, its heads attend on their own, x_r W[rows_r, :] gives a partial sum.
3. The ranks shard and gather activations to pass partial results on: the operator ``f``
   (identity forward, Allreduce backward) before a column-parallel layer, ``g`` (Allreduce
   forward, identity backward) after a row-parallel one, and the vocabulary-parallel
   embedding and cross-entropy, which Allreduce partial lookups and softmax statistics.
   With ``--sequence-parallel`` (GPT) the activations between those layers are also sharded
   along the sequence (:mod:`mpipar.parts.sequence_parallel`): ``g'`` reduce-scatters the partial
   outputs by rows of the sequence, ``f'`` allgathers the rows before a column-parallel layer,
   so the LayerNorms and residual adds work on (B, T/t, C), and one Allreduce per step sums
   the LayerNorm and position gradients each rank took from its own rows.
4. The gradients are aggregated and the parameters updated: ``--update local`` (Megatron):
   each rank's shard gradient is already complete (the Allreduces of step 3 summed what it
   needs), so each rank updates its own shard and its replicated parameters, which stay equal
   because their gradients are equal on every rank. ``--update master`` (the seed, literally):
   the shard gradients are gathered to rank 0 (one Gatherv), which updates the full matrices
   with the full optimizer.
5. The updated parameters are distributed for the next batch: in master mode rank 0 scatters
   the new shards (one Scatterv) and broadcasts the replicated parameters (one Bcast); in
   local mode every rank already holds its updated shard.

How the models are split (t ranks; GPT: L blocks, b batch, s sequence, h width, V vocab):

- Block: attention's qkv column-parallel by heads (rank r owns heads r*H/t .. (r+1)*H/t - 1,
  i.e. those heads' columns in each of q, k and v), its output projection row-parallel; the
  MLP's first Linear column-parallel, the second row-parallel. LayerNorms are replicated.
- Embedding: the token table's rows split (vocabulary-parallel); position table replicated.
- Head: final LayerNorm replicated; output Linear split by vocabulary columns, its logits stay
  split and feed the vocabulary-parallel cross-entropy.
- The vocabulary is split into contiguous near-equal blocks (``comm.split_rows``), so it need
  not be divisible by t: no padding, no refusal, and exactly the serial arithmetic. Widths,
  head counts and MLP widths must be divisible by t (refused otherwise, naming what works).
- MLP (``--model mlp``): Linear layers paired column then row (fc0 column, fc1 row, fc2
  column, ...). With an odd number of Linear layers the last one (the classifier, 10 outputs)
  is left unsplit and replicated: its input is already whole after the row-parallel Allreduce,
  so every rank computes it in full and no message is needed.

Communication per rank per step (w bytes per element; each Allreduce of n bytes sends about
2(t-1)/t * n bytes per rank with a ring, Thakur et al. 2005). With t = 1 no call is made.

- GPT forward:  1 Allreduce of b*s*h (embedding) + 2 per block of b*s*h (attention's and the
  MLP's row-parallel outputs) + 3 of b*s for the cross-entropy (max, target logit, sum exp).
- GPT backward: 2 per block of b*s*h (input gradients of qkv and of the MLP's first Linear)
  + 1 of b*s*h (input gradient of the output layer).
- In all: (4L + 2) Allreduces of b*s*h*w bytes + 3 of b*s*w bytes.
- GPT with ``--sequence-parallel``: each of those (4L + 2) Allreduces becomes one
  reduce-scatter and one allgather of b*s*h*w bytes ((t-1)/t of it per rank each with a ring,
  so the same 2(t-1)/t in all), in the order embedding g', per block f' g' f' g', head f'
  forward and the mirror image backward; the cross-entropy's 3 are unchanged; plus 1
  Allreduce of (2L + 1) * 2h + s*h numbers (the LayerNorm and position gradients).
- MLP: per column/row pair, 1 Allreduce forward of b*width_out(row) and 1 backward of
  b*width_in(column), except that fc0 is fed by data and has no input gradient.
- ``--update master`` adds one Gatherv of every shard to rank 0, one Scatterv back (rank 0
  receives and sends (t-1)/t of the sharded parameter bytes) and one Bcast of the replicated
  parameters. ``--update local`` adds nothing.

References: Shoeybi et al. 2019, "Megatron-LM" (arXiv:1909.08053), section 3 (f and g,
Figures 3-4); Narayanan et al. 2021 (arXiv:2104.04473), section 2.3; vocabulary-parallel
embedding and cross-entropy as in Megatron-LM's ``tensor_parallel`` package; sequence
parallelism: Korthikanti et al. 2022 (arXiv:2205.05198), section 4.2.2.

Run::

    mpirun -n 2 python -m mpipar.tensor_parallel --model gpt
    mpirun -n 4 python -m mpipar.tensor_parallel --model mlp --update master --explain --steps 3
    mpirun -n 2 python -m mpipar.tensor_parallel --model gpt --sequence-parallel --explain --steps 1

Left out: dropout, overlapping the Allreduces with computation, uneven splits of heads and
widths.
"""

import numpy as np
from mpi4py import MPI

from mpipar import serial
from mpipar.engine import backend as B
from mpipar.engine import nn
from mpipar.engine.parameters import Piece, place, put, take
from mpipar.mpi import comm as C
from mpipar.parts import sequence_parallel as SP
from mpipar.parts.sequence_parallel import layer_name
from mpipar.runner.trainer import Trainer


# ----------------------------------------------------------------------------- index helpers
def _width(ranges):
    return sum(b - a for a, b in ranges)


# -- TP Step 1: split the weight matrices by row or column across the ranks --
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


# -- TP Step 2: each rank computes the forward pass for its part of the tensors --
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


# -- TP Step 3: the ranks shard and gather activations to pass partial results on --
def allreduce(tp_comm, a, op=MPI.SUM, what=""):
    """Allreduce ``a`` over the group, in place on a contiguous array, and return it.
    A group of one rank makes no call (the result is ``a`` itself)."""
    if tp_comm.size == 1:
        return a
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
        return allreduce(self.tp_comm, dx, what=f"f: input gradient of {layer_name(self.layer)}")


class ReduceFromTP:
    """Megatron's ``g``, after a row-parallel layer.

    forward: Allreduce (sum) of the partial outputs x_r W_r into x W.
    backward: identity (the gradient of a sum is the same for every term)."""

    def __init__(self, tp_comm, layer):
        self.tp_comm, self.layer = tp_comm, layer

    def forward(self, y):
        return allreduce(self.tp_comm, y, what=f"g: partial outputs of {layer_name(self.layer)}")

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

    def forward(self, logits, targets, normalizer=None, micro_id=0):
        z = nn._rows(logits)  # (N, V/t)
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


# ----------------------------------------------------------------------------- the scheme
class TensorParallel(Trainer):
    """One rank of the tensor-parallel group. ``__init__`` builds this rank's shards (Step 1);
    :meth:`step` runs Steps 2 to 5 on the whole batch, which every rank of the group sees."""

    def __init__(self, task, grid, args):
        from mpipar.parts.tp_models import build_tp_model, tp_loss  # made of this file's layers

        self.task, self.comm = task, grid.tp_comm
        self.model = build_tp_model(task, self.comm).init(args.seed)
        shards, replicated = split_parameters(self.model)
        place(shards, split=[self.comm])
        place(replicated, replicated=[self.comm])
        C.narrate(f"TP Step 1: rank {self.comm.rank} holds shards of {len(shards)} matrices "
                  f"({sum(p.size for p in shards):,} numbers) and {len(replicated)} replicated "
                  f"parameters ({sum(p.size for p in replicated):,} numbers)")
        self.loss_fn = tp_loss(task, self.comm)
        make_opt = lambda params: serial.make_optimizer(args, params)  # noqa: E731
        self.updater = LocalUpdate(self.model, make_opt) if args.update == "local" \
            else MasterUpdate(self.model, self.comm, make_opt)

    def step(self, step):
        x, y = self.task.to_device(*self.task.batch(step))  # the whole batch on every rank
        self.updater.zero_grad()

        # Steps 2 and 3, forward: each rank computes with its shards (the layers under Step 2
        # above); g Allreduces their partial sums, or g' reduce-scatters them (under Step 3)
        C.narrate("TP Step 2: forward: each rank computes with its own shards (columns, rows, "
                  "heads, vocabulary block); g (or g') sums the partial results (Step 3)")
        logits = self.model.forward(x)  # (B, T, V/t) or (B, 10)
        loss = self.loss_fn.forward(logits, y, normalizer=y.size)

        # Step 3, backward: f Allreduces the input gradients of the column-parallel layers (f'
        # reduce-scatters them); with --sequence-parallel the LayerNorm gradients are then summed
        C.narrate("TP Step 3, backward: f (or f') sums the input gradients of the column-parallel "
                  "layers; each shard's gradient is then complete")
        self.model.backward(self.loss_fn.backward())
        SP.allreduce_sequence_grads(self.model.parameters(), self.comm)  # --sequence-parallel

        # -- TP Step 4: aggregate the gradients and update the parameters --
        self.updater.update()

        # -- TP Step 5: distribute the updated parameters for the next batch --
        self.updater.distribute()
        return loss

    def optimizers(self):  # the master update's optimizer is on the master only
        return [] if self.updater.opt is None else [self.updater.opt]

    def full_params(self):
        return gather_full_params(self.model, self.comm)


class LocalUpdate:
    """Megatron's update: each rank steps its own optimizer on its shards and replicated
    parameters. A shard's gradient is complete (step 3's Allreduces summed everything that
    flows into it) and the optimizers are elementwise, so a shard's update is the slice of
    the full update; replicated gradients are equal on every rank, and so are their updates."""

    def __init__(self, model, make_opt):
        self.opt = make_opt(model.parameters())

    def zero_grad(self):
        self.opt.zero_grad()

    def update(self):
        C.narrate("TP Step 4: each rank updates its own shards and replicated parameters")
        self.opt.step()

    def distribute(self):
        C.narrate("TP Step 5: no message: every rank already holds its updated shard")


def gather_shards(arrays, shards, tp_comm, root=0):
    """Full arrays on ``root`` (None elsewhere) from every rank's shard arrays (data or
    gradients): one Gatherv of each rank's shards packed flat, reassembled on the root with
    every rank's known index ranges (a column shard is not a block of rows, so the flat
    buffer is unpacked parameter by parameter, not reshaped)."""
    counts = [sum(p.shard_size(r) for p in shards) for r in range(tp_comm.size)]
    is_root = tp_comm.rank == root
    flat = B.xp.empty(sum(counts), dtype=B.dtype) if is_root else None
    tp_comm.Gatherv(C.flatten(arrays), counts, flat, root=root,
                    what="every rank's shards, flat")  # (sum of all shard sizes,)
    if not is_root:
        return None
    fulls = [B.xp.empty(p.full_shape, dtype=B.dtype) for p in shards]
    off = 0
    for r in range(tp_comm.size):
        for p, full in zip(shards, fulls):
            n = p.shard_size(r)
            p.place(full, flat[off:off + n].reshape(p.shard_shape(r)), r)
            off += n
    return fulls


class MasterUpdate:
    """The seed's update: rank 0 (the master) keeps the full parameters and the full
    optimizer. Each step it gathers the shard gradients (one Gatherv; replicated gradients
    are equal everywhere, so its own serve), updates the full matrices, then (step 5)
    scatters the new shards and broadcasts the replicated parameters."""

    def __init__(self, model, tp_comm, make_opt, root=0):
        self.tp_comm, self.root = tp_comm, root
        self.params = model.parameters()
        self.shards, self.replicated = split_parameters(model)
        full = gather_full_params(model, tp_comm, root)  # {name: full array} on the master
        self.master, self.opt = None, None  # the master's full parameters, in canonical order
        if full is not None:
            self.master = [nn.Parameter(*a.shape) for a in full.values()]
            for m, (name, a) in zip(self.master, full.items()):
                m.name = name
                m.set(B.to_numpy(a))
            self.opt = make_opt(self.master)

    def zero_grad(self):
        for p in self.params:
            p.grad[...] = 0

    def update(self):
        C.narrate("TP Step 4: gather the shard gradients to the master, which updates the "
                  "full matrices")
        fulls = gather_shards([p.grad for p in self.shards], self.shards, self.tp_comm,
                              self.root)
        if self.master is not None:
            full_of = dict(zip(map(id, self.shards), fulls))
            for p, m in zip(self.params, self.master):
                m.grad[...] = full_of[id(p)] if is_sharded(p) else p.grad
            self.opt.step()  # the full matrices, with the full optimizer

    def distribute(self):
        C.narrate("TP Step 5: the master scatters the new shards and broadcasts the "
                  "replicated parameters")
        scatter_shards(self.master_fulls(self.shards), self.shards, self.tp_comm, self.root)
        bcast_replicated(self.master_fulls(self.replicated), self.replicated, self.tp_comm,
                         self.root)

    def master_fulls(self, params):
        """The master's full arrays of these parameters (None off the master)."""
        if self.master is None:
            return None
        full_of = {id(p): m.data for p, m in zip(self.params, self.master)}
        return [full_of[id(p)] for p in params]


def scatter_shards(fulls, shards, tp_comm, root=0):
    """Every rank's shards of the root's full arrays into its shard parameters: one Scatterv
    of the shards packed flat in rank order (the inverse of :func:`gather_shards`)."""
    counts = [sum(p.shard_size(r) for p in shards) for r in range(tp_comm.size)]
    flat = None
    if tp_comm.rank == root:
        flat = C.flatten([p.select(full, r) for r in range(tp_comm.size)
                          for p, full in zip(shards, fulls)])
    mine = B.xp.empty(counts[tp_comm.rank], dtype=B.dtype)
    tp_comm.Scatterv(flat, counts, mine, root=root, what="the updated shards")  # (own sizes,)
    C.unflatten(mine, [p.data for p in shards])


def bcast_replicated(fulls, replicated, tp_comm, root=0):
    """The root's values of the replicated parameters to every rank: one Bcast."""
    if not replicated:
        return
    if tp_comm.rank == root:
        flat = C.flatten(fulls)
    else:
        flat = B.xp.empty(sum(p.size for p in replicated), dtype=B.dtype)
    tp_comm.Bcast(flat, root=root, what="the updated replicated parameters")
    C.unflatten(flat, [p.data for p in replicated])


def gather_full_params(model, tp_comm, root=0):
    """{canonical name: full array} on ``root`` (None elsewhere), in the model's order, with
    the same names and shapes as the serial model's parameters."""
    shards, _ = split_parameters(model)
    fulls = gather_shards([p.data for p in shards], shards, tp_comm, root)
    if tp_comm.rank != root:
        return None
    full_of = dict(zip(map(id, shards), fulls))
    return {name: full_of[id(p)] if is_sharded(p) else p.data.copy()
            for name, p in model.named_parameters()}


if __name__ == "__main__":  # python -m mpipar.tensor_parallel
    from mpipar.runner import hand_over

    hand_over(__name__, "tensor_parallel")
