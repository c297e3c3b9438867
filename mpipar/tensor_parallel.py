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

:class:`TensorParallel` runs the five steps, each under its banner; the layers and messages
of Steps 1 to 3 are :mod:`mpipar.parts.tp_layers` (``f`` is ``CopyToTP``, ``g`` is
``ReduceFromTP``), and the models built of them :mod:`mpipar.parts.tp_models`.

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


from mpipar import serial
from mpipar.engine import backend as B
from mpipar.engine import nn, precision
from mpipar.engine.parameters import place
from mpipar.mpi import comm as C
from mpipar.parts import sequence_parallel as SP
from mpipar.parts.tp_layers import is_sharded, split_parameters
from mpipar.parts.tp_models import build_tp_model, tp_loss
from mpipar.runner.trainer import Trainer


# ----------------------------------------------------------------------------- the scheme
class TensorParallel(Trainer):
    """One rank of the tensor-parallel group. ``__init__`` builds this rank's shards (Step 1);
    :meth:`step` runs Steps 2 to 5 on the whole batch, which every rank of the group sees."""

    def __init__(self, task, grid, args):
        self.task, self.comm = task, grid.tp_comm
        self.sequence_parallel = args.sequence_parallel

        # -- TP Step 1: split the weight matrices by row or column across the ranks --
        self.model = build_tp_model(task, self.comm).init(args.seed)  # its shards, its slices
        shards, replicated = split_parameters(self.model)
        place(shards, split=[self.comm])
        place(replicated, replicated=[self.comm])
        C.narrate(f"TP Step 1: rank {self.comm.rank} holds shards of {len(shards)} matrices "
                  f"({sum(p.size for p in shards):,} numbers) and {len(replicated)} replicated "
                  f"parameters ({sum(p.size for p in replicated):,} numbers)")
        self.loss_fn = tp_loss(task, self.comm)
        make_opt = lambda params: serial.make_optimizer(args, params)  # noqa: E731
        self.updater = LocalUpdate(self.model, make_opt, self.comm) if args.update == "local" \
            else MasterUpdate(self.model, self.comm, make_opt)
        self.scaler = precision.scaler_for(args)  # fp16's loss scale, or None

    def step(self, step):
        x, y = self.task.to_device(*self.task.batch(step))  # the whole batch on every rank
        self.updater.zero_grad()

        # -- TP Step 2: each rank computes the forward pass for its part of the tensors --
        sp = self.sequence_parallel  # f' and g' in place of f and g
        C.narrate("TP Step 2: forward: each rank computes with its own shards (columns, rows, "
                  "heads, vocabulary block); the partial results are summed by "
                  + ("g' (a reduce-scatter along the sequence)" if sp else "g (an Allreduce)")
                  + ", TP Step 3's messages")
        logits = self.model.forward(x)  # (B, T, V/t) or (B, 10); g inside: Step 3 forward
        loss = self.loss_fn.forward(logits, y, normalizer=y.size)

        # -- TP Step 3: the ranks shard and gather activations to pass partial results on --
        # forward: g Allreduced the row-parallel partial outputs (g' reduce-scattered them);
        # backward: f Allreduces the column-parallel input gradients (f' reduce-scatters them)
        C.narrate("TP Step 3, backward: " + ("f' (a reduce-scatter)" if sp else "f (an Allreduce)")
                  + " sums the input gradients of the column-parallel layers; each shard's "
                  "gradient is then complete")
        self.model.backward(self.loss_fn.backward(precision.scale_of(self.scaler)))
        SP.allreduce_sequence_grads(self.model.parameters(), self.comm)  # --sequence-parallel

        # -- TP Step 4: aggregate the gradients and update the parameters --
        self.updater.update(self.scaler)

        # -- TP Step 5: distribute the updated parameters for the next batch --
        self.updater.distribute()
        return loss

    def optimizers(self):  # the master update's optimizer is on the master only
        return [] if self.updater.opt is None else [self.updater.opt]

    def full_params(self):
        C.narrate("after training: every rank's shards to rank 0 (one Gatherv), only to "
                  "evaluate or save the whole model; no step needs it")
        return gather_full_params(self.model, self.comm)


class LocalUpdate:
    """Megatron's update: each rank steps its own optimizer on its shards and replicated
    parameters. A shard's gradient is complete (step 3's Allreduces summed everything that
    flows into it) and the optimizers are elementwise, so a shard's update is the slice of
    the full update; replicated gradients are equal on every rank, and so are their updates."""

    def __init__(self, model, make_opt, tp_comm=None):
        self.opt, self.tp_comm = make_opt(model.parameters()), tp_comm

    def zero_grad(self):
        self.opt.zero_grad()

    def update(self, scaler=None):
        """The step; with fp16's loss ``scaler``, taken only if no rank's shards overflowed:
        the ranks hold other gradients, so the verdict is one Allreduce MAX over the group."""
        C.narrate("TP Step 4: each rank updates its own shards and replicated parameters")
        precision.take_step(self.opt, scaler, lambda bad: C.any_rank(
            self.tp_comm, bad, "did any rank's gradients overflow?"))

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

    def update(self, scaler=None):  # (16 bits: the local update only)
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
