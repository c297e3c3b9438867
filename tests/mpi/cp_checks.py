"""mpirun -n 4 python tests/mpi/cp_checks.py: context parallelism against the serial trainer.

Float64, the GPT (width 16, 4 heads, 2 blocks, 16 tokens; 6 rows: uneven over micro-batches),
3 steps with Adam. For each case (ranks, --cp, --cp-algo, --micro-batches), on every rank:
- every step's loss equals the serial trainer's, and every parameter equals the serial one
  (relative error <= 1e-10): the backward through the ring, the zigzag and the all-to-alls is
  the serial one;
- the copies of every parameter are bitwise identical on every rank;
- the bytes each rank sends in a step, exactly (lessons/formulas.md): per attention layer and
  row, ring and zigzag send K and V (2 n C values, n = T/G) G-1 times forward and G-1 times
  backward (Isend), and dK, dV G times (Sendrecv); Ulysses sends 4 n C (G-1)/G values forward
  and as many backward (Alltoall).
Then two planted mistakes, each of which trains and yet fails the comparison: dK and dV left
on the rank that computed them (never sent home), and a merge of two blocks that keeps the
larger maximum instead of the log-sum-exp (right while a rank has one block to merge).
"""

import sys

from reference import make_task, relative, serial_run, worst_error

from mpipar import context_parallel as X
from mpipar.engine import backend as B
from mpipar.mpi import comm as C

C.install_excepthook()
world = C.world()
RANK = world.rank
STEPS, TOL, W, D, T, L = 3, 1e-10, 8, 16, 16, 2  # W bytes a value, D width, T tokens, L blocks
GPT = ["--model", "gpt", "--d-model", str(D), "--n-heads", "4", "--n-layers", str(L),
       "--seq-len", str(T), "--batch-size", "6", "--optim", "adam", "--dtype", "float64"]
CASES = [(4, 4, "ring", 1), (4, 4, "zigzag", 2), (4, 4, "ulysses", 1), (4, 2, "ring", 2),
         (4, 2, "zigzag", 1), (4, 2, "ulysses", 2), (2, 2, "ring", 1), (2, 2, "zigzag", 1),
         (2, 2, "ulysses", 1), (4, 1, "ring", 1)]
REFS = {}


def fail(what):
    sys.stderr.write(f"[rank {RANK}] FAILED: {what}\n")
    world.mpi.Abort(1)


def reference():
    if "serial" not in REFS:
        REFS["serial"] = serial_run(make_task(GPT), STEPS)[:2]
    return REFS["serial"]


def build(n, cp, algo, micro, cls=X.ContextParallel):
    task = make_task([*GPT, "--cp", str(cp), "--cp-algo", algo, "--micro-batches", str(micro)],
                     "context_parallel", n)
    return cls(task, X.make_grid(cp, world.mpi.Split(RANK // n, RANK)), task.args)


def expected_bytes(t, cp, algo):
    """What this rank sends in one step over its cp group, by operation (the formulas)."""
    rows = t.rows[t.data_rank]  # every micro-batch's rows, added up
    n = T // cp
    kv = 2 * rows * n * D * W  # K and V of this rank's tokens
    if cp == 1:
        return {}
    if algo == "ulysses":
        return {"Alltoall": L * 2 * 4 * rows * n * D * W * (cp - 1) // cp}
    return {"Send": L * 2 * (cp - 1) * kv, "Sendrecv": L * cp * kv}


def check_case(n, cp, algo, micro):
    want_losses, want = reference()
    t = build(n, cp, algo, micro)
    losses = []
    for step in range(STEPS):
        t.cp.reset_stats()
        losses.append(t.step(step))
        for op, nbytes in expected_bytes(t, cp, algo).items():
            if t.cp.stats[op]["sent"] != nbytes:
                fail(f"{(n, cp, algo, micro)} step {step}: {op} sent "
                     f"{t.cp.stats[op]['sent']} bytes, the formula {nbytes}")
        if cp == 1 and t.cp.total("sent"):
            fail("a cp group of one rank sent bytes")
    errs = [abs(a - b) / abs(b) for a, b in zip(losses, want_losses)]
    if max(errs) > TOL:
        fail(f"{(n, cp, algo, micro)}: losses {losses}, serial {want_losses}")
    for name, p in t.model.named_parameters():
        err = relative(B.to_numpy(p.data), want[name])
        if err > TOL:
            fail(f"{(n, cp, algo, micro)}: {name} differs from serial by {err:.2e}")
        if len(set(t.world.allgather_obj(B.to_numpy(p.data).tobytes()))) != 1:
            fail(f"{(n, cp, algo, micro)}: the copies of {name} differ")


class Stay:
    """A cp group whose Sendrecv of dK, dV keeps them where they are."""

    def __init__(self, comm):
        self.comm = comm

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def Sendrecv(self, send, dest, recv, source, what=""):
        if what.startswith("dK, dV"):
            recv[...] = send
        else:
            self.comm.Sendrecv(send, dest, recv, source, what=what)


class DKVLeftBehind(X.ContextParallel):
    """The mistake: each rank keeps the dK, dV it computed instead of sending them home."""

    def __init__(self, task, grid, args):
        super().__init__(task, grid, args)
        for m in self.model.modules():
            if isinstance(m, X.RingAttention):
                m.comm = Stay(m.comm)


def merge_by_max(out, lse, block_out, block_lse):
    """The mistake: the merge weighs by the larger maximum, not by the log-sum-exp."""
    top = B.xp.maximum(lse, block_lse)
    return B.xp.exp(lse - top) * out + B.xp.exp(block_lse - top) * block_out, top


class MergeWithoutLSE(X.ContextParallel):
    def __init__(self, task, grid, args):
        super().__init__(task, grid, args)
        for m in self.model.modules():
            if isinstance(m, X.RingAttention):
                m.merge = merge_by_max


# each mistake with a case it gets wrong: (ranks, --cp, --cp-algo, --micro-batches)
MISTAKES = [(DKVLeftBehind, (4, 4, "ring", 1)), (MergeWithoutLSE, (4, 2, "zigzag", 1))]


for case in CASES:  # a 2-rank case: ranks 0-1 and 2-3, each a job of its own
    check_case(*case)
for mistake, case in MISTAKES:
    err = worst_error(build(*case, cls=mistake), reference()[1], STEPS)
    if not err > 1e3 * TOL:
        fail(f"the planted {mistake.__name__} passed the comparison (error {err:.1e})")
    C.log(f"planted {mistake.__name__}: caught, worst parameter error {err:.1e}")
C.log(f"context-parallel checks passed on {world.size} ranks")
