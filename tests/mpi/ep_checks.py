"""mpirun -n 4 python tests/mpi/ep_checks.py: expert parallelism against the serial trainer.

Float64, the mixture-of-experts GPT (8 experts a block, top-2; 11 rows: uneven over the ranks),
3 steps with Adam and a large aux-loss coefficient, so that the load-balancing loss moves the
routers. For each case (ranks, --ep, --a2a, --micro-batches), checked on every rank:
- every step's loss equals the serial trainer's, and every parameter this rank holds equals
  the serial one (relative error <= 1e-10); the model gathered to rank 0 is the whole serial
  model under its names;
- the copies of a parameter are bitwise identical: the replicated part on every rank, each
  expert on its replicas;
- the bytes each rank sends in the step's all-to-alls, exactly: the dispatch and the gradients
  to the experts each send the pairs this rank routed to experts on other ranks, the combine
  and the gradients back each send the pairs other ranks routed to this rank's experts, a row
  of C float64 values each (counted from every rank's routing); and the Alltoall of the counts
  moves E/G counts to each other rank per layer and micro-batch;
- MPI's Alltoallv and the pairwise Sendrecv exchange give the same parameters bit for bit.
Then two planted mistakes, each of which trains and yet fails the comparison: the aux loss
computed per micro-batch (each micro-batch's backward right after its forward), and the
experts' gradients summed over every rank instead of over their replicas.
"""

import sys

import numpy as np
from reference import make_task, relative, serial_run, worst_error

from mpipar import expert_parallel as X
from mpipar.data_parallel import GradSync
from mpipar.engine import backend as B
from mpipar.engine import moe
from mpipar.mpi import comm as C

C.install_excepthook()
world = C.world()
RANK = world.rank
STEPS, TOL, W, D = 3, 1e-10, 8, 16  # W: bytes per float64, D: the model's width
GPT = ["--model", "gpt", "--experts", "8", "--top-k", "2", "--aux-loss-coef", "0.5",
       "--d-model", str(D), "--n-heads", "2", "--n-layers", "2", "--seq-len", "8",
       "--batch-size", "11", "--optim", "adam", "--dtype", "float64"]
CASES = [(4, 4, "mpi", 1), (4, 4, "pairwise", 1), (4, 2, "mpi", 1), (4, 2, "pairwise", 2),
         (4, 1, "mpi", 1), (2, 2, "mpi", 2), (2, 2, "pairwise", 2), (4, 4, "mpi", 2)]
REFS = {}


def fail(what):
    sys.stderr.write(f"[rank {RANK}] FAILED: {what}\n")
    world.mpi.Abort(1)


def sub_grid(n, ep):
    """The scheme's grid over n ranks: ranks 0..n-1, n..2n-1, ... each a job of their own."""
    return X.make_grid(ep, world.mpi.Split(RANK // n, RANK))


def reference():
    if "serial" not in REFS:
        REFS["serial"] = serial_run(make_task(GPT), STEPS)[:2]
    return REFS["serial"]


def build(n, ep, a2a, micro, cls=X.ExpertParallel):
    task = make_task([*GPT, "--ep", str(ep), "--a2a", a2a, "--micro-batches", str(micro)],
                     "expert_parallel", n)
    return cls(task, sub_grid(n, ep), task.args)


def routed_pairs_sent(trainer):
    """Wrap every layer's run_experts to count, from the routing of every rank of the ep
    group, the pairs this rank sends to experts on other ranks and those other ranks send to
    this rank's experts."""
    count = [0]
    for layer in [m for m in trainer.model.modules() if isinstance(m, X.ExpertParallelMoE)]:
        mine = {e for e, _ in layer.held()}

        def run(h, p, rows, micro_id, layer=layer, mine=mine, run=layer.run_experts):
            table = layer.comm.allgather_obj([len(r) for r in rows])  # [rank][expert]
            me = layer.comm.rank
            count[0] += sum(n for e, n in enumerate(table[me]) if e not in mine)  # out
            count[0] += sum(row[e] for s, row in enumerate(table) if s != me for e in mine)
            return run(h, p, rows, micro_id)
        layer.run_experts = run
    return count


def check_case(n, ep, a2a, micro):
    want_losses, want = reference()
    t = build(n, ep, a2a, micro)
    sent = routed_pairs_sent(t)
    losses = []
    for step in range(STEPS):
        t.ep.reset_stats()
        before = sent[0]
        losses.append(t.step(step))
        op = "Alltoallv" if a2a == "mpi" else "Sendrecv"
        pairs = sent[0] - before
        got = t.ep.stats[op]["sent"] if ep > 1 else 0
        if ep > 1 and got != 2 * pairs * D * W:
            fail(f"{(n, ep, a2a, micro)} step {step}: {op} sent {got} bytes, the {pairs} "
                 f"pairs between this rank and experts elsewhere make {2 * pairs * D * W}")
        counts = t.ep.stats["Alltoall"]["sent"]
        if counts != 2 * micro * (ep - 1) * (8 // ep) * 8:
            fail(f"{(n, ep, a2a, micro)}: the counts' Alltoall sent {counts} bytes")
    if ep == 1 and (t.ep.stats["Alltoallv"]["sent"] or t.ep.stats["Sendrecv"]["sent"]):
        fail("an ep group of one rank sent rows")
    errs = [abs(a - b) / abs(b) for a, b in zip(losses, want_losses)]
    if max(errs) > TOL:
        fail(f"{(n, ep, a2a, micro)}: losses {losses}, serial {want_losses}")
    for name, p in t.model.named_parameters():
        err = relative(B.to_numpy(p.data), want[name])
        if err > TOL:
            fail(f"{(n, ep, a2a, micro)}: {name} differs from serial by {err:.2e}")
        copies = (t.edp if ".mlp.experts." in name else t.world).allgather_obj(
            B.to_numpy(p.data).tobytes())
        if len(set(copies)) != 1:
            fail(f"{(n, ep, a2a, micro)}: the copies of {name} differ")
    full = t.full_params()
    if t.world.rank == 0 and sorted(full) != sorted(want):
        fail(f"{(n, ep, a2a, micro)}: gathered {sorted(set(want) ^ set(full))[:3]} wrong")
    return {name: B.to_numpy(p.data).copy() for name, p in t.model.named_parameters()}


class AuxPerMicroBatch(X.ExpertParallel):
    """The mistake: each micro-batch's aux loss from its own routing (1F1B's order)."""

    def step(self, step):
        self.model.zero_grad()
        micro, normalizer = self.own_rows(step)
        loss = 0.0
        for micro_id, (x, y) in enumerate(micro):
            logits = self.model.forward(x, micro_id)
            loss += self.loss_fn.forward(logits, y, normalizer, micro_id)
            loss += moe.balance(self.model, lambda s: self.world.Allreduce(s)) / len(micro)
            self.model.backward(self.loss_fn.backward(1.0, micro_id), micro_id)
        for sync in self.syncs:
            sync.finish()
        self.opt.step()
        return sum(self.world.allgather_obj(loss))


class ExpertsOverEveryRank(X.ExpertParallel):
    """The mistake: the experts' gradients summed over the whole world, not their replicas."""

    def __init__(self, task, grid, args):
        super().__init__(task, grid, args)
        self.syncs = [GradSync(self.world, self.dense), GradSync(self.world, self.experts)]


# each mistake with a case it gets wrong: (ranks, --ep, --a2a, --micro-batches)
MISTAKES = [(AuxPerMicroBatch, (4, 4, "mpi", 2)), (ExpertsOverEveryRank, (4, 2, "mpi", 1))]


results = {case: check_case(*case) for case in CASES}  # a 2-rank case: ranks 0-1 and 2-3
for (n, ep, a2a, micro), got in results.items():
    other = results.get((n, ep, "pairwise", micro)) if a2a == "mpi" else None
    if other is not None and any(not np.array_equal(got[k], other[k]) for k in got):
        fail(f"MPI's and the pairwise all-to-all differ for {(n, ep, micro)}")
for mistake, case in MISTAKES:
    err = worst_error(build(*case, cls=mistake), reference()[1], STEPS)
    if not err > 1e3 * TOL:
        fail(f"the planted {mistake.__name__} passed the comparison (error {err:.1e})")
    C.log(f"planted {mistake.__name__}: caught, worst parameter error {err:.1e}")
C.log(f"expert-parallel checks passed on {world.size} ranks")
