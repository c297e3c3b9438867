"""Expert parallelism: the experts of every mixture-of-experts layer split over the ranks of a
group; each token travels to the rank of its experts and back, with all-to-alls.

The model is the serial mixture-of-experts GPT (:mod:`mpipar.engine.moe`: E experts in every
block, top-k routing, the load-balancing loss). P ranks, in P/G expert-parallel groups of G =
``--ep`` consecutive ranks; rank g of a group holds experts g E/G .. (g+1) E/G - 1 of every
layer. Everything else (embeddings, attention, LayerNorms, routers) is replicated on every
rank, which is a data-parallel replica of it and takes its own rows of the global batch, as
``data_parallel --sync allreduce`` does. The steps, one banner each at its calls:

1. The groups are carved from the world (Split): the ep groups (consecutive ranks) and the
   expert-replica groups (the ranks at the same place in every ep group, which hold the same
   experts). Each rank builds the replicated part and its E/G experts from (seed, name), the
   serial model's numbers, with no message.
2. Each rank takes its rows of the global batch and runs the model forward (every
   ``--micro-batches`` piece, all before any backward); in each MoE layer the router picks k
   experts per token: the routed (token, expert) pairs.
3. The counts are exchanged: an Alltoall over the ep group of this rank's pair counts for
   each expert of each destination, so every rank knows how many rows will come from whom,
   for which of its experts.
4. Dispatch: an Alltoallv of the tokens' rows, ordered by destination, then expert, then
   token (the transpose of the routing table: rank d gets column d of everyone's rows).
5. Each rank runs each of its experts once, on the rows that came for it from every rank.
6. Combine: an Alltoallv of the outputs back to the tokens' ranks (Step 4's counts swapped),
   which weight each by its probability p and add them up, in the serial order.
7. The load-balancing loss over the global batch: one Allreduce over all ranks of each MoE
   layer's routing counts, sums of p and token count, after the step's last forward. The loss
   needs f, the whole batch's routing shares, before any backward: which is why every
   micro-batch's forward comes first (GPipe's order; 1F1B would start a backward before the
   later micro-batches had been routed).
8. Backward, micro-batch by micro-batch: each MoE layer runs Steps 6 and 4 in reverse, the
   output gradients travelling to the experts with Step 4's counts and the input gradients
   back with Step 6's.
9. The gradients are summed and every rank updates: the replicated parameters over all P
   ranks (Allreduce), each expert's only over its expert-replica group (P/G ranks; nothing
   when G = P). The parameters' placements say so, and clipping, checkpoints and the memory
   ledger read them.

The all-to-all of Steps 4, 6 and 8 is MPI's Alltoallv (``--a2a mpi``, the default) or
:func:`pairwise_alltoallv`, written from P-1 rounds of Sendrecv (``--a2a pairwise``); both
only copy rows, so the results are the same bit for bit.

Bytes per rank per all-to-all: the routed pairs whose expert lives on another rank of the ep
group, times a row (C values): ``Comm.stats`` counts exactly that (a rank's own rows are
copied, not sent). Per MoE layer and micro-batch: the Alltoall of E/G counts per destination,
then two all-to-alls of rows forward (dispatch, combine) and two backward.

Run::

    mpirun -n 4 python -m mpipar.expert_parallel --experts 8 --top-k 2
    mpirun -n 4 python -m mpipar.expert_parallel --experts 4 --ep 2 --explain --steps 1
    mpirun -n 4 python -m mpipar.expert_parallel --a2a pairwise --micro-batches 2

References: Lepikhin et al. 2020, "GShard" (arXiv:2006.16668), section 2.2 (dispatch and
combine as all-to-alls); Fedus et al. 2021, "Switch Transformers" (arXiv:2101.03961), eq. 4
(the aux loss); experts inside the data-parallel ranks as in DeepSpeed-MoE (Rajbhandari et
al. 2022, arXiv:2201.05596) and Megatron-LM.
"""

import numpy as np
from mpi4py import MPI

from mpipar import serial
from mpipar.data_parallel import GradSync
from mpipar.engine import backend as B
from mpipar.engine import moe, precision
from mpipar.engine.parameters import place
from mpipar.mpi import comm
from mpipar.mpi.direct import communicator
from mpipar.mpi.failure import watched
from mpipar.mpi.grid import Grid
from mpipar.runner.trainer import Trainer


# ----------------------------------------------------------------------------- the all-to-alls
def mpi_alltoallv(ep_comm, send, send_rows, recv, recv_rows, what):
    """MPI's Alltoallv: ``send_rows[d]`` rows of ``send`` to rank d, ``recv_rows[s]`` from s."""
    ep_comm.Alltoallv(send, send_rows, recv, recv_rows, what=what)


def pairwise_alltoallv(ep_comm, send, send_rows, recv, recv_rows, what):
    """The same exchange by hand: this rank's own rows are copied; then in round k (1 .. P-1)
    rank r sends its rows for r + k and receives those of r - k (mod P), one Sendrecv, so every
    pair of ranks meets once and no rank waits on two partners at a time."""
    p, r = ep_comm.size, ep_comm.rank
    out, into = comm.offsets(send_rows), comm.offsets(recv_rows)
    recv[into[r]:into[r] + recv_rows[r]] = send[out[r]:out[r] + send_rows[r]]
    for k in range(1, p):
        dest, source = (r + k) % p, (r - k) % p
        ep_comm.Sendrecv(send[out[dest]:out[dest] + send_rows[dest]], dest,
                         recv[into[source]:into[source] + recv_rows[source]], source,
                         what=f"{what}, round {k} of {p - 1}")


EXCHANGES = {"mpi": mpi_alltoallv, "pairwise": pairwise_alltoallv}


def balance_over(group, model, n_micro, loss_scale=1.0):
    """The load-balancing loss of ``model``'s MoE layers over the batch whose rows the ranks
    of ``group`` hold: one Allreduce per layer of its counts, sums of p and token count, after
    all ``n_micro`` forwards (:func:`mpipar.engine.moe.balance`)."""
    return moe.balance(model, lambda stats: group.Allreduce(
        stats, what="routing counts, sums of p, tokens"), n_micro, loss_scale)


# ----------------------------------------------------------------------------- the layer
class ExpertParallelMoE(moe.MoE):
    """A :class:`mpipar.engine.moe.MoE` that holds this rank's E/G experts and reaches the
    others through ``ep_comm`` (Steps 3 to 6, and 8). Routing, weighting and the aux loss are
    the serial layer's."""

    def __init__(self, d_model, n_experts, top_k, aux_coef, ep_comm, exchange):
        self.per = n_experts // ep_comm.size  # experts per rank
        first = ep_comm.rank * self.per
        super().__init__(d_model, n_experts, top_k, aux_coef, range(first, first + self.per))
        self.comm, self.exchange = ep_comm, exchange

    def run_experts(self, h, p, rows, micro_id):
        counts = np.array([len(r) for r in rows], dtype=np.int64)  # pairs per expert
        arrived, send_rows, recv_rows, where = self.dispatch(h, rows, counts)

        # -- EP Step 5: each rank runs each of its experts on the rows that came for it --
        comm.narrate(f"EP Step 5: experts {[e for e, _ in self.held()]} run on "
                     f"{[len(w) for w in where]} rows")
        ys = B.xp.empty_like(arrived)
        for (_, expert), w in zip(self.held(), where):
            ys[w] = expert.forward(arrived[w], micro_id)

        # -- EP Step 6: combine: the outputs go back (Alltoallv) and are weighted by p --
        with comm.step("EP Step 6", "combine: the experts' outputs back to their tokens"):
            back = self.moved(ys, recv_rows, send_rows, "outputs to tokens")
        out = B.xp.zeros_like(h)
        for e, seg in enumerate(self.segments(counts)):
            out[rows[e]] += p[rows[e], e:e + 1] * back[seg]
        return out, (rows, counts, send_rows, recv_rows, where, back)

    def dispatch(self, h, rows, counts):
        """Steps 3 and 4. ``rows[e]``: the tokens (rows of h) routed to expert e,
        ``counts[e]`` how many; expert e lives on rank e // (E/G) of the ep group. Exchange
        the counts with one Alltoall (each rank learns how many rows each source sends to
        each of its experts), then send the tokens' rows, ordered by destination, expert,
        token, with :meth:`moved` (the all-to-all of ``--a2a``). Returns what arrived
        (source by source), the rows sent to and received from each rank, and where each of
        this rank's experts finds its rows in what arrived (:meth:`arrivals`)."""
        g, per = self.comm.size, self.per
        # -- EP Step 3: the pair counts per expert of each destination are exchanged (Alltoall) --
        with comm.step("EP Step 3", f"Alltoall of the pair counts {counts.tolist()} by expert"):
            got = np.empty_like(counts).reshape(g, per)  # got[s, j]: rows from s for expert j
            self.comm.Alltoall(counts.reshape(g, per), got, what="routed pairs per expert")
        send_rows, recv_rows = counts.reshape(g, per).sum(axis=1).tolist(), got.sum(axis=1).tolist()

        # -- EP Step 4: dispatch: the tokens' rows go to their experts' ranks (Alltoallv) --
        with comm.step("EP Step 4", f"dispatch: rows {send_rows} out to ranks 0..{g - 1}, "
                                    f"{recv_rows} in"):
            sent = h[B.xp.concatenate(rows)]  # (pairs, C): by destination, expert, token
            arrived = self.moved(sent, send_rows, recv_rows, "tokens to experts")
        return arrived, send_rows, recv_rows, self.arrivals(got)

    def moved(self, rows, out_rows, in_rows, what):
        """``rows`` sent over the ep group, ``out_rows[d]`` to rank d; returns what arrives,
        ``in_rows[s]`` rows from rank s, in rank order."""
        arrived = B.xp.empty((sum(in_rows), rows.shape[1]), dtype=rows.dtype)  # (in, C)
        self.exchange(self.comm, rows, out_rows, arrived, in_rows, what)
        return arrived

    def arrivals(self, got):
        """Where the rows for each of this rank's experts lie in what arrives: by source, and
        within a source's rows by expert (as that source sent them)."""
        starts = np.cumsum(got.ravel()) - got.ravel()  # source-major, then expert
        starts = starts.reshape(got.shape)
        return [B.xp.asarray(np.concatenate([np.arange(starts[s, j], starts[s, j] + got[s, j])
                                             for s in range(got.shape[0])]).astype(np.int64))
                for j in range(got.shape[1])]

    @staticmethod
    def segments(counts):
        """The slice of each expert's pairs in the dispatch order."""
        return [slice(lo, lo + n) for lo, n in zip(comm.offsets(counts.tolist()), counts.tolist())]

    def experts_backward(self, d, p, state, micro_id):
        rows, counts, send_rows, recv_rows, where, back = state
        dp, dy = B.xp.zeros_like(p), B.xp.empty_like(back)
        for e, seg in enumerate(self.segments(counts)):
            dp[rows[e], e] = (d[rows[e]] * back[seg]).sum(axis=1)  # d out / d p_e = expert_e(x)
            dy[seg] = p[rows[e], e:e + 1] * d[rows[e]]

        # -- EP Step 8: backward: Step 6 reversed, the output gradients to the experts --
        with comm.step("EP Step 8", "the output gradients to the experts (Step 6 reversed)"):
            arrived = self.moved(dy, send_rows, recv_rows, "gradients to experts")
        dx = B.xp.empty_like(arrived)
        for (_, expert), w in zip(self.held(), where):
            dx[w] = expert.backward_input(arrived[w], micro_id)
        with comm.step("EP Step 8", "the input gradients back to the tokens (Step 4 reversed)"):
            dback = self.moved(dx, recv_rows, send_rows, "gradients to tokens")
        dh = B.xp.zeros_like(d)
        for e, seg in enumerate(self.segments(counts)):
            dh[rows[e]] += dback[seg]
        return dh, dp


# ----------------------------------------------------------------------------- the scheme
def make_grid(ep, mpi_comm=None):
    """Step 1's groups: every rank a replica of the dense part (``dp_comm``, all ranks), in an
    ep group of ``ep`` consecutive ranks (``ep_comm``) and an expert-replica group of the ranks
    at its place in every ep group (``edp_comm``). The runner calls it for this scheme."""
    grid = Grid(dp=(MPI.COMM_WORLD if mpi_comm is None else mpi_comm).Get_size(),
                mpi_comm=mpi_comm)
    add_expert_groups(grid, ep)
    grid.axes = ("ep", "edp")  # a rank's place, for the memory ledger
    return grid


def add_expert_groups(grid, ep):
    """Split the grid's ``dp_comm`` (the ranks that hold the same layers and take other rows)
    into ep groups of ``ep`` consecutive ranks and expert-replica groups (the hybrid's too)."""
    r = grid.dp_comm.rank

    def split(color, key, name):
        with watched("Split", "all ranks", f"the {name} groups"):
            return communicator(grid.dp_comm.mpi.Split(color, key), name)

    grid.ep_comm, grid.edp_comm = split(r // ep, r % ep, "ep"), split(r % ep, r // ep, "edp")
    grid.ep_rank, grid.ep_size = grid.ep_comm.rank, grid.ep_comm.size
    grid.edp_rank, grid.edp_size = grid.edp_comm.rank, grid.edp_comm.size


class ExpertParallel(Trainer):
    """Steps 1 to 9 on this rank: the replicated part, E/G experts, and the exchanges."""

    def __init__(self, task, grid, args):
        self.args, self.task, self.loss_fn = args, task, task.loss_fn
        self.world = grid.dp_comm  # every rank: a data-parallel replica of the dense part
        # -- EP Step 1: the groups (make_grid); the replicated part and this rank's experts --
        self.ep, self.edp = grid.ep_comm, grid.edp_comm
        self.model = task.build_model()
        for name, block in self.model.layers:
            if name.startswith("blocks."):
                block.mlp = ExpertParallelMoE(args.d_model, args.experts, args.top_k,
                                              args.aux_loss_coef, self.ep, EXCHANGES[args.a2a])
        self.model.init(args.seed)
        named = list(self.model.named_parameters())
        self.experts = [p for n, p in named if ".mlp.experts." in n]
        self.dense = [p for n, p in named if ".mlp.experts." not in n]
        place(self.dense, replicated=[self.world, self.ep])  # the same on every rank
        place(self.experts, split=[self.ep], replicated=[self.edp])
        held = next(m for m in self.model.modules() if isinstance(m, moe.MoE)).held()
        comm.narrate(f"EP Step 1: rank {self.world.rank} is rank {self.ep.rank} of an ep group "
                     f"of {self.ep.size}: experts {[e for e, _ in held]} of every layer, "
                     f"replicated on {self.edp.size} rank(s); the rest on all {self.world.size}")
        self.opt = serial.make_optimizer(args, self.model.parameters())
        self.syncs = [GradSync(self.world, self.dense, grad_sum=args.grad_sum)]
        self.scaler = precision.scaler_for(args)  # fp16's loss scale, or None
        if self.edp.size > 1:
            self.syncs.append(GradSync(self.edp, self.experts, grad_sum=args.grad_sum))
        self.rows = comm.split_rows(args.batch_size, self.world.size)

    def own_rows(self, step):
        """This rank's rows of the global batch (every rank makes it from (seed, step)), as
        micro-batches of (x, y), and the target count of the GLOBAL batch."""
        r, n_rows = self.world.rank, self.rows[self.world.rank]
        lo = sum(self.rows[:r])
        x_host, y_host = self.task.batch(step)
        x, y = self.task.to_device(x_host[lo:lo + n_rows], y_host[lo:lo + n_rows])
        micro = comm.split_rows(n_rows, self.args.micro_batches)
        comm.narrate(f"EP Step 2: rank {r} runs rows {lo}..{lo + n_rows - 1} forward in "
                     f"{len(micro)} micro-batch(es); its routers pick {self.args.top_k} experts "
                     f"a token")
        return [(x[a:a + n], y[a:a + n]) for a, n in zip(comm.offsets(micro), micro)], y_host.size

    def step(self, step):
        self.model.zero_grad()

        # -- EP Step 2: every rank routes its own rows: every micro-batch's forward first --
        micro, normalizer = self.own_rows(step)
        loss = 0.0
        for micro_id, (x, y) in enumerate(micro):
            logits = self.model.forward(x, micro_id)
            loss += self.loss_fn.forward(logits, y, normalizer, micro_id)

        # -- EP Step 7: the aux loss over the global batch: one Allreduce of each layer's routing --
        with comm.step("EP Step 7", "Allreduce of each MoE layer's counts, sums of p and tokens"):
            aux = balance_over(self.world, self.model, len(micro), precision.scale_of(self.scaler))

        # -- EP Step 8: backward, micro-batch by micro-batch (the all-to-alls reversed inside) --
        for micro_id in range(len(micro)):
            dlogits = self.loss_fn.backward(precision.scale_of(self.scaler), micro_id)
            self.model.backward(dlogits, micro_id)

        # -- EP Step 9: replicated gradients summed over all ranks, experts' over their replicas --
        with comm.step("EP Step 9", f"Allreduce of the replicated gradients over "
                                    f"{self.world.size} ranks, the experts' over "
                                    f"{self.edp.size}; every rank updates"):
            for sync in self.syncs:
                sync.finish()
        precision.take_step(self.opt, self.scaler, lambda bad: comm.any_rank(
            self.world, bad, "did any rank's gradients overflow?"))  # (fp16: all skip, or none)
        return sum(self.world.allgather_obj(loss, what="the ranks' losses, to print")) + aux

    def full_params(self):
        """The whole model on world rank 0: its replicated part and the experts of its ep
        group (every ep group holds all of them)."""
        mine = {n: B.to_numpy(p.data).copy() for n, p in self.model.named_parameters()}
        parts = self.ep.gather_obj(mine)  # the ep group's experts to its rank 0
        if self.world.rank != 0:
            return None
        return {n: v for part in parts for n, v in part.items()}

    def buffers(self):
        return [b.flat for sync in self.syncs for b in sync.buckets]


if __name__ == "__main__":  # python -m mpipar.expert_parallel
    from mpipar.runner import hand_over

    hand_over(__name__, "expert_parallel")
