"""ZeRO stages 2 and 3: data parallelism that shards the gradients as well as the optimizer state
(stage 2), and then the parameters too (stage 3, "fully sharded", as PyTorch FSDP), so that a
rank holds 1/P of the model between steps and still trains exactly like the serial trainer.

Both are :mod:`mpipar.data_parallel` variants (``--sync allreduce --zero 2`` or ``--zero 3``);
``--zero 1`` (:class:`mpipar.data_parallel.ZeroScheme`) shards the optimizer state only. Every
sharded buffer is a :class:`FlatShard`: some parameters seen as one flat vector padded with
zeros to a multiple of P (Reduce_scatter and Allgather work on equal blocks), of which rank r
owns block r as a Parameter ``shard``: the master copy of those values, their summed gradient,
and (in the one optimizer over all the shards) their state. The updates are elementwise, so a
shard's update is exactly its slice of the serial update, and the zero padding stays zero.

ZeRO-2 (:class:`Zero2Scheme`): the data-parallel steps with Steps 4 and 5 changed.

1-3. As every replica (:class:`mpipar.data_parallel.Replica`): the Bcast, each rank's own rows,
   forward and backward. The full gradients live during the step only, as views into one padded
   flat buffer per bucket (``--bucket-mb``, reverse parameter order, as DDP's).
4. Each bucket is reduce-scattered: rank r adds the sum of block r to its shard's gradient and
   the full buffer is dropped; each rank updates its shards. Without ``--overlap`` this is MPI's
   Reduce_scatter, one call per bucket after the backward. With ``--overlap`` a bucket starts as
   soon as the backward has made its gradients final; mpipar.mpi.comm has no non-blocking
   Reduce_scatter, so :class:`PostedReduceScatter` builds one from the wrapper's Irecv and Isend.
5. The updated shards are allgathered into every replica, bucket by bucket. The parameters
   are views into one padded buffer per bucket, kept all run, whose block r is the shard's
   values (:meth:`FlatShard.keep_whole`): a rank holds 4 + (4 + 8)/P bytes per float32
   parameter with Adam, not a second copy of its block.

ZeRO-3 (:class:`Zero3Scheme`): one FlatShard per layer of ``model.layers``.

1. DP Step 1 (the replica's Bcast), then Z3 Step 1: each rank keeps only its shard of every
   layer's parameters and frees the full ones. Between steps a rank holds 1/P of the
   parameters, 1/P of the gradients and 1/P of the optimizer state (plus < P padding values per
   layer).
2. DP Step 2, unchanged: no message; each rank takes its own rows of the global batch.
3. Forward, layer by layer: Allgather the layer's parameters, run its forward, free them.
4. Backward, layer by layer in reverse: Allgather them again, run the layer's backward into a
   fresh full gradient, Reduce_scatter that gradient at once (rank r adds block r to its shard's
   gradient) and free both. Steps 3 and 4 run once per ``--micro-batches`` piece.
   With ``--overlap`` (prefetch, as FSDP's forward and backward prefetch), each layer's
   Allgather is posted before the previous layer runs (:class:`PostedAllgather`, from Isend and
   Irecv: mpipar.mpi.comm has no Iallgather), so its bytes travel while that layer computes; a rank
   then holds two layers' full parameters at once, not one.
5. Each rank updates its shards with its own 1/P of the optimizer state. Nothing is sent: the
   next forward gathers what it needs.

Bytes per rank per step, Psi = the bytes of every flat buffer, padded (Comm.stats counts a
Reduce_scatter as its whole send buffer and an Allgather as its whole result, this rank's own
block included, so each counts Psi; (P-1)/P of it crosses the wire). Rajbhandari et al. 2020,
"ZeRO", arXiv:1910.02054, section 7:

    allreduce   2 Psi (an allreduce is a reduce-scatter then an allgather)
    zero 1, 2   Reduce_scatter Psi + Allgather Psi = 2 Psi: no more than the allreduce; ZeRO-2
                in one call of each per bucket; with --overlap each bucket's reduce-scatter is
                P-1 Isend and P-1 Irecv of one block: (P-1)/P Psi sent in all, as much received
    zero 3      per layer: Allgather (forward) + Allgather (backward) + Reduce_scatter = 3 Psi,
                1.5 times the allreduce, in 3 calls per layer (and per micro-batch); with
                --overlap each Allgather is P-1 Isend and P-1 Irecv of one block

Run:

    mpirun -n 4 python -m mpipar.data_parallel --sync allreduce --zero 2 --bucket-mb 0.05 --overlap
    mpirun -n 4 python -m mpipar.data_parallel --model gpt --sync allreduce --zero 3 --explain
    mpirun -n 4 python -m mpipar.data_parallel --model gpt --sync allreduce --zero 3 --overlap

Left out on purpose: prefetching across the forward-backward boundary, a non-blocking ZeRO-3
Reduce_scatter (each layer's gradient sum still blocks before the next layer's backward; with
--overlap only the Allgathers are posted), keeping the last layer
gathered from its forward to its backward, freeing a ZeRO-2 bucket's full gradient before the
backward ends (the layers accumulate into parameter-shaped gradients, so a step's full gradients
exist together at its end), initialising each shard without the whole model (Step 1 reuses the
replica's Bcast), CPU/NVMe offload (ZeRO-Offload, ZeRO-Infinity), and ZeRO++'s
quantised and hierarchical collectives.
"""

from mpipar import serial
from mpipar.data_parallel import Replica, make_buckets
from mpipar.engine import backend as B
from mpipar.engine.parameters import FlatBlock, Placement
from mpipar.mpi import bf16, comm


# ----------------------------------------------------------------------------- communication
class FlatShard:
    """``params`` as one flat buffer of P * shard_size values (zero padding at the end), of
    which this rank owns block ``rank``: ``shard``. ZeRO-2 makes one per gradient bucket,
    ZeRO-3 one per layer."""

    def __init__(self, dp_comm, params, name, grad_sum="fp32"):
        self.comm, self.params, self.name = dp_comm, list(params), name
        self.grad_sum = grad_sum  # 16-bit gradients: summed in float32, or in bf16
        self.n = sum(p.size for p in self.params)
        self.shard_size = -(-self.n // dp_comm.size)  # ceil(n / P)
        self.starts = comm.offsets([p.size for p in self.params])
        flat = comm.flatten([p.data for p in self.params], self.padded())
        lo = dp_comm.rank * self.shard_size
        self.shard = FlatBlock(self.params, lo, self.shard_size)
        self.shard.name = f"{name}, shard {dp_comm.rank}"
        self.shard.placement = Placement(split=[dp_comm])  # each replica its own block
        self.shard.set(B.to_numpy(flat[lo:lo + self.shard_size]))  # a copy, gradient zeros
        self.flat_grad, self.request = None, None
        self.flat = None  # ZeRO-2's whole parameters (see keep_whole); ZeRO-3 frees them

    def keep_whole(self):
        """ZeRO-2: the parameters stay whole between steps, as views into one padded buffer
        kept all run, whose block r is the shard's data (one copy of each value, not two)."""
        self.flat = comm.flatten([p.data for p in self.params], self.padded())
        for p, view in zip(self.params, self._views(self.flat)):
            p.data = view
        lo = self.comm.rank * self.shard_size
        self.shard.data = self.flat[lo:lo + self.shard_size]  # (shard_size,), a view

    def padded(self):
        return B.xp.zeros(self.shard_size * self.comm.size, dtype=B.dtype)  # (P * shard_size,)

    def _views(self, flat):
        """Each parameter's piece of a flat buffer, in its shape (no copy)."""
        return [flat[s:s + p.size].reshape(p.shape) for p, s in zip(self.params, self.starts)]

    def gather_params(self, why):
        """Every rank's shard into a fresh full buffer, whose views become the parameters; or,
        kept whole (ZeRO-2), into the kept buffer, from a temporary copy of the own block (a
        send buffer may not lie inside the receive buffer)."""
        if self.flat is not None:
            self.comm.Allgather(self.shard.data.copy(), self.flat,
                                what=f"{self.name}: parameters, {why}")
            return
        flat = B.xp.empty(self.shard_size * self.comm.size, dtype=B.dtype)  # (P * shard_size,)
        self.comm.Allgather(self.shard.data, flat, what=f"{self.name}: parameters, {why}")
        for p, view in zip(self.params, self._views(flat)):
            p.data = view

    def post_gather(self, why, tag):
        """:meth:`gather_params`, posted (ZeRO-3's prefetch): the parameters are views into the
        receive buffer at once, their values valid after the request's ``wait``."""
        flat = B.xp.empty(self.shard_size * self.comm.size, dtype=B.dtype)  # (P * shard_size,)
        request = PostedAllgather(self.comm, self.shard.data, flat, tag,
                                  f"{self.name}: parameters, {why}")
        for p, view in zip(self.params, self._views(flat)):
            p.data = view
        return request

    def new_grads(self):
        """Zero full gradients as views into one padded buffer, which backward fills and the
        reduce-scatter sends as it is (DDP's ``gradient_as_bucket_view``: no copy either way)."""
        self.flat_grad = self.padded()
        for p, view in zip(self.params, self._views(self.flat_grad)):
            p.grad = view
            p.zero_grad()  # known zero: the first micro-batch writes its gradient, no temporary

    def reduce_scatter_grads(self):
        """shard.grad += block r of the sum over the ranks of the full gradient, then free it
        (16-bit: summed as :func:`mpipar.mpi.bf16.reduce_scatter` says)."""
        got = bf16.reduce_scatter(self.comm, self.flat_grad, self.grad_sum,
                                  what=f"{self.name}: gradients")  # (shard_size,)
        self.shard.grad += got
        self.free_grads()

    def free_grads(self):
        self.flat_grad = None
        for p in self.params:
            p.grad = None

    def free_params(self):
        for p in self.params:
            p.data = None


class PostedReduceScatter:
    """A non-blocking reduce-scatter of ``flat`` (P equal blocks) that adds block r of the sum
    into ``out``, from the wrapper's Irecv and Isend (mpipar.mpi.comm has no Ireduce_scatter).

    Rank r receives block r from every other rank and sends rank q its block q: P-1 messages of
    one block each way, (P-1)/P of the buffer, what any reduce-scatter must move. ``wait`` adds
    the P blocks in rank order; each block is summed on its owner only, so after the allgather
    the replicas are bitwise equal. 16-bit blocks travel as they are (2 bytes a value) and are
    added in float32, rounded once into ``out``: the float32 sum at the 16-bit bytes, since the
    owner adds every block itself. Every receive is posted before any send and all are waited
    together, so this cannot deadlock, not even with synchronous sends (MPIPAR_SSEND=1)."""

    def __init__(self, dp_comm, flat, out, tag, what):
        p, r = dp_comm.size, dp_comm.rank
        self.blocks = flat.reshape(p, -1)  # (P, shard_size): row q goes to rank q
        self.got, self.out = B.xp.empty_like(self.blocks), out  # row q: rank q's block r
        self.got[r] = self.blocks[r]  # its own block needs no message
        peers = [(r + k) % p for k in range(1, p)]  # each rank starts with another partner
        self.requests = [dp_comm.Irecv(self.got[q], q, tag, what=f"{what}, block {r} from {q}")
                         for q in peers]
        self.requests += [dp_comm.Isend(self.blocks[q], q, tag, what=f"{what}, block {q}")
                          for q in peers]

    def test(self):
        """Let MPI advance the transfers (MPICH progresses only inside MPI calls)."""
        for req in self.requests:
            req.test()

    def wait(self):
        for req in self.requests:
            req.wait()
        self.out += self.got.astype(B.compute, copy=False).sum(axis=0)  # (shard_size,)


class PostedAllgather:
    """A non-blocking allgather of ``shard`` into ``flat`` (block q from rank q), from the
    wrapper's Irecv and Isend (mpipar.mpi.comm has no Iallgather): rank r sends its shard to each
    other rank and receives theirs, P-1 messages of one block each way, (P-1)/P of the buffer.
    Every receive is posted before any send, so this cannot deadlock, not even with
    synchronous sends (MPIPAR_SSEND=1)."""

    def __init__(self, dp_comm, shard, flat, tag, what):
        p, r = dp_comm.size, dp_comm.rank
        blocks = flat.reshape(p, -1)  # (P, shard_size): row q comes from rank q
        blocks[r] = shard  # its own block needs no message
        peers = [(r + k) % p for k in range(1, p)]
        self.requests = [dp_comm.Irecv(blocks[q], q, tag, what=f"{what}, block {q}")
                         for q in peers]
        self.requests += [dp_comm.Isend(shard, q, tag, what=f"{what}, block {r}") for q in peers]

    def wait(self):
        for req in self.requests:
            req.wait()


class ShardedGradSync:
    """ZeRO-2's gradient sum, with :class:`mpipar.data_parallel.GradSync`'s protocol (``start``,
    ``grads_ready``, ``finish``), one FlatShard per bucket. With ``overlap``, ``grads_ready``
    posts each bucket's reduce-scatter once all its gradients are final, in bucket order on
    every rank. After ``finish`` each shard's gradient holds its summed block, and no rank holds
    a full gradient. The parameters are kept whole in their buckets' buffers
    (:meth:`FlatShard.keep_whole`); :meth:`new_grads` makes a step's full gradients."""

    def __init__(self, dp_comm, params, bucket_mb=None, overlap=False, grad_sum="fp32"):
        groups = make_buckets(list(params), None if bucket_mb is None else bucket_mb * 2**20)
        self.buckets = [FlatShard(dp_comm, ps, f"bucket {i + 1} of {len(groups)}", grad_sum)
                        for i, ps in enumerate(groups)]
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.overlap = overlap
        for b in self.buckets:
            b.keep_whole()
            b.free_grads()  # the full gradients exist during a step only (new_grads)
        self.start()

    def new_grads(self):
        """Before a step: zero each shard's gradient and make zero full gradients, views into
        one fresh padded buffer per bucket, which every micro-batch's backward adds to."""
        for b in self.buckets:
            b.shard.grad[...] = 0
            b.new_grads()

    def start(self):
        self.missing = [len(b.params) for b in self.buckets]  # gradients not yet final
        self.n_launched, self.n_ready = 0, 0
        self.launched_after = []  # how many gradients were final as each bucket launched

    def grads_ready(self, params):
        for p in params:
            self.missing[self.bucket_of[id(p)]] -= 1
        self.n_ready += len(params)
        while self.n_launched < len(self.buckets) and self.missing[self.n_launched] == 0:
            self._launch()
        for b in self.buckets[:self.n_launched]:
            b.request.test()

    def _launch(self):
        b = self.buckets[self.n_launched]
        self.launched_after.append(self.n_ready)
        tag = self.n_launched  # the bucket's index: a message matches its own bucket only
        b.request = PostedReduceScatter(b.comm, b.flat_grad, b.shard.grad, tag,
                                        f"{b.name}: gradients")
        self.n_launched += 1

    def finish(self):
        if not self.overlap:  # MPI's own Reduce_scatter, bucket by bucket
            for b in self.buckets:
                b.reduce_scatter_grads()
        while self.overlap and self.n_launched < len(self.buckets):
            self._launch()
        for b in self.buckets[:self.n_launched]:
            b.request.wait()
            b.request = None
            b.free_grads()
        self.launch_log = self.launched_after  # kept for the tests
        self.start()


# ----------------------------------------------------------------------------- the schemes
class Sharded(Replica):
    """What ZeRO-2 and ZeRO-3 share: ``groups``, the FlatShards of this rank, one optimizer
    over their shards, and the bytes a rank holds."""

    def keep_shards(self, groups):
        self.groups = groups
        self.opt = serial.make_optimizer(self.args, [g.shard for g in groups])
        self.flat = None  # Replica's full flat buffer served the Bcast only

    def buffers(self):
        return [g.flat_grad for g in self.groups]

    def memory(self):
        """Bytes this rank holds now, each buffer once (:mod:`mpipar.runner.memory`): parameters and
        gradients (full and sharded), optimizer state. Between ZeRO-3 steps each is 1/P of the
        serial trainer's (plus padding); ZeRO-2 holds the parameters whole."""
        from mpipar.runner import memory

        held = memory.count(memory.arrays_of(self))
        return {"param_bytes": held["params"], "grad_bytes": held["grads"],
                "optimizer_bytes": held["optimizer"]}


class Zero2Scheme(Sharded):
    """``--zero 2``: whole replicas, but each rank keeps only its shards of the gradients (one
    per bucket, reduce-scattered) and of the optimizer state, and updates only those."""

    def __init__(self, task, grid, args, model=None):
        super().__init__(task, grid, args, model)
        self.sync = ShardedGradSync(self.comm, self.params, args.bucket_mb, args.overlap,
                                    getattr(args, "grad_sum", "fp32"))
        self.keep_shards(self.sync.buckets)

    def step(self, step):
        self.sync.new_grads()

        # -- DP Step 2: no Scatterv: each rank takes its own rows of the global batch --
        x, y, normalizer = self.own_rows(step)

        # -- DP Step 3: each worker runs forward and backward on its shard --
        loss = self.forward_backward(x, y, normalizer, self.sync if self.args.overlap else None)

        # -- DP Step 4: Reduce_scatter of the gradients, bucket by bucket; each rank updates its
        # shards --
        how = "wait for the reduce-scatters posted during backward (Irecv, Isend)" \
            if self.args.overlap else "Reduce_scatter of the gradients"
        with comm.step("DP Step 4", f"{how}, {len(self.groups)} bucket(s); rank {self.rank} keeps "
                                    f"and updates its {sum(b.shard_size for b in self.groups):,} "
                                    f"values"):
            self.sync.finish()
        self.take_step(self.opt)  # the shards' update (fp16: skipped on any rank's overflow)

        # -- DP Step 5: the updated shards are allgathered into every replica, bucket by bucket --
        with comm.step("DP Step 5", f"Allgather of the updated shards, {len(self.groups)} "
                                    f"bucket(s)"):
            for b in self.groups:
                b.gather_params("updated")
        return self.global_loss(loss)


class Zero3Scheme(Sharded):
    """``--zero 3``: no rank holds the whole model. Each layer's parameters are allgathered
    just before its forward and its backward and freed just after; its gradient is
    reduce-scattered as soon as its backward has made it."""

    def __init__(self, task, grid, args, model=None):
        super().__init__(task, grid, args, model)  # DP Step 1: the replica's Bcast

        # -- Z3 Step 1: each rank keeps its shard of every layer's parameters, frees the rest --
        self.layers = [(layer, FlatShard(self.comm, layer.parameters(), name,
                                         getattr(args, "grad_sum", "fp32"))
                        if layer.parameters() else None) for name, layer in self.model.layers]
        self.keep_shards([g for _, g in self.layers if g is not None])
        kept = sum(g.shard_size for g in self.groups)
        comm.narrate(f"Z3 Step 1: rank {self.rank} keeps {kept:,} of the {self.n:,} parameters, "
                     f"its 1/{self.size} of each of {len(self.groups)} layers; frees the rest")
        for g in self.groups:
            g.free_params()
            g.free_grads()

    def parameters(self):
        return [g.shard for g in self.groups]  # between steps, the only copy of the model

    def step(self, step):
        for g in self.groups:
            g.shard.grad[...] = 0

        # -- DP Step 2: no Scatterv: each rank takes its own rows of the global batch --
        x, y, normalizer = self.own_rows(step)
        micro_rows, loss = comm.split_rows(x.shape[0], self.args.micro_batches), 0.0
        for micro_id, (lo, n) in enumerate(zip(comm.offsets(micro_rows), micro_rows)):

            # -- Z3 Step 3: forward, layer by layer: Allgather its parameters, run it, free them --
            comm.narrate(f"Z3 Step 3: forward of micro-batch {micro_id} ({n} rows), layer by "
                         f"layer: Allgather its parameters, run it, free them")
            out = x[lo:lo + n]
            for layer, _ in self.each_gathered(self.layers, "for its forward"):
                out = B.store(layer.forward(B.load(out), micro_id))  # (16 bits between layers)
            loss += self.task.loss_fn.forward(out, y[lo:lo + n], normalizer, micro_id)

            # -- Z3 Step 4: backward, layer by layer in reverse: Allgather the parameters again,
            # backward into a fresh full gradient, Reduce_scatter it at once, free both --
            comm.narrate(f"Z3 Step 4: backward of micro-batch {micro_id}, layer by layer in "
                         "reverse: Allgather, backward, Reduce_scatter the gradient, free both")
            dout = self.task.loss_fn.backward(self.loss_scale(), micro_id)
            for layer, g in self.each_gathered(self.layers[::-1], "for its backward"):
                if g is not None:
                    g.new_grads()
                dout = B.store(layer.backward(B.load(dout), micro_id))
                if g is not None:
                    g.reduce_scatter_grads()

        # -- Z3 Step 5: each rank updates its shards; nothing is sent (the next forward gathers) --
        comm.narrate(f"Z3 Step 5: rank {self.rank} updates its shards with its 1/{self.size} of "
                     "the optimizer state; nothing to send")
        self.take_step(self.opt)  # (fp16: skipped on every rank if any rank's overflowed)
        return self.global_loss(loss)

    def each_gathered(self, layers, why):
        """Each (layer, its FlatShard or None) of ``layers``, its parameters gathered while the
        caller runs it and freed after. With ``--overlap`` (prefetch), the next layer's gather
        is posted before this layer runs, so it arrives while this one computes: then two
        layers' full parameters are held at once, not one."""
        prefetch, shards = self.args.overlap, [g for _, g in layers if g is not None]
        ahead = shards[0].post_gather(why, 0) if prefetch and shards else None
        k = 0  # the layers with parameters reached so far
        for layer, g in layers:
            if g is not None and prefetch:
                ahead.wait()
                ahead = shards[k + 1].post_gather(why, k + 1) if k + 1 < len(shards) else None
            elif g is not None:
                g.gather_params(why)
            k += g is not None
            yield layer, g
            if g is not None:
                g.free_params()

    def gathered(self):
        """The whole model {canonical name: host array} on every rank, one layer at a time."""
        out = {}
        for g in self.groups:
            g.gather_params("for the report")
            out.update((p.name, B.to_numpy(p.data).copy()) for p in g.params)
            g.free_params()
        return out

    def full_params(self):
        params = self.gathered()  # every rank takes part in the Allgathers
        return params if self.rank == 0 else None
