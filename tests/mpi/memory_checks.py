"""mpirun -n P python tests/mpi/memory_checks.py: the memory ledger (mpipar.runner.memory) of every
scheme against the formulas, in float32 with Adam, as exact equalities of bytes per rank.

n parameters, 4 bytes a value, s = ceil(n / P) values per ZeRO shard (P s with the padding):

    data parallel   parameters      gradients       Adam (m, v)   buffers kept between steps
    ZeRO-0          4n              4n              8n            4n: Step 1's Bcast buffer
    ZeRO-1          4Ps             4Ps             8s            0
    ZeRO-2          4Ps             4s              8s            0
    ZeRO-3          4s (per layer)  4s              8s            0

that is 4 + 4 + 8/P bytes per parameter (ZeRO-1), 4 + (4 + 8)/P (ZeRO-2), (4 + 4 + 8)/P
(ZeRO-3), plus the padding (Ps - n < P values): a shard's data and ZeRO-1's summed gradient
are views into the padded whole buffers, not copies; during a ZeRO-2 step the whole padded
gradient (4Ps) more, during a ZeRO-3 step one layer's full parameters and gradient (the
largest layer's, 4 P s_layer each) more; with prefetch (--overlap) two adjacent layers'
parameters (the largest pair's) and still one layer's gradient. Tensor parallel:
each shard 1/t of its tensor (the vocabulary in near-equal blocks), replicated tensors whole;
the master of --update master the whole model more. Pipeline: its stage's layers; with
--recompute its stash is one input per micro-batch in flight (the first stage's inputs are
views into the batch, which stays whole), plus on the last stage the loss's cache of as many
micro-batches. One value (4 bytes) or one array more or less anywhere fails.
"""

import numpy as np
from reference import make_task

from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.parts.schedules import peak_in_flight
from mpipar.parts.tp_layers import is_sharded
from mpipar.runner import memory, recompute
from mpipar.train import trainer_class

C.install_excepthook()
P, r = C.world().size, C.world().rank
F, ID = 4, 8  # bytes of a float32 value, of an int64 token id
ADAM = ["--dtype", "float32", "--optim", "adam", "--quiet"]
MLP = ["--model", "mlp", "--sizes", "64,16,12,10", "--batch-size", "12", "--lr", "0.01"]
GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--seq-len", "8"]
VOCAB_SPLIT = {"embed.tok.W", "head.out.W", "head.out.b"}  # split by the vocabulary's blocks


def ceil_div(a, b):
    return -(-a // b)


def ledger(scheme, flags, grid, steps=2):
    """Train ``steps`` steps with a probe on the first; the trainer and this rank's ledger."""
    task = make_task(flags + ADAM, scheme, P)
    trainer = trainer_class(scheme, task.args)(task, grid, task.args)
    if task.args.recompute:
        recompute.apply(trainer)
    probe = memory.Probe(trainer)
    for step in range(steps):
        trainer.step(step)
    assert not probe.wrapped and "step" not in vars(trainer), "the probe stayed in place"
    assert not any(name in vars(unit) for unit in memory.units_of(trainer)
                   for name in memory.CALLS), "a layer stayed wrapped"
    return task, trainer, probe.ledger()


def layer_sizes(task):
    return [sum(p.size for p in layer.parameters()) for _, layer in task.build_model().layers]


def states(params, grads, optimizer, buffers):
    return dict(params=params, grads=grads, optimizer=optimizer, buffers=buffers)


def check_data_parallel():
    grid, stash, peaks = Grid(dp=P), [], []
    for zero in (0, 1, 2, 3):
        task, dp, got = ledger("data_parallel", MLP + ["--sync", "allreduce", "--zero", str(zero)],
                               grid)
        sizes = [k for k in layer_sizes(task) if k]
        n, s = sum(sizes), ceil_div(sum(sizes), P)
        s3 = [ceil_div(k, P) for k in sizes]  # ZeRO-3: one shard per layer
        want = {0: states(F * n, F * n, 2 * F * n, F * n),
                1: states(F * P * s, F * P * s, 2 * F * s, 0),
                2: states(F * P * s, F * s, 2 * F * s, 0),
                3: states(F * sum(s3), F * sum(s3), 2 * F * sum(s3), 0)}[zero]
        assert {k: got[k] for k in want} == want, (zero, got, want)
        in_step = {0: (F * n, F * n), 1: (F * P * s, F * P * s),
                   2: (F * P * s, F * (s + P * s)),  # the whole padded gradient
                   3: (F * (sum(s3) + P * max(s3)),) * 2}[zero]  # one layer's, the largest
        assert (got["step_params"], got["step_grads"]) == in_step, (zero, got, in_step)
        assert got["peak"] >= sum(got[k] for k in ("params", "grads", "optimizer")), got
        stash.append(got["activations"])
        peaks.append((got["peak"], s))
    # ZeRO-0 to -2 run the replica's forward and backward; ZeRO-3 the same layers one by one,
    # each backward whole, so it stashes no more
    assert stash[0] == stash[1] == stash[2] >= stash[3] > 0, stash
    # the step peaks: ZeRO-1 below ZeRO-0 (no Bcast buffer, 8n - 8s less Adam state, at most
    # P - 1 padding values more); ZeRO-2 that plus its summed gradient shard (the full padded
    # gradient lives through the backward, as ZeRO-1's does)
    (p0, _), (p1, s), (p2, _) = peaks[:3]
    assert p0 - p1 == F * n + 2 * F * (n - s) - 2 * F * (P * s - n), peaks
    assert p2 - p1 == F * s, peaks
    # ZeRO-3 with prefetch (--overlap): a layer's parameters arrive while its neighbour runs,
    # so two adjacent layers' full parameters are held at once, not one; the rest unchanged
    _, _, pre = ledger("data_parallel", MLP + ["--sync", "allreduce", "--zero", "3",
                                               "--overlap"], grid)
    pairs = max(a + b for a, b in zip(s3, s3[1:]))
    assert pre["step_params"] == F * (sum(s3) + P * pairs), (pre, s3)
    assert pre["step_grads"] == got["step_grads"] and pre["peak"] >= got["peak"], (pre, got)
    assert {k: pre[k] for k in KEYS} == {k: got[k] for k in KEYS}, (pre, got)
    task, dp, got = ledger("data_parallel", MLP + ["--sync", "master"], grid)
    n = sum(layer_sizes(task))
    want = states(F * n, F * n, 2 * F * n, 2 * F * n) if r == 0 else states(F * n, F * n, 0, F * n)
    assert {k: got[k] for k in want} == want, ("master", got, want)  # rank 0: flat and flat_sum


def check_serial():
    task, _, got = ledger("serial", MLP, None)
    n = sum(layer_sizes(task))
    assert {k: got[k] for k in KEYS} == states(F * n, F * n, 2 * F * n, 0), got


def check_tensor_parallel():
    grid = Grid(tp=P)
    for update in ("local", "master"):
        task, tp, got = ledger("tensor_parallel", GPT + ["--n-layers", "2", "--batch-size", "4",
                                                         "--update", update], grid)
        vocab, mine = task.data.vocab, dict(tp.model.named_parameters())
        local = 0
        for name, p in task.build_model().named_parameters():
            if not is_sharded(mine[name]):
                local += F * p.size  # replicated: whole
            elif name in VOCAB_SPLIT:
                local += F * p.size * C.split_rows(vocab, P)[r] // vocab
            else:
                local += F * p.size // P
        n = sum(layer_sizes(task))
        master = update == "master" and r == 0  # the master's full copy and the optimizer
        want = states(local + master * F * n, local + master * F * n,
                      2 * (F * n if master else local if update == "local" else 0), 0)
        assert {k: got[k] for k in want} == want, (update, got, want)


def check_pipeline():
    grid = Grid(pp=P)
    flags = GPT + ["--n-layers", "4", "--batch-size", "8", "--micro-batches", "4",
                   "--timeline", "none"]
    _, _, plain = ledger("pipeline", flags, grid)
    task, pipe, got = ledger("pipeline", flags + ["--recompute"], grid)
    lo, hi = pipe.bounds[r]
    share = F * sum(layer_sizes(task)[lo:hi])
    for g in (plain, got):
        assert {k: g[k] for k in KEYS} == states(share, share, 2 * share, 0), g
    a, k = task.args, peak_in_flight(pipe.schedule_of(r))
    rows, T, d, V = a.batch_size // a.micro_batches, a.seq_len, a.d_model, task.data.vocab
    inputs = a.batch_size * T * ID if r == 0 else k * rows * T * d * F
    loss = k * rows * T * (V + 1) * F + a.batch_size * T * ID if r == P - 1 else 0  # z, lse, y
    assert got["activations"] == inputs + loss, (r, k, got, inputs, loss)
    if 0 < r < P - 1:  # the pipeline's own measurement (by array, not by buffer) agrees
        assert got["activations"] == pipe.peak_stash_bytes, (got, pipe.peak_stash_bytes)
    assert got["activations"] < plain["activations"], (got, plain)


def check_hybrid():
    """dp 2 x pp 2: the gradients are views into the dp buckets, counted once, as gradients;
    with --zero 1 the optimizer state is halved."""
    grid = Grid(dp=2, pp=2)
    task, hy, got = ledger("hybrid", GPT + ["--n-layers", "2", "--batch-size", "8",
                                            "--dp", "2", "--pp", "2"], grid)
    lo, hi = hy.bounds[hy.stage_id]
    share = F * sum(layer_sizes(task)[lo:hi])
    assert all(np.shares_memory(p.grad, hy.update.sync.buckets[0].flat) or len(
        hy.update.sync.buckets) > 1 for p in hy.stage.parameters())
    assert {k: got[k] for k in KEYS} == states(share, share, 2 * share, 0), got
    # --zero 1: the stage's parameters and gradients as views into padded flat buffers of 2 s
    # values, 1/2 of Adam's state: 4 + 4 + 8/2 bytes per parameter, plus the padding
    _, hy, got = ledger("hybrid", GPT + ["--n-layers", "2", "--batch-size", "8", "--dp", "2",
                                         "--pp", "2", "--zero", "1"], grid)
    s = hy.update.zero.shard_size
    assert 0 <= 2 * s * F - share < 2 * F, (s, share)
    assert {k: got[k] for k in KEYS} == states(2 * F * s, 2 * F * s, 2 * F * s, 0), got


KEYS = ("params", "grads", "optimizer", "buffers")
check_data_parallel()
if P == 1:
    check_serial()
if P in (2, 4):
    check_tensor_parallel()
check_pipeline()
if P == 4:
    check_hybrid()
C.log(f"memory checks passed on {P} ranks")
