"""mpirun -n P python tests/mpi/tp_layers.py: each tensor-parallel layer alone against its
dense twin, in float64.

Both are built with the same canonical names (so each shard starts as the slice of the dense
weights), then perturbed by the same noise. Checked on every rank: the output equals the dense
output (or this rank's slice of it), each shard's gradient equals the matching slice of the
dense gradient, replicated gradients and the input gradient equal the dense ones, and the
layer makes exactly the Allreduces its docstring promises.
"""

import sys

import numpy as np

from mpipar.engine import backend as B
from mpipar.engine import nn
from mpipar.engine.parameters import take
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.mpi.trace import TRACE
from mpipar.parts import tp_layers as tp
from mpipar.parts import tp_models as tpm
from mpipar.parts.plan import tp_size_problem
from mpipar.runner.cli import parse_args

TRACE.calls = True  # the checks read each MPI call's span
C.install_excepthook()
B.use("numpy", "float64")
grid = Grid(tp=C.world().size)
tp_comm = grid.tp_comm
P, rank = tp_comm.size, tp_comm.rank
TOL = 1e-12


def close(got, want, what):
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-300)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, dense {want.shape}"
    assert err <= TOL, f"rank {rank}: {what} differs from dense, relative error {err:.3g}"


def twins(dense, par, prefix):
    """Name both alike, give them the same seeded weights plus the same noise."""
    dense.init(3, prefix)
    par.init(3, prefix)
    rng = np.random.default_rng(7)  # the same stream on every rank
    pairs = list(zip(dense.named_parameters(), par.named_parameters()))
    assert len(pairs) == len(dense.parameters()) == len(par.parameters())
    for (n1, pd), (n2, pp) in pairs:
        assert n1 == n2, (n1, n2)
        if tp.is_sharded(pp):
            assert np.array_equal(pp.data, pp.select(pd.data, rank)), f"{n1}: shard init"
        else:
            assert np.array_equal(pp.data, pd.data), f"{n1}: replicated init"
        noise = rng.normal(0, 0.1, pd.shape)
        pd.data += noise
        pp.data += pp.select(noise, rank) if tp.is_sharded(pp) else noise
    return dense, par


def compare_grads(dense, par, what):
    for (name, pd), (_, pp) in zip(dense.named_parameters(), par.named_parameters()):
        want = pp.select(pd.grad, rank) if tp.is_sharded(pp) else pd.grad
        close(pp.grad, want, f"{what}: d{name}")


def allreduce_sizes():
    """Element counts of the Allreduces recorded since the last call."""
    sizes = [e[4]["bytes"] // 8 for e in TRACE.events if e[3] == "Allreduce"]
    TRACE.clear()
    return sizes


def run(dense, par, x, x_local, dout, dout_local, what, fwd_sizes, bwd_sizes, dx_local=None):
    """Forward and backward through both; compare outputs, gradients and messages."""
    TRACE.clear()
    y_par = par.forward(x_local, micro_id=5)
    assert allreduce_sizes() == (fwd_sizes if P > 1 else []), f"{what}: forward Allreduces"
    y = dense.forward(x)
    close(y_par, y if dout_local is None else dout_local(y), f"{what}: output")
    dense.zero_grad()
    par.zero_grad()
    dx = dense.backward(dout)
    dx_par = par.backward(dout if dout_local is None else dout_local(dout), micro_id=5)
    assert allreduce_sizes() == (bwd_sizes if P > 1 else []), f"{what}: backward Allreduces"
    if dx is not None:
        close(dx_par, dx if dx_local is None else dx_local(dx), f"{what}: input gradient")
    compare_grads(dense, par, what)
    for m in par.modules():
        assert not m._cache, f"{what}: cache left in {type(m).__name__}"


def cols(a, ranges):
    return take(a, ["axis", a.ndim - 1, ranges[rank]])


rng = np.random.default_rng(11)
Bn, T, Cw, H, V = 2, 5, 8, 4, 11  # V = 11: uneven vocabulary blocks for 2 and 4 ranks
x = rng.standard_normal((Bn, T, Cw))
n = Bn * T

# -- ColumnParallelLinear: output stays split, or is gathered
dense, par = twins(nn.Linear(Cw, 12), tp.ColumnParallelLinear(Cw, 12, tp_comm), "col.")
r12 = tp.blocks(12, P)
dout = rng.standard_normal((Bn, T, 12))
run(dense, par, x, x, dout, lambda a: cols(a, r12), "ColumnParallelLinear", [], [n * Cw])
dense, par = twins(nn.Linear(Cw, 12),
                   tp.ColumnParallelLinear(Cw, 12, tp_comm, gather_output=True), "colg.")
TRACE.clear()
run(dense, par, x, x, dout, None, "ColumnParallelLinear(gather_output)", [], [n * Cw])
dense, par = twins(nn.Linear(Cw, 12, input_grad=False),
                   tp.ColumnParallelLinear(Cw, 12, tp_comm, input_grad=False), "col0.")
run(dense, par, x, x, dout, lambda a: cols(a, r12), "ColumnParallelLinear(no dx)", [], [])

# -- RowParallelLinear: input arrives split, output summed
dense, par = twins(nn.Linear(12, Cw), tp.RowParallelLinear(12, Cw, tp_comm), "row.")
x12 = rng.standard_normal((Bn, T, 12))
run(dense, par, x12, cols(x12, r12), rng.standard_normal((Bn, T, Cw)), None,
    "RowParallelLinear", [n * Cw], [], dx_local=lambda a: cols(a, r12))

# -- the transformer's pieces: whole (B, T, C) in and out
dout = rng.standard_normal((Bn, T, Cw))
dense, par = twins(nn.FeedForward(Cw), tpm.ParallelFeedForward(Cw, tp_comm), "mlp.")
run(dense, par, x, x, dout, None, "ParallelFeedForward", [n * Cw], [n * Cw])
dense, par = twins(nn.CausalSelfAttention(Cw, H),
                   tpm.ParallelCausalSelfAttention(Cw, H, tp_comm), "attn.")
run(dense, par, x, x, dout, None, "ParallelCausalSelfAttention", [n * Cw], [n * Cw])
qkv_cols = tp.head_columns(Cw, P)[rank]
assert sorted(b - a for a, b in qkv_cols) == [Cw // P] * 3 and qkv_cols[1][0] >= Cw, qkv_cols
dense, par = twins(nn.Block(Cw, H), tpm.ParallelBlock(Cw, H, tp_comm), "blk.")
run(dense, par, x, x, dout, None, "ParallelBlock", [n * Cw] * 2, [n * Cw] * 2)

# two micro-batches in flight: backward of each must use its own activations
x2, dout2 = rng.standard_normal((Bn, T, Cw)), rng.standard_normal((Bn, T, Cw))
dense.zero_grad()
par.zero_grad()
ya, yb = par.forward(x, micro_id=0), par.forward(x2, micro_id=1)
close(ya, dense.forward(x), "ParallelBlock micro 0")
close(yb, dense.forward(x2, micro_id=1), "ParallelBlock micro 1")
close(par.backward(dout2, micro_id=1), dense.backward(dout2, micro_id=1), "dx micro 1")
close(par.backward(dout, micro_id=0), dense.backward(dout, micro_id=0), "dx micro 0")
compare_grads(dense, par, "ParallelBlock, two micro-batches")

# -- vocabulary-parallel embedding (ids repeat, every shard is hit)
idx = np.array([[0, 10, 4, 4, 7], [3, 10, 1, 9, 5]])
dense, par = twins(nn.GPTEmbedding(V, Cw, T), tpm.ParallelGPTEmbedding(V, Cw, T, tp_comm), "emb.")
run(dense, par, idx, idx, dout, None, "ParallelGPTEmbedding", [n * Cw], [])
lo, hi = par.tok.lo, par.tok.hi
assert hi - lo in (V // P, V // P + 1) and par.tok.W.shape == (hi - lo, Cw)

# -- head + vocabulary-parallel cross-entropy against head + dense cross-entropy
targets = np.array([[0, 10, 2, 2, 6], [9, 1, 10, 3, 8]])
dense, par = twins(nn.GPTHead(Cw, V), tpm.ParallelGPTHead(Cw, V, tp_comm), "head.")
ce, pce = nn.SoftmaxCrossEntropy(), tp.VocabParallelCrossEntropy(V, tp_comm)
rV = tp.blocks(V, P)
TRACE.clear()
logits_local = par.forward(x, micro_id=2)
loss_par = pce.forward(logits_local, targets, normalizer=17, micro_id=2)
assert allreduce_sizes() == ([n] * 3 if P > 1 else []), "cross-entropy"
logits = dense.forward(x)
close(logits_local, cols(logits, rV), "head logits")
loss = ce.forward(logits, targets, normalizer=17)
assert abs(loss_par - loss) <= TOL * abs(loss), (loss_par, loss)
dense.zero_grad()
par.zero_grad()
dlogits = ce.backward()
dlogits_par = pce.backward(micro_id=2)
close(dlogits_par, cols(dlogits, rV), "cross-entropy dlogits")
close(par.backward(dlogits_par, micro_id=2), dense.backward(dlogits), "head input gradient")
assert allreduce_sizes() == ([n * Cw] if P > 1 else []), "head backward"
compare_grads(dense, par, "ParallelGPTHead")

# -- refusals name the number and what would work (pure: same answer on every rank)
def problem(argv, t, vocab=None):
    return tp_size_problem(parse_args("serial", argv, n_ranks=1), t, vocab)


msg = problem(["--model", "gpt", "--d-model", "12", "--n-heads", "6"], 4, 94)
assert "head count --n-heads 6" in msg and "1, 2, 3, 6" in msg, msg
msg = problem(["--model", "gpt", "--d-model", "18", "--n-heads", "2"], 4, 94)
assert "hidden size --d-model 18" in msg and "divide it: 1, 2 (or make it 16 or 20" in msg, msg
# (only rank counts that also divide the 2 heads, and widths the 2 heads divide)
msg = problem(["--model", "mlp", "--sizes", "64,32,30,10"], 4)
assert msg is None, msg  # 30 is the input of the row-parallel fc1: not split by columns
msg = problem(["--model", "mlp", "--sizes", "64,32,16,30,10"], 4)
assert "entry 3" in msg and "30" in msg and "28 or 32" in msg, msg
msg = problem(["--model", "gpt", "--d-model", "16", "--n-heads", "4"], 4, 3)
assert "vocabulary has 3" in msg, msg
assert problem(["--model", "gpt", "--d-model", "16", "--n-heads", "4"], 4, 94) is None

# -- a target outside the vocabulary is refused on every rank, before any Allreduce
(lo, hi), = tp.blocks(94, P)[rank]
for bad in (-1, 94):
    targets = np.zeros((2, 3), dtype=np.int64)
    targets[1, 2] = bad
    try:
        tp.VocabParallelCrossEntropy(94, tp_comm).forward(np.zeros((2, 3, hi - lo)), targets)
    except ValueError as err:
        assert f"target {bad} is out of range" in str(err), err
    else:
        raise AssertionError(f"target {bad} accepted by the vocabulary-parallel loss")

tp_comm.Barrier()
if rank == 0:
    print(f"tp layer checks passed on {P} ranks", flush=True)
sys.exit(0)
