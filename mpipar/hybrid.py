"""Hybrid 3D parallelism: data x tensor x pipeline parallel training on one process grid
(Megatron-LM's PTD-P, Narayanan et al. 2021).

    mpirun -n 8 python -m mpipar.hybrid --dp 2 --tp 2 --pp 2
    mpirun -n 4 python -m mpipar.hybrid --dp 2 --pp 2 --schedule gpipe --micro-batches 4
    mpirun -n 8 python -m mpipar.hybrid --dp 2 --tp 2 --pp 2 --print-grid
    mpirun -n 8 python -m mpipar.hybrid --dp 2 --tp 2 --pp 2 --zero 1 --optim adam
    mpirun -n 4 python -m mpipar.hybrid --dp 2 --pp 2 --zero 2 --bucket-mb 0.01 --overlap
    mpirun -n 8 python -m mpipar.hybrid --dp 2 --tp 2 --pp 2 --cp 2 --sequence-parallel

N = D * T * P ranks form a grid (:class:`mpipar.mpi.grid.Grid`): the T ranks of a tensor-parallel
group hold slices of the same layers, the P stages of a pipeline hold consecutive layers, and
the D data-parallel replicas each hold the whole model (as T x P pieces) and train on different
rows of the batch. Tensor-parallel ranks vary fastest, then stages, then replicas::

    world_rank = dp * (P * T) + pp * T + tp

Nothing here is a fourth copy of a scheme: the layers are :mod:`mpipar.parts.tp_layers`'s, the
stages and schedules :mod:`mpipar.pipeline`'s, the gradient sum :mod:`mpipar.data_parallel`'s;
each takes its communicator from the grid. The steps, each under an ``HY Step N`` banner:

1. Carve COMM_WORLD into the grid: ``tp_comm``, ``pp_comm`` and ``dp_comm`` by ``Split``. A
   layout whose product is not N is refused on every rank, with the list of valid ones.
2. Each rank builds its piece: the tensor-parallel model (the same flat layers and names as
   nn.GPT, its matrices split over ``tp_comm``), cut to this rank's pipeline stage where the
   dense model's FLOPs balance; every shard starts at its slice of the serial weights. The last
   stage's loss is the vocabulary-parallel cross-entropy (its logits stay split).
3. Each replica takes its rows of the global batch (every rank makes the whole batch from
   (seed, step)) and cuts them into m micro-batches. The loss divides by the target count of
   the WHOLE global batch, so gradients summed over micro-batches and replicas are the serial
   gradient, with no further scaling.
4. The pipeline runs its schedule (naive, GPipe or 1F1B) over ``pp_comm``; inside a stage
   every layer is tensor parallel, with its Allreduces over ``tp_comm``.
5. At the pipeline's optimizer step, after its last backward, the gradients are summed over
   ``dp_comm``, once per step (:class:`mpipar.data_parallel.GradSync`: one Allreduce of a flat
   buffer, or buckets; with ``--overlap`` the buckets start during the last backward). With
   ``--zero 1`` (:class:`ZeroUpdate`, ZeRO stage 1 over each dp group) a Reduce_scatter instead:
   each replica keeps 1/D of the sum. With ``--zero 2`` (:class:`Zero2Update`, ZeRO stage 2,
   :mod:`mpipar.zero`'s pieces) the gradients are views into one padded flat buffer per
   ``--bucket-mb`` bucket, made at the start of the step and summed into over its micro-batches;
   each bucket is reduce-scattered (with ``--overlap``, started during the last micro-batch's
   backward), each rank keeps its shard's gradient and the full buffers are freed.
6. Each rank updates its own shards and replicated parameters
   (:class:`mpipar.tensor_parallel.LocalUpdate`): the replicas make the same update, nothing
   is sent. With ``--zero 1`` each rank updates its 1/D block (with 1/D of the optimizer
   state) and the blocks are allgathered over dp_comm; with ``--zero 2`` its shard of each
   bucket, the shards allgathered into the parameters' flat buffers, bucket by bucket.
7. To evaluate or save, the model is gathered to world rank 0 under the serial names: the
   shards inside each stage of replica 0, then the stages along its pipeline.

Communication per rank per step (b global batch, m micro-batches, r = b / (D m) rows per
micro-batch, s sequence, h width, V vocabulary, w bytes per element, n_own the bytes of this
rank's parameters, about |theta| w / (T P)):

- tp (T > 1), per micro-batch: 4 Allreduces of r*s*h*w per block on the stage (2 forward,
  2 backward), 1 for the embedding on the first stage, 1 of r*s*h*w plus 3 of r*s*w for the
  output layer and the cross-entropy on the last stage. Ring cost 2(T-1)/T of each.
- pp (P > 1), per micro-batch and stage boundary: one activation forward and one gradient
  back, r*s*h*w each, plus an 80-byte header (every tp rank sends its own copy).
- dp (D > 1): one Allreduce of n_own bytes (k with k buckets): 2(D-1)/D * n_own with a ring;
  with --zero 1 or 2, Psi = n_own padded to a multiple of D (per bucket for ZeRO-2):
  Reduce_scatter Psi + Allgather Psi = 2 Psi, as counted by Comm.stats, of which 2(D-1)/D * Psi
  crosses the wire, no more than the Allreduce. ZeRO-1 makes one call of each, ZeRO-2 one per
  bucket; with --overlap a bucket's reduce-scatter is D-1 Isend and D-1 Irecv of one block.
- ``--sequence-parallel`` (:mod:`mpipar.parts.sequence_parallel`): each tp Allreduce of r*s*h*w
  becomes a reduce-scatter and an allgather of it (the same volume), plus one Allreduce per
  step of the stage's LayerNorm (and position) gradients over tp_comm, after Step 5's sum
  (before it with --zero, while the gradients are whole; so --zero 2 takes no --overlap); a
  stage boundary then carries each tp rank's own rows, r*(s/T)*h*w, not a copy of all of them.

With ``--experts E`` (:mod:`mpipar.expert_parallel`'s layer in every block; ``--tp 1``,
``--schedule gpipe``): each stage's replicas are cut into ep groups of ``--ep`` consecutive
replicas over which its experts are split (Step 1 splits ``dp_comm`` once more); every MoE layer
sends its tokens to their experts' replicas and back by all-to-all in Step 4; before a stage's
first backward, :class:`BalancingStage` settles its layers' load-balancing loss over the whole
global batch, one Allreduce over ``dp_comm`` of each layer's routing (so every micro-batch's
forward must come first: GPipe's order, and no other schedule is accepted); in Step 5 the
experts' gradients are summed over their own replicas only, the rest over ``dp_comm``; the
printed loss adds the stages' aux losses.

With ``--cp G`` (:mod:`mpipar.context_parallel`; the dense GPT): each stage's replicas are cut
into cp groups of G consecutive replicas (Step 1 splits ``dp_comm``), which take the same rows
and split their tokens (one contiguous chunk, or the zigzag's two); the rows go to the
``dp // G`` data-parallel groups in Step 3; every block's attention runs its core, on this
rank's H/t heads, as the ring over ``cp_comm`` or as Ulysses (H/(t G) heads a rank:
:mod:`mpipar.parts.cp_models`), inside Step 4; with
``--sequence-parallel`` the tensor-parallel ranks split the cp rank's tokens once more. The
gradient sum of Step 5 over ``dp_comm`` already covers the cp ranks, which hold the same
parameters; messages between stages carry s/G tokens.

Why that nesting (Narayanan et al. 2021, arXiv:2104.04473, Sec. 3): tensor parallelism talks
several times per layer and micro-batch, so its groups are neighbouring ranks (one node, fast
links); the pipeline talks once per micro-batch and stage boundary, point to point; data
parallelism talks once per step and can hide behind the backward, so it is outermost.

Left out: the scatter/gather optimisation between stages without sequence parallelism
(Megatron sends 1/T of an activation and allgathers it on arrival; here every tp rank sends all
of it), interleaved stages, ZeRO stage 3 over the data-parallel group (it would gather a
stage's parameters for each micro-batch's forward and backward, or hold them through the
schedule, whose micro-batches interleave forwards and backwards), and a hand-written ring for
the dp sum. ZeRO-2 frees the full gradients between steps only: they accumulate over every
micro-batch of a step, so they live through the whole schedule, and a step's peak holds them
as it would without ZeRO.
"""

import numpy as np

from mpipar import data_parallel as DP
from mpipar import expert_parallel as EP
from mpipar import pipeline as PP
from mpipar import serial
from mpipar import tensor_parallel as TP
from mpipar import zero as Z
from mpipar.engine import backend as B
from mpipar.engine import moe, nn, precision
from mpipar.engine.parameters import place
from mpipar.mpi import comm
from mpipar.mpi.grid import Grid
from mpipar.parts import cp_models, plan, tp_models
from mpipar.parts import sequence_parallel as SP
from mpipar.parts.schedules import SCHEDULES, Backward
from mpipar.parts.tp_layers import split_parameters
from mpipar.runner.trainer import Trainer


# ----------------------------------------------------------------------------- comm helpers
def sum_over(group, value, what=""):
    """The sum of one float per rank of ``group`` (small metadata: pickled allgather), the
    same on every rank because every rank adds the same list in the same order."""
    return sum(group.allgather_obj(value, what=what))


# ----------------------------------------------------------------------------- the scheme
def make_grid(dp, tp, pp, mpi_comm=None, ep=None, cp=1):
    """The grid's three communicators for this rank (a wrong product is refused by Grid on
    every rank, listing the layouts that fit the job); with ``ep`` (a run with experts), the
    dp group split into expert-parallel groups too; with ``cp`` > 1, into context-parallel
    groups of cp replicas that share rows and split their tokens."""
    # -- HY Step 1: carve COMM_WORLD into the data x tensor x pipeline grid --
    grid = Grid(dp, tp, pp, mpi_comm)
    if ep is not None:  # the ep and expert-replica groups, inside each stage's replicas
        EP.add_expert_groups(grid, ep)
    if cp > 1:  # cp groups of replicas that share rows (without: each replica its own)
        grid.split_context(cp)
        grid.axes = ("dp", "cp", "tp", "pp")  # a rank's place, for the memory ledger
    comm.narrate(f"HY Step 1: world rank {grid.world.rank} is dp={grid.dp_rank} "
                 f"tp={grid.tp_rank} pp={grid.pp_rank}: tp group of {grid.tp_size}, pipeline "
                 f"of {grid.pp_size} stages, {grid.dp_size} replica(s)")
    return grid


class SyncingStage(nn.Sequential):
    """A stage whose backward of the step's LAST micro-batch runs layer by layer and tells
    the gradient sync which parameters are final (what DDP's hooks do), so ``--overlap`` can
    launch a bucket's Iallreduce (ZeRO-2: its posted reduce-scatter) while the layers before
    it still run backward."""

    def __init__(self, stage, sync, last_micro):
        super().__init__(stage.layers)
        self.sync, self.last_micro = sync, last_micro

    def backward(self, dout, micro_id=0):
        if micro_id != self.last_micro:
            return super().backward(dout, micro_id)
        self.sync.start()  # this backward makes every gradient final
        return DP.backward_layers(self, dout, micro_id, self.sync.grads_ready)


class BalancingStage(nn.Sequential):
    """A stage of mixture-of-experts blocks whose first backward of a step first settles the
    load-balancing loss of its layers over the global batch: one Allreduce over ``dp_comm``
    (the replicas, whose rows make up the batch) of each layer's routing, after all ``n_micro``
    forwards (GPipe's order; any other schedule is refused, and :func:`moe.balance` would
    stop a backward that came earlier). ``aux``: the stage's layers' aux losses."""

    def __init__(self, stage, dp_comm, n_micro):
        super().__init__(stage.layers)
        self.dp_comm, self.n_micro, self.aux = dp_comm, n_micro, 0.0
        self.loss_scale = 1.0  # fp16's, set by the trainer each step

    def backward(self, dout, micro_id=0):
        if any(m.seen for m in self.modules() if isinstance(m, moe.MoE)):  # the step's first
            with comm.step("HY Step 4", "the aux loss over the global batch: Allreduce of each "
                                        "MoE layer's routing over the replicas"):
                self.aux = EP.balance_over(self.dp_comm, self, self.n_micro, self.loss_scale)
        return super().backward(dout, micro_id)


class Hybrid(Trainer):
    """One rank of the 3D trainer: ``__init__`` is Step 2, :meth:`step` Steps 3 to 6 for one
    global batch (Steps 5 and 6 run inside the pipeline, at its optimizer step)."""

    def __init__(self, task, grid, args):
        self.args, self.task, self.grid = args, task, grid
        self.dp_comm, self.tp_comm, self.pp_comm = grid.dp_comm, grid.tp_comm, grid.pp_comm
        n_stages, m = grid.pp_size, args.micro_batches
        self.stage_id = grid.pp_rank
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == n_stages - 1

        # -- HY Step 2: each rank builds its piece: this stage's layers, tensor parallel --
        counts, self.flops = plan.plan_stages(task, n_stages, m, args.partition)  # dense FLOPs
        self.bounds = plan.stage_bounds(counts)
        tp_model = tp_models.build_tp_model(task, self.tp_comm)  # every layer, none initialised
        self.held = cp_models.over_context(tp_model, args, grid, task.data.vocab) \
            if grid.cp_size > 1 else None
        if args.experts:  # each block's feed-forward: this replica's share of the experts
            for name, block in tp_model.layers:
                if name.startswith("blocks."):
                    block.mlp = EP.ExpertParallelMoE(args.d_model, args.experts, args.top_k,
                                                     args.aux_loss_coef, grid.ep_comm,
                                                     EP.EXCHANGES[args.a2a])
        self.layer_names = [name for name, _ in tp_model.layers]
        stage = PP.build_stage(tp_model, self.bounds[self.stage_id], args.seed)
        self.stage = stage
        shards, replicated = split_parameters(stage)
        self.experts = [p for n, p in stage.named_parameters() if ".mlp.experts." in n]
        replicated = [p for p in replicated if all(p is not q for q in self.experts)]
        ep = [grid.ep_comm] if args.experts else []  # the rest is the same on every ep rank
        ep += [grid.cp_comm] if grid.cp_size > 1 else []  # and on every cp rank
        place(shards, split=[self.tp_comm, self.pp_comm], replicated=[self.dp_comm, *ep])
        place(replicated, split=[self.pp_comm], replicated=[self.tp_comm, self.dp_comm, *ep])
        place(self.experts, split=[self.pp_comm, *ep], replicated=[self.tp_comm, *(
            [grid.edp_comm] if args.experts else [])])
        self.loss_fn = tp_models.tp_loss(task, self.tp_comm) if self.is_last_stage else None
        self.instructions = SCHEDULES[args.schedule](n_stages, self.stage_id, m)
        self.rows = comm.split_rows(args.batch_size, grid.data_size)  # rows per data group
        self.lo = sum(self.rows[:grid.data_rank])
        self.micro_rows = comm.split_rows(self.rows[grid.data_rank], m)
        make_opt = lambda params: serial.make_optimizer(args, params)  # noqa: E731
        if args.experts:  # the experts' gradients are summed over their own replicas only
            self.update = SyncedUpdate(stage, self.dp_comm, make_opt, args.bucket_mb,
                                       tp_comm=self.tp_comm, experts=self.experts,
                                       edp_comm=grid.edp_comm, grad_sum=args.grad_sum)
        elif args.zero == 1:
            self.update = ZeroUpdate(stage, self.dp_comm, make_opt, self.tp_comm, args.grad_sum)
        else:
            self.update = (Zero2Update if args.zero == 2 else SyncedUpdate)(
                stage, self.dp_comm, make_opt, args.bucket_mb, args.overlap, tp_comm=self.tp_comm,
                grad_sum=args.grad_sum)
        self.scaler = self.update.scaler = precision.scaler_for(args)  # fp16's, or None
        self.update.agree = lambda bad: comm.any_rank(  # one verdict for every group
            grid.world, bad, "did any rank's gradients overflow?")
        self.module = BalancingStage(stage, self.dp_comm, m) if args.experts else stage
        if args.overlap and self.update.sync is not None:
            last = [ins.micro for ins in self.instructions if isinstance(ins, Backward)][-1]
            self.module = SyncingStage(stage, self.update.sync, last)
        a, b = self.bounds[self.stage_id]
        comm.narrate(f"HY Step 2: stage {self.stage_id} holds layers "
                     f"{', '.join(self.layer_names[a:b])}: {len(shards)} shards "
                     f"({sum(p.size for p in shards):,} numbers) and {len(replicated)} "
                     f"replicated parameters ({sum(p.size for p in replicated):,} numbers)")
        self.peak_stash_bytes = 0

    def step(self, step):
        """One training step; returns the global batch's loss on every rank (the last stages
        sum it over the replicas, then each pipeline shares it)."""
        a, task, grid = self.args, self.task, self.grid
        m = a.micro_batches
        fresh = isinstance(self.update, Zero2Update)  # ZeRO-2: full gradients for this step only
        scale = precision.scale_of(self.scaler)  # fp16: the backward of loss * scale
        if isinstance(self.module, BalancingStage):
            self.module.loss_scale = scale  # the aux loss's gradient, scaled alike
        if fresh:
            self.update.sync.new_grads()

        # -- HY Step 3: each replica takes its rows of the global batch, as micro-batches --
        n_rows = self.rows[grid.data_rank]
        comm.narrate(f"HY Step 3: no message: replica {grid.dp_rank} takes rows {self.lo}.."
                     f"{self.lo + n_rows - 1} of the global batch in {m} micro-batch(es) of "
                     f"{self.micro_rows} rows" + (f", {len(self.held)} of their "
                                                  f"{a.seq_len} tokens (cp rank "
                                                  f"{grid.cp_rank})" if self.held is not None
                                                  else "")
                     + "; the loss divides by the global target count")
        x_host, y_host = task.batch(step)  # the whole global batch, from (seed, step)
        normalizer = y_host.size  # targets in the GLOBAL batch, not in this rank's rows
        x_host, y_host = (t[self.lo:self.lo + n_rows] for t in (x_host, y_host))
        if self.held is not None:  # context parallel: this rank's tokens of each row
            x_host, y_host = (np.ascontiguousarray(t[:, self.held]) for t in (x_host, y_host))
        x, y = task.to_device(x_host, y_host)

        # -- HY Step 4: the pipeline runs its schedule; inside a stage every layer is TP --
        comm.narrate(f"HY Step 4: stage {self.stage_id} runs the {a.schedule} schedule over "
                     f"pp_comm; its layers Allreduce over tp_comm ({grid.tp_size} rank(s))")
        result = PP.run_pipeline(
            self.module, self.instructions, self.pp_comm, self.micro_rows,
            inputs=PP.micro_batches(x, m) if self.is_first_stage else None,
            targets=PP.micro_batches(y, m) if self.is_last_stage else None,
            loss_fn=self.loss_fn, normalizer=normalizer, optimizer=self.update, zero_grad=not fresh,
            measure_stash=not self.peak_stash_bytes,  # the first step's is every step's
            loss_scale=scale)
        self.peak_stash_bytes = max(self.peak_stash_bytes, result.peak_stash_bytes)
        loss = None
        if self.is_last_stage:  # each replica's loss covers its rows only: add the replicas'
            loss = sum_over(self.dp_comm, result.loss, what="the replicas' losses, to print")
        loss = PP.share_loss(self.pp_comm, loss)
        if self.args.experts:  # each stage's layers' aux losses, already over the whole batch
            loss += sum_over(self.pp_comm, self.module.aux, what="the stages' aux losses")
        return loss

    def memory(self):
        """Bytes this rank holds: parameters, gradients, optimizer state, peak activations.
        Between ZeRO-2 steps the gradients are the shards' only (the full ones are freed)."""
        params = self.stage.parameters()
        shards = [b.shard for b in self.update.sync.buckets] if self.args.zero == 2 else []
        return {"param_bytes": sum(p.data.nbytes for p in params),
                "grad_bytes": sum(p.grad.nbytes for p in params + shards if p.grad is not None),
                "optimizer_bytes": self.update.opt.state_bytes(),
                "activation_bytes": self.peak_stash_bytes}

    def parameters(self):
        return self.stage.parameters()

    def optimizers(self):
        return [self.update.opt]

    def split_groups(self):
        return [self.tp_comm, self.pp_comm]

    def units(self):
        return [self.module]  # the stage runs whole

    def wrap_units(self, wrap):
        self.module = wrap(self.module)

    def buffers(self):  # GradSync's gradient buckets, or ZeRO-2's flat parameters and gradients
        syncs = [s for s in (self.update.sync, getattr(self.update, "expert_sync", None)) if s]
        return [x for sync in syncs for b in sync.buckets
                for x in (b.flat, getattr(b, "flat_grad", None))]

    def full_params(self):
        """The whole model on world rank 0 (Step 7), None elsewhere."""
        return gather_model(self.task, self)


class StageUpdate:
    """What the updates below share: fp16's loss ``scaler`` and ``agree``, the job-wide verdict
    on an overflow (both set by :class:`Hybrid`; None in any other precision), through which
    each takes its optimizer's step: skipped on every rank of every group, or on none."""

    scaler = agree = None

    def take_step(self, opt):
        return precision.take_step(opt, self.scaler, self.agree)


class SyncedUpdate(StageUpdate):
    """The ``optimizer`` the pipeline calls at its OptimizerStep, after the stage's last
    backward: Step 5 sums the gradients over ``dp_comm``, Step 6 steps each rank's optimizer
    on its own shards and replicated parameters. With one replica there is nothing to sum."""

    def __init__(self, stage, dp_comm, make_opt, bucket_mb=None, overlap=False, tp_comm=None,
                 experts=(), edp_comm=None, grad_sum="fp32"):
        self.dp_comm, self.tp_comm, self.params = dp_comm, tp_comm, stage.parameters()
        self.local = TP.LocalUpdate(stage, make_opt)
        self.opt, self.sync, self.zero, self.sharded = self.local.opt, None, None, []
        rest = [p for p in self.params if all(p is not e for e in experts)]
        if dp_comm.size > 1 and rest:
            self.sync = DP.GradSync(dp_comm, rest, "allreduce", bucket_mb, overlap, grad_sum)
        self.expert_sync = None  # the experts: over the replicas that hold the same ones
        if experts and edp_comm.size > 1:
            self.expert_sync = DP.GradSync(edp_comm, experts, "allreduce", bucket_mb,
                                           grad_sum=grad_sum)

    def step(self):
        # -- HY Step 5: after the last backward, sum the gradients over the dp group --
        if self.sync is not None:
            n_bytes = sum(b.flat.nbytes for b in self.sync.buckets)
            with comm.step("HY Step 5", f"Allreduce(SUM) of this rank's {n_bytes:,} gradient bytes"
                                        f" over its {self.dp_comm.size} replicas in "
                                        f"{len(self.sync.buckets)} bucket(s): the sum is the "
                                        f"serial gradient (global normaliser)"):
                self.sync.finish()
        if self.expert_sync is not None:
            with comm.step("HY Step 5", f"Allreduce(SUM) of the experts' gradients over their "
                                        f"{self.expert_sync.comm.size} replicas"):
                self.expert_sync.finish()
        if self.tp_comm is not None:  # --sequence-parallel: after the dp sum (it may overlap)
            SP.allreduce_sequence_grads(self.params, self.tp_comm)

        # -- HY Step 6: each rank updates its own shards and replicated parameters --
        comm.narrate("HY Step 6: every rank updates its own shards and replicated parameters; "
                     "the replicas make the same update, so nothing is sent")
        self.take_step(self.opt)  # (fp16: skipped on every rank if any rank's overflowed)


class ZeroUpdate(StageUpdate):
    """``--zero 1``: :class:`SyncedUpdate` with ZeRO stage 1 over ``dp_comm``
    (:class:`mpipar.data_parallel.ZeroOptimizer`): Step 5 reduce-scatters this rank's flat
    gradients over its D replicas (replica d keeps block d of their sum), Step 6 updates that
    block with 1/D of the optimizer state and allgathers the updated blocks. Each tp shard of
    each stage is sharded over its own dp group, so a rank keeps 1/D of its piece's state."""

    def __init__(self, stage, dp_comm, make_opt, tp_comm=None, grad_sum="fp32"):
        self.dp_comm, self.tp_comm, self.params = dp_comm, tp_comm, stage.parameters()
        self.zero, self.sync = DP.ZeroOptimizer(dp_comm, self.params, make_opt, grad_sum), None
        self.opt, self.sharded = self.zero.opt, [self.zero]  # sharded: each holds a ``shard``

    def step(self):
        if self.tp_comm is not None:  # --sequence-parallel: while the gradients are whole
            SP.allreduce_sequence_grads(self.params, self.tp_comm)

        # -- HY Step 5: ZeRO-1: after the last backward, reduce-scatter the gradients over dp --
        with comm.step("HY Step 5", f"Reduce_scatter(SUM) of this rank's {self.zero.flat.nbytes:,}"
                                    f" gradient bytes (padded) over its {self.dp_comm.size} "
                                    f"replicas: each keeps {self.zero.shard_size:,} values of the "
                                    f"serial gradient"):
            self.zero.reduce_scatter_grads()

        # -- HY Step 6: ZeRO-1: each rank updates its block; the blocks are allgathered --
        self.take_step(self.zero.opt)  # its block (fp16: skipped on any rank's overflow)
        with comm.step("HY Step 6", "every rank updates its block of its shards and replicated "
                                    "parameters, then Allgather of the updated blocks over the dp "
                                    "group"):
            self.zero.allgather_params()


class Zero2Update(StageUpdate):
    """``--zero 2``: ZeRO stage 2 over ``dp_comm``, from :mod:`mpipar.zero`'s pieces. The
    stage's parameters are views into one padded flat buffer per bucket, kept all run
    (:meth:`mpipar.zero.FlatShard.keep_whole`); its full gradients exist during a step only, as
    views into another (:meth:`mpipar.zero.ShardedGradSync.new_grads`, at the start of
    :meth:`Hybrid.step`), and add up over the step's micro-batches. Step 5 reduce-scatters each
    bucket over the D replicas (:class:`mpipar.zero.ShardedGradSync`: MPI's Reduce_scatter after
    the last backward, or with ``--overlap`` a posted one started during the last micro-batch's
    backward) and frees it, so a rank keeps its shard's gradient only; Step 6 updates the shards
    (one optimizer, 1/D of the state) and allgathers them into the kept parameter buffers."""

    def __init__(self, stage, dp_comm, make_opt, bucket_mb=None, overlap=False, tp_comm=None,
                 grad_sum="fp32"):
        self.dp_comm, self.tp_comm, self.params = dp_comm, tp_comm, stage.parameters()
        self.sync = Z.ShardedGradSync(dp_comm, self.params, bucket_mb, overlap, grad_sum)
        self.zero = None
        self.sharded = self.sync.buckets  # one FlatShard per bucket
        self.opt = make_opt([b.shard for b in self.sharded])

    def step(self):
        if self.tp_comm is not None:  # --sequence-parallel (never with --overlap): still whole
            SP.allreduce_sequence_grads(self.params, self.tp_comm)

        # -- HY Step 5: ZeRO-2: reduce-scatter each bucket's gradients over dp, free them --
        n_bytes = sum(b.flat_grad.nbytes for b in self.sharded)
        kept = sum(b.shard_size for b in self.sharded)
        how = "wait for the Reduce_scatters posted during the last backward (Irecv, Isend)" \
            if self.sync.overlap else "Reduce_scatter(SUM)"
        with comm.step("HY Step 5", f"{how} of this rank's {n_bytes:,} gradient bytes (padded) in "
                                    f"{len(self.sharded)} bucket(s) over its {self.dp_comm.size} "
                                    f"replicas: each keeps {kept:,} values of the serial gradient "
                                    f"and frees the full gradients"):
            self.sync.finish()

        # -- HY Step 6: ZeRO-2: each rank updates its shards; the shards are allgathered --
        self.take_step(self.opt)  # (fp16: skipped on every rank if any rank's overflowed)
        with comm.step("HY Step 6", f"every rank updates its {kept:,} values with 1/"
                                    f"{self.dp_comm.size} of the optimizer state, then Allgather "
                                    f"of the updated shards over the dp group, "
                                    f"{len(self.sharded)} bucket(s)"):
            for b in self.sharded:
                b.gather_params("updated")


def gather_model(task, trainer):
    """{canonical name: full host array} of the whole model on world rank 0, None elsewhere.

    Replica 0 only: each stage's tp group gathers its shards to its tp rank 0
    (tensor_parallel.gather_full_params), which puts them into a dense copy of the stage; the
    tp-rank-0 ranks of replica 0 form one pipeline group, and pipeline.gather_params collects
    the dense stages on its stage 0, which is world rank 0."""
    # -- HY Step 7: gather the whole model to world rank 0: shards per stage, then the stages --
    grid = trainer.grid
    experts = {}
    if trainer.experts:  # each ep group's experts to its first replica
        parts = grid.ep_comm.gather_obj({p.name: B.to_numpy(p.data) for p in trainer.experts})
        experts = {} if parts is None else {k: v for part in parts for k, v in part.items()}
    if grid.dp_rank != 0:
        return None
    comm.narrate(f"HY Step 7: stage {trainer.stage_id} of replica 0 gathers its shards to tp "
                 "rank 0, then the stages go to world rank 0")
    full = TP.gather_full_params(trainer.stage, grid.tp_comm)
    if grid.tp_rank != 0:
        return None
    a, b = trainer.bounds[trainer.stage_id]
    dense = nn.Sequential(task.build_model().layers[a:b])  # the serial layers, uninitialised
    full.update(experts)
    for name, p in dense.named_parameters():
        p.name = name
        p.set(B.to_numpy(full[name]))
    return PP.gather_params(dense, grid.pp_comm)


if __name__ == "__main__":  # python -m mpipar.hybrid
    from mpipar.runner import hand_over

    hand_over(__name__, "hybrid")
