"""Data parallelism: P replicas of the whole model, each trained on a shard of the global batch,
with the gradients summed over the replicas so that every step equals the serial one.

The seed's scheme (:class:`MasterScheme`, ``--sync master``, the default), one banner per step:

1. The master (rank 0) builds the model and sends every parameter to every worker with Bcast.
   The workers build a model too (they need its shapes), but the Bcast overwrites its values.
2. The master holds the global batch of B rows and splits it along the batch dimension with
   Scatterv: rank r gets ``split_rows(B, P)[r]`` rows (uneven when P does not divide B).
3. Each worker runs forward and backward on its shard. The loss is the SUM over the local rows
   divided by the number of targets in the GLOBAL batch, so the workers' gradients add up to
   the serial gradient with no further scaling (also over ``--micro-batches m``).
4. The master collects the gradients with Reduce(SUM) and updates the parameters.
5. The master broadcasts the updated parameters for the next batch.

In steps 4 and 5 all gradients (all parameters) travel as ONE contiguous flat buffer: one
Reduce and one Bcast of |theta| values per step instead of one call per tensor.

The production variants, each its own class below (the flag that picks it in brackets), each
giving the same parameters as the serial trainer:

- :class:`AllreduceScheme` (``--sync allreduce``): step 2 without Scatterv (every rank makes
  the global batch from (seed, step) and takes its own rows), step 4 an Allreduce of the
  gradients after which every rank updates its own replica with the same numbers; step 5 is
  not needed.
- ``--sync ring``: the same with :func:`ring_allreduce`, written by hand from Sendrecv:
  reduce-scatter around the ring, then allgather (Patarasuk & Yuan 2009; Horovod).
- ``--bucket-mb X``: gradients grouped into buckets of about X MiB in reverse parameter order,
  one allreduce per bucket; ``--overlap`` starts each bucket's non-blocking Iallreduce as soon as
  the backward has produced its last gradient, and waits once before the optimizer step
  (PyTorch DDP, Li et al. 2020, arXiv:2006.15704, section 3.2.3). The backward then runs layer
  by layer over ``model.layers`` (:func:`backward_layers`) to see which buckets are complete.
- :class:`ZeroScheme` (``--zero 1``): ZeRO stage 1 (Rajbhandari et al. 2020,
  arXiv:1910.02054, section 5.1): the gradients are reduce-scattered, each rank updates only
  its 1/P shard of the flat parameters (optimizer state per rank falls by P), then the
  parameters are allgathered (in step 5).
- ``--micro-batches m``: each rank splits its shard into m micro-batches and accumulates their
  gradients before the synchronisation (with ``--overlap``, buckets start during the last one).
- ``--explain``: for the first step, every rank prints each seed step and each MPI call it
  makes: partners, bytes, time, and the bucket or ring phase it belongs to.

Communication per rank per step, n = |theta| bytes (alpha-beta(-gamma) costs, Thakur et al. 2005;
:func:`mpipar.tools.bench.net.predict` computes them):

    master     worker: sends n (Reduce), receives n (Bcast) and its rows (Scatterv);
               root: receives (P-1) n and sends (P-1) n  -- the root is the bottleneck.
               MPI's trees give about 2 lg P (alpha + n beta) + lg P n gamma.
    allreduce  n each way in one Allreduce: 2(P-1) alpha + 2(P-1)/P n beta + (P-1)/P n gamma.
    ring       exactly 2(P-1) messages and 2(P-1)/P n bytes sent (when P divides the element
               count; otherwise within two elements of it, see ring_allreduce).
    buckets    the same bytes in k calls: k times the latency term.
    zero 1     reduce-scatter + allgather: 2(P-1)/P n, as the ring (plus < P elements padding).

Run:

    mpirun -n 4 python -m mpipar.data_parallel --model mlp
    mpirun -n 4 python -m mpipar.data_parallel --model gpt --sync ring --explain --steps 2
    mpirun -n 4 python -m mpipar.data_parallel --sync allreduce --bucket-mb 0.05 --overlap
    mpirun -n 4 python -m mpipar.data_parallel --sync allreduce --zero 1 --optim adam

ZeRO stages 2 and 3 (sharded gradients, then parameters too) are :mod:`mpipar.zero`'s.

Left out on purpose: gradient compression, bucketed ZeRO-1, an overlapped
ring (the hand-written ring is blocking: overlapping it needs a communication thread), and
asynchronous (stale) updates.
"""

import math

import numpy as np

from mpipar import serial
from mpipar.engine import backend as B
from mpipar.engine import precision
from mpipar.engine.parameters import FlatBlock, Placement, place
from mpipar.mpi import bf16, comm
from mpipar.mpi.comm import flatten, unflatten
from mpipar.mpi.trace import TRACE
from mpipar.runner.trainer import Trainer


# ----------------------------------------------------------------------------- communication
def bcast_params(dp_comm, params, flat, root=0):
    """Every rank's parameters become root's: one Bcast of the flat buffer of all of them."""
    if dp_comm.rank == root:
        flatten([p.data for p in params], flat)
    dp_comm.Bcast(flat, root=root, what=f"all {len(params)} parameters, flat")
    unflatten(flat, [p.data for p in params])


def ring_allreduce(dp_comm, buf, what="buffer"):
    """In place: ``buf`` (1-D, contiguous) becomes the SUM of every rank's ``buf``.

    The buffer is cut into P chunks (``array_split``: sizes differ by at most one element).
    Reduce-scatter: at step k, rank r sends chunk (r - k) to its right neighbour and adds the
    chunk (r - k - 1) that arrives from its left one; after P-1 steps rank r holds the full sum
    of chunk (r + 1). Allgather: at step k, rank r forwards chunk (r + 1 - k) and stores chunk
    (r - k). Each finished chunk is summed on one rank only and copied verbatim, so the replicas
    are bitwise identical.

    Rank r sends 2(P-1) messages holding every chunk but (r+1) and (r+2): 2n - c[r+1] - c[r+2]
    elements, which is exactly 2(P-1)/P * n when P divides n and otherwise differs from it by
    less than two elements.
    """
    p, r = dp_comm.size, dp_comm.rank
    if p == 1:
        return buf
    chunks = B.xp.array_split(buf, p)  # contiguous views into buf
    right, left = (r + 1) % p, (r - 1) % p
    incoming = B.xp.empty(chunks[0].size, dtype=buf.dtype)
    for k in range(p - 1):  # reduce-scatter
        send, mine = chunks[(r - k) % p], chunks[(r - k - 1) % p]
        got = incoming[:mine.size]
        dp_comm.Sendrecv(send, right, got, left,
                         what=f"{what}: ring reduce-scatter step {k + 1}, chunk {(r - k) % p} "
                              f"out, {(r - k - 1) % p} in")
        mine += got
    for k in range(p - 1):  # allgather
        dp_comm.Sendrecv(chunks[(r + 1 - k) % p], right, chunks[(r - k) % p], left,
                         what=f"{what}: ring allgather step {k + 1}, chunk {(r + 1 - k) % p} "
                              f"out, {(r - k) % p} in")
    return buf


def make_buckets(params, bucket_bytes=None):
    """Group parameters in REVERSE order (the order backward finishes them) into buckets that
    close once they hold at least ``bucket_bytes``; None puts everything in one bucket."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.data.nbytes
        if bucket_bytes is not None and size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class Bucket:
    """Some parameters' gradients and the contiguous buffer they travel in.

    Each ``p.grad`` becomes a view into the bucket's flat buffer (PyTorch DDP's
    ``gradient_as_bucket_view``): backward accumulates straight into the buffer that is
    allreduced, and the sums land where the optimizer reads them, with no copy either way."""

    def __init__(self, params, name):
        self.params, self.name = params, name
        self.flat = flatten([p.grad for p in params])  # keep what the gradients hold now
        for p, start in zip(params, comm.offsets([p.size for p in params])):
            p.grad = self.flat[start:start + p.size].reshape(p.grad.shape)  # a contiguous view
        self.request = None


def _progress(requests):
    """Let MPI advance posted requests. MPICH moves a non-blocking collective forward only
    inside MPI calls (no progress thread), so without this an Iallreduce posted during
    backward would mostly run in the final wait."""
    for req in requests:
        if req is not None:
            req.test()


class GradSync:
    """Sum the gradients of ``params`` over ``dp_comm`` (the reusable core of steps 3-4).

    ``algo`` "allreduce" (MPI's Allreduce) or "ring" (:func:`ring_allreduce`);
    ``bucket_mb`` None: one bucket; ``overlap``: call :meth:`start` before the backward that
    completes the gradients and :meth:`grads_ready` as it finishes each layer's parameters;
    buckets are then launched (Iallreduce) as they fill, in bucket order on every rank.
    :meth:`finish` launches what is left and waits: the sums are then in ``p.grad`` (a view
    into its bucket).

    16-bit gradients (``--precision``): MPI has no bf16 sum, so ``grad_sum`` "fp32" (the
    default) widens each bucket to float32, sums that (twice the bytes) and rounds the sum
    back once; "bf16" sums the 2-byte words with :func:`mpipar.mpi.bf16.bf16_sum`, every
    partial sum rounded (half the bytes).
    """

    def __init__(self, dp_comm, params, algo="allreduce", bucket_mb=None, overlap=False,
                 grad_sum="fp32"):
        if algo not in ("allreduce", "ring"):
            raise ValueError(f"unknown algorithm {algo!r}: allreduce or ring")
        if overlap and algo != "allreduce":
            raise ValueError("overlap needs the non-blocking Iallreduce (algo='allreduce')")
        self.comm, self.algo, self.overlap, self.grad_sum = dp_comm, algo, overlap, grad_sum
        cap = None if bucket_mb is None else bucket_mb * 2**20
        groups = make_buckets(list(params), cap)
        self.buckets = [Bucket(ps, f"gradient bucket {i + 1} of {len(groups)}")
                        for i, ps in enumerate(groups)]
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.start()

    def start(self):
        self.missing = [len(b.params) for b in self.buckets]  # gradients not yet final
        self.n_launched = 0
        self.n_ready = 0
        self.launched_after = []  # how many gradients were final as each bucket launched

    def grads_ready(self, params):
        for p in params:
            self.missing[self.bucket_of[id(p)]] -= 1
        self.n_ready += len(params)
        if self.overlap:
            while self.n_launched < len(self.buckets) and self.missing[self.n_launched] == 0:
                self._launch()
            _progress(b.request for b in self.buckets)

    def _launch(self):
        b = self.buckets[self.n_launched]
        self.n_launched += 1
        self.launched_after.append(self.n_ready)
        flat = b.flat
        if flat.dtype.itemsize == 2 and self.grad_sum == "bf16":  # 2-byte words, rounded sums
            bf16.bf16_sum(self.comm, flat, what=b.name)
            return
        if flat.dtype.itemsize == 2:  # widened, summed in float32, rounded back at the end
            b.wide = flat = flat.astype(np.float32)
        if self.algo == "allreduce":
            b.request = self.comm.Iallreduce(flat, what=b.name)
        else:
            ring_allreduce(self.comm, flat, what=b.name)

    def finish(self):
        while self.n_launched < len(self.buckets):
            self._launch()
        for b in self.buckets:
            if b.request is not None:
                b.request.wait()
                b.request = None
            if getattr(b, "wide", None) is not None:  # the float32 sum, once into 16 bits
                b.flat[...] = b.wide
                b.wide = None
        self.launch_log = self.launched_after  # kept for the tests
        self.start()  # ready for the next step


def backward_layers(model, dout, micro_id, grads_ready):
    """``model.backward`` of an nn.Sequential, one layer at a time, telling ``grads_ready``
    which parameters are final after each layer (what DDP's autograd hooks do)."""
    for _, layer in reversed(model.layers):  # passing 16 bits on, as nn.Sequential does
        dout = B.store(layer.backward(B.load(dout), micro_id))
        grads_ready(layer.parameters())
    return dout


class ZeroOptimizer:
    """ZeRO stage 1 around any elementwise optimizer (the reusable core of steps 4-5).

    The parameters and their gradients become views into two flat buffers padded to a multiple
    of P (Reduce_scatter and Allgather work on equal blocks); rank r owns block r, a Parameter
    ``shard`` whose data and gradient are views of block r of those buffers (no second copy)
    and whose optimizer state (Adam's m and v) is 1/P of the full state. Updates are
    elementwise, so a shard's update is exactly its slice of the full update. A rank holds
    4 + 4 + 8/P bytes per float32 parameter with Adam (plus the padding, < P values).
    """

    def __init__(self, dp_comm, params, make_opt, grad_sum="fp32"):
        """The bookkeeping: ``flat`` and ``flat_grad``, P * ``shard_size`` values each (the
        padding zero), hold every parameter's data and gradient end to end, and each ``p.data``
        and ``p.grad`` becomes a view into them; ``shard`` is this rank's block, a
        :class:`FlatBlock` split over the replicas (``Placement([dp_comm])``) and
        named ``zero1.shard<rank>``; ``opt`` is ``make_opt([shard])``."""
        self.comm, self.params, self.grad_sum = dp_comm, list(params), grad_sum
        self.n = sum(p.size for p in self.params)
        self.shard_size = s = -(-self.n // dp_comm.size)  # ceil(n / P)
        self.flat = flatten([p.data for p in self.params],
                            B.xp.zeros(s * dp_comm.size, dtype=self.params[0].data.dtype))
        self.flat_grad = B.xp.zeros_like(self.flat)  # (P * shard_size,), padding stays zero
        for p, start in zip(self.params, comm.offsets([p.size for p in self.params])):
            p.data = self.flat[start:start + p.size].reshape(p.shape)  # views: no copy
            p.grad = self.flat_grad[start:start + p.size].reshape(p.shape)
        lo = dp_comm.rank * s
        self.shard = FlatBlock(self.params, lo, s)  # split over the replicas
        self.shard.name, self.shard.placement = f"zero1.shard{dp_comm.rank}", Placement([dp_comm])
        self.shard.data, self.shard.grad = self.flat[lo:lo + s], self.flat_grad[lo:lo + s]
        self.opt = make_opt([self.shard])

    def reduce_scatter_grads(self):
        """shard.grad = the sum over ranks of this rank's block of the flat gradient. Comm has no
        in-place Reduce_scatter (MPI forbids a receive buffer inside the send buffer), so the sum
        lands in a temporary of shard_size values first (16-bit gradients: summed as
        :func:`mpipar.mpi.bf16.reduce_scatter` says, float32 unless ``grad_sum`` is "bf16")."""
        got = bf16.reduce_scatter(self.comm, self.flat_grad, self.grad_sum,
                                  what="every gradient, flat, padded")  # (shard_size,)
        self.shard.grad[...] = got  # block r of the full gradients becomes its sum

    def update(self):
        self.opt.step()

    def allgather_params(self):
        """Every rank's updated block into the flat parameters (the replica's views). The own
        block goes out from a temporary copy: a send buffer may not lie in the receive buffer."""
        self.comm.Allgather(self.shard.data.copy(), self.flat, what="every rank's updated shard")

    def step(self):
        self.reduce_scatter_grads()
        self.update()
        self.allgather_params()

    def state_bytes(self):
        return self.opt.state_bytes()


# ----------------------------------------------------------------------------- the scheme
class Replica(Trainer):
    """What every variant shares: a whole replica on each rank, made equal by Step 1, and the
    forward and backward of Step 3. Each variant below is a subclass whose :meth:`step` runs
    Steps 2 to 5 for one global batch and returns the global loss."""

    def __init__(self, task, grid, args, model=None):
        self.args, self.task, self.comm = args, task, grid.dp_comm
        self.model = task.build_model().init(args.seed) if model is None else model
        self.params = place(self.model.parameters(), replicated=[self.comm])  # a whole replica
        self.loss_fn = task.loss_fn
        self.rank, self.size = self.comm.rank, self.comm.size
        self.rows = comm.split_rows(args.batch_size, self.size)  # rows of the batch per rank
        self.n = sum(p.size for p in self.params)
        self.flat = B.xp.empty(self.n, dtype=B.dtype)  # all parameters (or gradients), flat
        self.scaler = precision.scaler_for(args)  # fp16's loss scale, or None

        # -- DP Step 1: the master sends every parameter to every worker (Bcast) --
        comm.narrate(f"DP Step 1: rank 0 broadcasts all {self.n:,} parameters "
                     f"({self.flat.nbytes:,} bytes, one flat buffer); workers overwrite theirs")
        bcast_params(self.comm, self.params, self.flat, root=0)

    def own_rows(self, step):
        """Step 2 without a message: every rank makes the global batch from (seed, step) and
        takes its own rows. Returns x, y and the target count of the GLOBAL batch."""
        r, n_rows = self.rank, self.rows[self.rank]
        lo = sum(self.rows[:r])
        comm.narrate(f"DP Step 2: no message: rank {r} takes rows {lo}..{lo + n_rows - 1} "
                     f"of the global batch, which every rank makes from (seed, step)")
        x_host, y_host = self.task.batch(step)
        x, y = self.task.to_device(x_host[lo:lo + n_rows], y_host[lo:lo + n_rows])
        return x, y, y_host.size

    def forward_backward(self, x, y, normalizer, sync=None):
        """Step 3 on this rank's rows, in ``--micro-batches`` pieces whose gradients add up.
        The loss is divided by ``normalizer``, the target count of the GLOBAL batch, so the
        replicas' gradients sum to the serial gradient. With ``sync`` (overlap), the last
        backward runs layer by layer and tells it which gradients are final."""
        micro_rows = comm.split_rows(x.shape[0], self.args.micro_batches)
        comm.narrate(f"DP Step 3: rank {self.rank} runs forward and backward on its "
                     f"{x.shape[0]} rows in {len(micro_rows)} micro-batch(es); loss divided by "
                     f"the global {normalizer} targets")
        loss, loss_fn = 0.0, self.loss_fn
        for micro_id, (lo, n) in enumerate(zip(comm.offsets(micro_rows), micro_rows)):
            with TRACE.span("compute", "forward", micro=micro_id):
                logits = self.model.forward(x[lo:lo + n], micro_id)
                loss += loss_fn.forward(logits, y[lo:lo + n], normalizer, micro_id)
            with TRACE.span("compute", "backward", micro=micro_id):
                dlogits = loss_fn.backward(self.loss_scale(), micro_id)
                if sync is not None and micro_id == len(micro_rows) - 1:
                    sync.start()  # the gradients become final during this backward
                    backward_layers(self.model, dlogits, micro_id, sync.grads_ready)
                else:
                    self.model.backward(dlogits, micro_id)
        return loss

    def loss_scale(self):
        """fp16's loss scale (1 otherwise): the backward starts from the loss times it."""
        return precision.scale_of(self.scaler)

    def take_step(self, opt):
        """``opt.step()``; in fp16 skipped on every rank when any rank's gradients overflowed
        (:func:`mpipar.engine.precision.take_step`, the verdict one Allreduce MAX)."""
        precision.take_step(opt, self.scaler, lambda bad: comm.any_rank(
            self.comm, bad, "did any rank's gradients overflow?"))

    def global_loss(self, loss):
        """The sum of the replicas' losses, on every rank, for the runner to print (and to stop
        every rank at once when it is not finite); the same on every rank, which adds the same
        list in the same order. Its cost: one small pickled allgather a step, a round every
        rank must reach, after Step 5 (not counted in ``Comm.stats``: not the scheme's data)."""
        return sum(self.comm.allgather_obj(loss, what="the replicas' losses, to print"))

    def full_params(self):
        """Every replica holds the whole model: rank 0's, under the serial names."""
        if self.rank != 0:
            return None
        return {name: B.to_numpy(p.data).copy() for name, p in self.model.named_parameters()}

    def optimizer_state_bytes(self):
        return sum(o.state_bytes() for o in self.optimizers())

    def buffers(self):
        return [self.flat]


class MasterScheme(Replica):
    """The seed's scheme (``--sync master``): the master (rank 0) scatters the batch, sums the
    gradients with Reduce, updates, and broadcasts the parameters. Only it keeps an optimizer."""

    def __init__(self, task, grid, args, model=None):
        super().__init__(task, grid, args, model)
        self.is_master = self.rank == 0
        self.opt = serial.make_optimizer(args, self.params) if self.is_master else None
        self.flat_sum = B.xp.empty_like(self.flat) if self.is_master else None
        self.meta = None  # trailing shapes and dtypes of x and y, learned from the master

    def buffers(self):
        return [self.flat, self.flat_sum]  # flat_sum: the Reduce's

    def step(self, step):
        """Steps 2 to 5 for the global batch of ``step``; returns the global loss. The master
        makes the batch (``task.batch``) and scatters ``self.rows`` rows to each rank (the
        other ranks learn the rows' trailing shapes and dtypes once); every rank runs
        :meth:`forward_backward` on its rows; Reduce sums the flat gradients on the master,
        which steps its optimizer; :func:`bcast_params` sends the new parameters to all."""
        dp_comm, r = self.comm, self.rank
        self.model.zero_grad()

        # -- DP Step 2: the master splits the global batch along the batch dimension (Scatterv) --
        with comm.step("DP Step 2", f"rank 0 scatters the {self.args.batch_size} rows of the "
                                    f"global batch, {self.rows} rows per rank"):
            x_all = y_all = None
            if self.is_master:
                x_all, y_all = self.task.to_device(*self.task.batch(step))
            if self.meta is None:  # once: the trailing shapes and dtypes of x and y
                self.meta = dp_comm.bcast_obj(
                    (x_all.shape[1:], x_all.dtype.str, y_all.shape[1:], y_all.dtype.str)
                    if self.is_master else None, what="the batch's shapes and dtypes, once")
            x_tail, x_dtype, y_tail, y_dtype = self.meta
            x = B.xp.empty((self.rows[r],) + x_tail, dtype=x_dtype)  # (rows, ...)
            y = B.xp.empty((self.rows[r],) + y_tail, dtype=y_dtype)
            dp_comm.Scatterv(x_all, self.rows, x, what="the batch's inputs")
            dp_comm.Scatterv(y_all, self.rows, y, what="the batch's targets")

        # -- DP Step 3: each worker runs forward and backward on its shard --
        loss = self.forward_backward(x, y, self.args.batch_size * math.prod(y_tail))

        # -- DP Step 4: the gradients are summed (Reduce to the master) and the model updated --
        with comm.step("DP Step 4", f"Reduce(SUM) of {self.n:,} gradient values "
                                    f"({self.flat.nbytes:,} bytes) to rank 0, which updates the "
                                    f"model"):
            flatten([p.grad for p in self.params], self.flat)
            dp_comm.Reduce(self.flat, self.flat_sum, root=0, what="every gradient, flat")
        if self.is_master:
            unflatten(self.flat_sum, [p.grad for p in self.params])
            self.opt.step()

        # -- DP Step 5: the master broadcasts the updated parameters for the next batch --
        with comm.step("DP Step 5", "rank 0 broadcasts the updated parameters"):
            bcast_params(dp_comm, self.params, self.flat, root=0)
        return self.global_loss(loss)


class AllreduceScheme(Replica):
    """``--sync allreduce`` or ``ring`` (with ``--bucket-mb``, ``--overlap``): no master.
    Every rank sums the gradients with every other and applies the same update to its own
    replica, so the replicas stay bitwise equal and nothing is broadcast."""

    def __init__(self, task, grid, args, model=None):
        super().__init__(task, grid, args, model)
        self.opt = serial.make_optimizer(args, self.params)
        self.sync = GradSync(self.comm, self.params, args.sync, args.bucket_mb, args.overlap,
                             getattr(args, "grad_sum", "fp32"))

    def buffers(self):
        return [self.flat] + [b.flat for b in self.sync.buckets]

    def step(self, step):
        self.model.zero_grad()

        # -- DP Step 2: no Scatterv: each rank takes its own rows of the global batch --
        x, y, normalizer = self.own_rows(step)

        # -- DP Step 3: each worker runs forward and backward on its shard --
        loss = self.forward_backward(x, y, normalizer, self.sync if self.args.overlap else None)

        # -- DP Step 4: the gradients are summed (Allreduce or ring, by bucket); all update --
        with comm.step("DP Step 4", f"{self.args.sync} of the gradients in "
                                    f"{len(self.sync.buckets)} bucket(s); every rank applies the "
                                    f"same update to its replica"):
            self.sync.finish()
        self.take_step(self.opt)  # (fp16: skipped by every rank if any rank's overflowed)

        # -- DP Step 5: nothing to broadcast: every replica made the same update --
        comm.narrate("DP Step 5: nothing to send: every replica made the same update")
        return self.global_loss(loss)


class ZeroScheme(Replica):
    """``--zero 1``: ZeRO stage 1 (:class:`ZeroOptimizer`). The gradients are
    reduce-scattered, each rank updates its 1/P shard of the flat parameters with 1/P of the
    optimizer state, and the updated shards are allgathered."""

    def __init__(self, task, grid, args, model=None):
        super().__init__(task, grid, args, model)
        self.opt = ZeroOptimizer(self.comm, self.params, lambda ps: serial.make_optimizer(args, ps),
                                 getattr(args, "grad_sum", "fp32"))
        self.flat = self.opt.flat[:self.n]  # Step 1's buffer is dropped: the parameters, flat

    def optimizers(self):
        return [self.opt.opt]  # the elementwise optimizer over this rank's shard

    def buffers(self):
        return []  # the flat buffers are the parameters and their gradients

    def step(self, step):
        self.model.zero_grad()

        # -- DP Step 2: no Scatterv: each rank takes its own rows of the global batch --
        x, y, normalizer = self.own_rows(step)

        # -- DP Step 3: each worker runs forward and backward on its shard --
        loss = self.forward_backward(x, y, normalizer)

        # -- DP Step 4: Reduce_scatter of the gradients; each rank updates its own shard --
        with comm.step("DP Step 4", f"Reduce_scatter of the gradients; rank {self.rank} updates "
                                    f"its shard of {self.opt.shard_size:,} values"):
            self.opt.reduce_scatter_grads()
        self.take_step(self.opt.opt)  # the shard's update (fp16: skipped on any overflow)

        # -- DP Step 5: the updated shards are allgathered into every replica --
        with comm.step("DP Step 5", f"Allgather of the updated shards ({self.flat.nbytes:,} bytes "
                                    f"of parameters in all)"):
            self.opt.allgather_params()
        return self.global_loss(loss)


if __name__ == "__main__":  # python -m mpipar.data_parallel
    from mpipar.runner import hand_over

    hand_over(__name__, "data_parallel")
