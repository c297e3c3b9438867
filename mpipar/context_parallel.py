"""Context parallelism: every sequence split along its tokens over the ranks of a group;
attention, the one layer that mixes tokens, reaches the other ranks' keys and values.

The model is the serial GPT. P ranks, in groups of G = ``--cp`` consecutive ranks (the job's
P/G groups are data-parallel replicas, each taking its own rows of the global batch). Every
rank of a group holds the same rows, and of each sequence of T tokens only its own: the
embedding, the LayerNorms, the feed-forwards, the head and the loss are per token, so they run
on those tokens alone. Attention is ``--cp-algo``:

- ``ring``: rank r holds the r-th of G contiguous chunks of T/G tokens. The keys and values
  travel around the ring; each rank merges the partial attention of each block into its
  queries' output with the online softmax (Liu et al. 2023, arXiv:2310.01889). Causal
  attention needs no block from a later chunk, so rank r computes r + 1 of the G blocks: the
  last rank works G times as long as the first.
- ``zigzag``: the same ring, with the sequence cut into 2G chunks and rank r holding chunks r
  and 2G-1-r: every rank then computes the same number of chunk pairs at every step of the
  ring (Brandon et al. 2023, "Striped attention", for the balance).
- ``ulysses``: an all-to-all turns the rank's tokens of every head into every token of H/G
  heads; each rank runs plain causal attention on its heads; a second all-to-all turns the
  outputs back (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509). H must divide
  by G.

The steps, one banner each at its calls:

1. The groups are carved from the world (Split): cp groups of G consecutive ranks. Every rank
   builds the whole model from (seed, name), the serial model's numbers, with no message; its
   attention layers reach the other ranks of its cp group, its embedding adds the position
   vectors of its own tokens.
2. Each rank takes its replica's rows of the global batch and its pieces of each sequence
   (tokens and targets): one contiguous chunk, or the zigzag's two.
3. Forward, loss and backward on the rank's tokens, micro-batch by micro-batch; the loss is
   divided by the global batch's token count, so that the ranks' losses add up to the serial
   one (Steps 4 to 6 run inside the attention layers' forward and backward).
4. Ring attention, forward: G steps; at step j a rank holds the keys and values of the rank j
   places before it, posts the exchange that brings the next block (Isend, Irecv) and, while
   it travels, attends its queries' chunks to this block's chunks: a chunk pair with the key
   chunk later is skipped, the same chunk is masked causally, an earlier one is attended in
   full. Each pair's output and log-sum-exp are merged into the running ones.
5. Ring attention, backward: the same G steps. The probabilities are recomputed from the
   saved log-sum-exp; dQ stays on its rank; the keys and values travel the ring again (G-1
   times) and their gradients dK, dV travel with them, gathering every rank's contribution,
   one step further (G times), so that they end on the rank that owns those keys.
6. Ulysses attention: an Alltoall of q, k, v (sequence shards to head shards), the serial
   attention core on the rank's H/G heads, an Alltoall of the output back; the backward runs
   the two in reverse.
7. The gradients are summed over every rank (Allreduce: the cp ranks hold other tokens, the
   replicas other rows) and every rank updates. The parameters' placements say so.

Bytes per rank per attention layer and micro-batch, forward (C: the width, n = T/G tokens a
rank, b rows, w bytes a value): ring and zigzag send K and V G-1 times, 2 b n C w each time;
the backward sends them G-1 times and dK, dV G times. Ulysses sends 3 b n C w (G-1)/G for q,
k, v and b n C w (G-1)/G for the output, forward, and the same backward: the formulas of
lessons/formulas.md, which the tests count.

Each rank's attention compute is traced (spans of kind "attention"): the run ends with each
rank's time a step and their mean over the busiest, which the causal work bounds by G/(2G-1)
for the ring and 1 for the zigzag and Ulysses (lessons/formulas.md#context-parallelism).

Run::

    mpirun -n 4 python -m mpipar.context_parallel --cp-algo ring
    mpirun -n 4 python -m mpipar.context_parallel --cp-algo zigzag --explain --steps 1
    mpirun -n 4 python -m mpipar.context_parallel --cp-algo ulysses --cp 2
"""

import math

import numpy as np
from mpi4py import MPI

from mpipar import serial
from mpipar.data_parallel import GradSync
from mpipar.engine import backend as B
from mpipar.engine import nn, precision
from mpipar.engine.parameters import place
from mpipar.mpi import comm
from mpipar.mpi.grid import Grid
from mpipar.mpi.trace import TRACE
from mpipar.runner.trainer import Trainer

ALGOS = ("ring", "zigzag", "ulysses")


# ----------------------------------------------------------------------------- the layout
def chunks_of(rank, size, algo):
    """The chunk indices rank ``rank`` of ``size`` holds, in order, and the number of chunks
    the sequence is cut into: one of G, or (zigzag) chunks r and 2G-1-r of 2G."""
    if algo == "zigzag":
        return [rank, 2 * size - 1 - rank], 2 * size
    return [rank], size


def positions(rank, size, algo, seq_len):
    """The token positions rank ``rank`` holds, in the order it holds them."""
    held, n_chunks = chunks_of(rank, size, algo)
    c = seq_len // n_chunks
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in held])


class ContextParallelEmbedding(nn.GPTEmbedding):
    """The embedding of this rank's tokens: their ids plus the position vectors of the
    positions they hold (:func:`positions`); the backward adds into those rows only."""

    def __init__(self, vocab, d_model, seq_len, held):
        super().__init__(vocab, d_model, seq_len)
        self.held = held  # (n,) token positions

    def forward(self, idx, micro_id=0):
        return self.tok.forward(idx, micro_id) + self.pos.data[B.asarray(self.held)]

    def backward_weight(self, micro_id=0):
        (dout,) = self.saved(micro_id)
        self.pos.grad[B.asarray(self.held)] += dout.sum(axis=0)  # (n, C): positions unique
        self.tok.backward_weight(micro_id)


# ----------------------------------------------------------------------------- the blocks
def scores(q, k, causal):
    """q k^T / sqrt(D) of a query chunk (B, H, c, D) and a key chunk (B, H, c', D); with
    ``causal`` (the same chunk) -inf where a key comes after its query."""
    s = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(q.shape[-1])  # (B, H, c, c')
    if causal:
        s = s + B.asarray(np.triu(np.full(s.shape[-2:], -np.inf), k=1), dtype=s.dtype)
    return s


def block_attention(q, k, v, causal):
    """One (query chunk, key chunk) pair: the softmax of the chunk's :func:`scores` over this
    key chunk alone, applied to v, (B, H, c, D), and each query's log-sum-exp of those scores,
    (B, H, c, 1). The maximum is taken before the exponential, so no logit overflows."""
    s = scores(q, k, causal)
    m = s.max(axis=-1, keepdims=True)  # (B, H, c, 1): finite, every row sees its diagonal
    p = B.xp.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    return (p @ v) / total, m + B.xp.log(total)  # (B, H, c, D), (B, H, c, 1)


def merge(out, lse, block_out, block_lse):
    """Two partial attentions of the same queries over disjoint keys, as one: the softmax
    over their union is each one's weighted by exp(its lse - the union's lse). The union's
    lse is computed from the larger of the two, so neither exponential can overflow; a lse of
    -inf (nothing merged yet) gets the weight 0."""
    top = B.xp.maximum(lse, block_lse)
    new = top + B.xp.log(B.xp.exp(lse - top) + B.xp.exp(block_lse - top))
    return B.xp.exp(lse - new) * out + B.xp.exp(block_lse - new) * block_out, new


def pairs(mine, theirs):
    """The (query chunk, key chunk) pairs to compute, as (i, j, causal) over the local chunk
    positions i of ``mine`` and j of ``theirs`` (global chunk indices): a later key chunk is
    skipped."""
    return [(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


class RingAttention(nn.CausalSelfAttention):
    """Causal self-attention over a sequence whose chunks lie on the ranks of ``cp_comm``
    (Steps 4 and 5): ring order with the contiguous layout, or the zigzag's."""

    def __init__(self, d_model, n_heads, cp_comm, algo):
        super().__init__(d_model, n_heads)
        self.comm, self.algo = cp_comm, algo

    merge = staticmethod(merge)  # the online softmax's merge (a hook for the tests)

    def split(self, t):
        """(B, H, n, D) -> this rank's chunks, each (B, H, n / chunks, D)."""
        held, _ = chunks_of(self.comm.rank, self.comm.size, self.algo)
        return B.xp.split(t, len(held), axis=2)

    def attend(self, qkv, micro_id):
        Bn, n, _ = qkv.shape
        H, D = self.n_local_heads, self.head_dim
        C = H * D
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(Bn, n, H, D).transpose(0, 2, 1, 3)
                   for i in range(3))  # each (B, H, n, D): this rank's tokens
        g, r = self.comm.size, self.comm.rank
        mine, _ = chunks_of(r, g, self.algo)
        qs = self.split(q)
        out = [B.xp.zeros_like(c) for c in qs]
        lse = [B.xp.full(c.shape[:-1] + (1,), -np.inf, dtype=c.dtype) for c in qs]
        kv = B.store(B.xp.ascontiguousarray(B.xp.stack([k, v])))  # (2, B, H, n, D): what
        # travels, in the storage type (16 bits in mixed precision), read as float32 below

        # -- CP Step 4: the keys and values around the ring; each block merged as it comes --
        comm.narrate(f"CP Step 4: ring forward: K and V around {g} ranks, the next block in "
                     f"flight while this one is attended")
        for j in range(g):
            source = (r - j) % g  # whose keys this rank holds at step j
            if j < g - 1:
                nxt = B.xp.empty_like(kv)
                reqs = [self.comm.Irecv(nxt, (r - 1) % g, what=f"K, V of rank "
                                        f"{(source - 1) % g}"),
                        self.comm.Isend(kv, (r + 1) % g, what=f"K, V of rank {source}")]
            theirs, _ = chunks_of(source, g, self.algo)
            ks, vs = (B.xp.split(t, len(theirs), axis=2) for t in B.load(kv))
            with TRACE.span("attention", "ring forward", source=source):
                for i, jj, causal in pairs(mine, theirs):
                    o, s = block_attention(qs[i], ks[jj], vs[jj], causal)
                    out[i], lse[i] = self.merge(out[i], lse[i], o, s)
            if j < g - 1:
                for req in reqs:
                    req.wait()
                kv = nxt
        y = B.xp.concatenate(out, axis=2)  # (B, H, n, D)
        self.save(micro_id, q, k, v, y, B.xp.concatenate(lse, axis=2))
        return y.transpose(0, 2, 1, 3).reshape(Bn, n, C)

    def attend_backward(self, dy, micro_id):
        q, k, v, y, lse = self.saved(micro_id)
        Bn, H, n, D = q.shape
        g, r = self.comm.size, self.comm.rank
        mine, _ = chunks_of(r, g, self.algo)
        dy = dy.reshape(Bn, n, H, D).transpose(0, 2, 1, 3)  # (B, H, n, D)
        rowdot = (dy * y).sum(axis=-1, keepdims=True)  # sum_j p_j dp_j, per query
        qs, dys, lses, dots = (self.split(t) for t in (q, dy, lse, rowdot))
        dq = [B.xp.zeros_like(c) for c in qs]
        kv = B.store(B.xp.ascontiguousarray(B.xp.stack([k, v])))  # as the forward sent them
        dkv = B.xp.zeros(kv.shape, dtype=q.dtype)  # the gradient of the keys held, gathering
        scale = 1.0 / math.sqrt(D)

        # -- CP Step 5: K, V around the ring again; dK, dV with them, home one step later --
        comm.narrate(f"CP Step 5: ring backward: K and V around {g} ranks, dK and dV with "
                     f"them and back to their owners")
        for j in range(g):
            source = (r - j) % g
            theirs, _ = chunks_of(source, g, self.algo)
            if j < g - 1:  # the next keys in flight while this block's gradients are made
                nxt = B.xp.empty_like(kv)
                reqs = [self.comm.Irecv(nxt, (r - 1) % g, what=f"K, V of rank "
                                        f"{(source - 1) % g}"),
                        self.comm.Isend(kv, (r + 1) % g, what=f"K, V of rank {source}")]
            ks, vs = (B.xp.split(t, len(theirs), axis=2) for t in B.load(kv))
            dks, dvs = (B.xp.split(t, len(theirs), axis=2) for t in dkv)  # views: += lands
            with TRACE.span("attention", "ring backward", source=source):
                for i, jj, causal in pairs(mine, theirs):
                    p = B.xp.exp(scores(qs[i], ks[jj], causal) - lses[i])  # the final weights
                    dvs[jj] += p.transpose(0, 1, 3, 2) @ dys[i]
                    ds = p * (dys[i] @ vs[jj].transpose(0, 1, 3, 2) - dots[i]) * scale
                    dq[i] += ds @ ks[jj]
                    dks[jj] += ds.transpose(0, 1, 3, 2) @ qs[i]
            if j < g - 1:
                for req in reqs:
                    req.wait()
                kv = nxt
            dkv = self.pass_on(dkv, source)
        parts = [B.xp.concatenate(dq, axis=2), dkv[0], dkv[1]]  # after G moves: our own
        return B.xp.concatenate([t.transpose(0, 2, 1, 3).reshape(Bn, n, H * D)
                                 for t in parts], axis=-1)  # (B, n, 3C)


    def pass_on(self, dkv, source):
        """Rank ``source``'s dK, dV (what this rank has added to them) on to the next rank;
        the previous rank's in, for the next block. After G moves they are home. They travel in
        the storage type (16 bits in mixed precision: each hop rounds the running sum)."""
        g, r = self.comm.size, self.comm.rank
        if g == 1:
            return dkv
        dkv = B.store(dkv)
        home = B.xp.empty_like(dkv)
        self.comm.Sendrecv(dkv, (r + 1) % g, home, (r - 1) % g, what=f"dK, dV of rank {source}")
        return B.load(home)


class UlyssesAttention(nn.CausalSelfAttention):
    """Causal self-attention with the sequence split over ``cp_comm`` (Step 6): all-to-alls
    turn the rank's tokens of every head into every token of H/G heads and back."""

    def __init__(self, d_model, n_heads, cp_comm):
        super().__init__(d_model, n_heads)
        self.comm, self.n_heads = cp_comm, n_heads
        self.n_local_heads = n_heads // cp_comm.size  # the heads the core runs here

    def to_heads(self, t, parts, what):
        """(B, n, parts*G*w) of this rank's tokens, ``parts`` blocks (q | k | v, or one) of
        G head shards each -> (B, T, parts*w) of every token, this rank's head shard."""
        Bn, n, width = t.shape
        g = self.comm.size
        w = width // (parts * g)
        send = t.reshape(Bn, n, parts, g, w).transpose(3, 0, 1, 2, 4)  # (G, B, n, parts, w)
        send = B.store(B.xp.ascontiguousarray(send))  # in the storage type: 16 bits in mixed
        got = B.xp.empty_like(send)  # got[s]: rank s's tokens, this rank's heads   precision
        self.comm.Alltoall(send, got, what=what)
        return B.load(got).transpose(1, 0, 2, 3, 4).reshape(Bn, g * n, parts * w)

    def to_tokens(self, t, parts, what):
        """The inverse of :meth:`to_heads`: (B, T, parts*w) -> (B, n, parts*G*w)."""
        Bn, T, width = t.shape
        g = self.comm.size
        n, w = T // g, width // parts
        send = B.store(B.xp.ascontiguousarray(t.reshape(Bn, g, n, parts, w).transpose(
            1, 0, 2, 3, 4)))  # (16 bits in mixed precision, as to_heads)
        got = B.xp.empty_like(send)  # got[s]: this rank's tokens, rank s's heads
        self.comm.Alltoall(send, got, what=what)
        return B.load(got).transpose(1, 2, 3, 0, 4).reshape(Bn, n, parts * g * w)

    def attend(self, qkv, micro_id):
        # -- CP Step 6: sequence shards to head shards, attention on H/G heads, and back --
        with comm.step("CP Step 6", f"Ulysses: Alltoall of q, k, v to {self.n_local_heads} "
                                    f"head(s) a rank, every token"):
            mine = self.to_heads(qkv, 3, "q, k, v: tokens to heads")
        with TRACE.span("attention", "Ulysses forward"):
            y = super().attend(mine, micro_id)  # (B, T, C/G): the serial core, these heads
        with comm.step("CP Step 6", "Ulysses: Alltoall of the output back to its tokens"):
            return self.to_tokens(y, 1, "output: heads to tokens")

    def attend_backward(self, dy, micro_id):
        # -- CP Step 6: the backward, the two all-to-alls in reverse --
        with comm.step("CP Step 6", "Ulysses backward: Alltoall of d output to the heads"):
            d = self.to_heads(dy, 1, "d output: tokens to heads")
        with TRACE.span("attention", "Ulysses backward"):
            d = super().attend_backward(d, micro_id)  # (B, T, 3C/G)
        with comm.step("CP Step 6", "Ulysses backward: Alltoall of dq, dk, dv to the tokens"):
            return self.to_tokens(d, 3, "dq, dk, dv: heads to tokens")


# ----------------------------------------------------------------------------- the scheme
def make_grid(cp, mpi_comm=None):
    """Step 1's groups: every rank a replica of the whole model (``dp_comm``, all ranks), in a
    cp group of ``cp`` consecutive ranks (``cp_comm``) that holds the same rows, and a
    data-parallel index (``data_rank`` of ``data_size``). The runner calls it."""
    grid = Grid(dp=(MPI.COMM_WORLD if mpi_comm is None else mpi_comm).Get_size(),
                mpi_comm=mpi_comm)
    grid.split_context(cp)
    grid.axes = ("cp", "data")  # a rank's place, for the memory ledger
    return grid


class ContextParallel(Trainer):
    """Steps 1 to 7 on this rank: the whole model, its tokens, the attention exchanges."""

    def __init__(self, task, grid, args):
        self.args, self.task, self.loss_fn = args, task, task.loss_fn
        self.world, self.cp = grid.dp_comm, grid.cp_comm
        # -- CP Step 1: the groups (make_grid); the model, its attention over the cp group --
        self.model = task.build_model()
        self.held = positions(self.cp.rank, self.cp.size, args.cp_algo, args.seq_len)
        for name, layer in self.model.layers:
            if name == "embed":
                self.model.layers[0] = (name, ContextParallelEmbedding(
                    task.data.vocab, args.d_model, args.seq_len, self.held))
            elif name.startswith("blocks."):
                layer.attn = UlyssesAttention(args.d_model, args.n_heads, self.cp) \
                    if args.cp_algo == "ulysses" else \
                    RingAttention(args.d_model, args.n_heads, self.cp, args.cp_algo)
        self.model.init(args.seed)
        place(self.model.parameters(), replicated=[self.world, self.cp])  # on every rank
        held, n_chunks = chunks_of(self.cp.rank, self.cp.size, args.cp_algo)
        comm.narrate(f"CP Step 1: rank {self.world.rank} is rank {self.cp.rank} of a cp group "
                     f"of {self.cp.size}: chunk(s) {held} of {n_chunks} of every sequence, "
                     f"{len(self.held)} of its {args.seq_len} tokens")
        self.opt = serial.make_optimizer(args, self.model.parameters())
        self.sync = GradSync(self.world, self.model.parameters(), grad_sum=args.grad_sum)
        self.scaler = precision.scaler_for(args)  # fp16's loss scale, or None
        self.rows = comm.split_rows(args.batch_size, grid.data_size)  # rows per replica
        self.data_rank = grid.data_rank

    def own_tokens(self, step):
        """This rank's rows of the global batch, its tokens of each (Step 2), as micro-batches
        of (x, y), and the target count of the GLOBAL batch."""
        d, n_rows = self.data_rank, self.rows[self.data_rank]
        lo = sum(self.rows[:d])
        x_host, y_host = self.task.batch(step)
        x, y = (t[lo:lo + n_rows][:, self.held] for t in (x_host, y_host))
        x, y = self.task.to_device(np.ascontiguousarray(x), np.ascontiguousarray(y))
        micro = comm.split_rows(n_rows, self.args.micro_batches)
        comm.narrate(f"CP Step 2: rank {self.world.rank} takes rows {lo}..{lo + n_rows - 1} "
                     f"and {len(self.held)} of their {self.args.seq_len} tokens, in "
                     f"{len(micro)} micro-batch(es)")
        return [(x[a:a + n], y[a:a + n]) for a, n in zip(comm.offsets(micro), micro)], y_host.size

    def step(self, step):
        self.model.zero_grad()
        # -- CP Step 2: this rank's rows and its pieces of each sequence --
        micro, normalizer = self.own_tokens(step)
        loss = 0.0
        for micro_id, (x, y) in enumerate(micro):
            # -- CP Step 3: forward, loss and backward on this rank's tokens (global count) --
            comm.narrate(f"CP Step 3: micro-batch {micro_id}: forward, loss and backward of "
                         f"{x.size} tokens, the loss over the batch's {normalizer}")
            logits = self.model.forward(x, micro_id)
            loss += self.loss_fn.forward(logits, y, normalizer, micro_id)
            dlogits = self.loss_fn.backward(precision.scale_of(self.scaler), micro_id)
            self.model.backward(dlogits, micro_id)

        # -- CP Step 7: the gradients summed over every rank; every rank updates --
        with comm.step("CP Step 7", f"Allreduce of the gradients over {self.world.size} "
                                    f"ranks (cp groups of {self.cp.size}); every rank "
                                    f"updates"):
            self.sync.finish()
        precision.take_step(self.opt, self.scaler, lambda bad: comm.any_rank(
            self.world, bad, "did any rank's gradients overflow?"))  # (fp16: all skip, or none)
        return sum(self.world.allgather_obj(loss, what="the ranks' losses, to print"))

    def full_params(self):
        """The whole model on world rank 0: every rank holds all of it."""
        if self.world.rank != 0:
            return None
        return {n: B.to_numpy(p.data).copy() for n, p in self.model.named_parameters()}

    def buffers(self):
        return [b.flat for b in self.sync.buckets]


if __name__ == "__main__":  # python -m mpipar.context_parallel
    from mpipar.runner import hand_over

    hand_over(__name__, "context_parallel")
