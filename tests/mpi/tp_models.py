"""mpirun -n P python tests/mpi/tp_models.py: whole tensor-parallel models against the serial
trainer in the same process, float64, for the GPT and two MLPs, with both update modes.

Checked on every rank:
- after 3 steps the gathered full parameters equal the serial ones (relative error <= 1e-10),
  and --update local and --update master give bitwise the same parameters;
- replicated parameters are bitwise identical across the ranks after every step;
- the Allreduces of a step, in order and size, are exactly the formula, and so are the
  counted bytes (Comm.stats); master mode adds exactly one Gatherv, Scatterv and Bcast.
"""

import hashlib
import sys

import numpy as np
from reference import make_task

from mpipar import serial
from mpipar import tensor_parallel as tp
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.mpi.trace import TRACE
from mpipar.parts.tp_layers import split_parameters

TRACE.calls = True  # the checks read each MPI call's span
C.install_excepthook()
grid = Grid(tp=C.world().size)
tp_comm = grid.tp_comm
P, rank = tp_comm.size, tp_comm.rank
STEPS, TOL, W = 3, 1e-10, 8  # W: bytes per float64

GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2",
       "--seq-len", "8", "--batch-size", "4"]
CONFIGS = [GPT, ["--model", "mlp", "--sizes", "64,32,16,10", "--batch-size", "12"],
           ["--model", "mlp", "--sizes", "64,32,16,24,10", "--batch-size", "12"]]


def expected_allreduces(args):
    """Element counts of one step's Allreduces, in the order they happen."""
    if args.model == "gpt":
        bsh, bs, L = args.batch_size * args.seq_len * args.d_model, \
            args.batch_size * args.seq_len, args.n_layers
        # forward: embedding, 2 per block, 3 for the cross-entropy; backward: 2 per block and
        # the output layer's input gradient
        return [bsh] + [bsh] * 2 * L + [bs] * 3 + [bsh] * 2 * L + [bsh]
    s, b, n = args.sizes, args.batch_size, len(args.sizes) - 1
    fwd = [b * s[i + 1] for i in range(1, n, 2)]  # row-parallel outputs
    bwd = [b * s[i] for i in range(n - 1, 0, -1) if i % 2 == 0 and i + 1 < n]  # column dx
    return fwd + bwd


def rel_err(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def check_traffic(args, update, shards, replicated):
    sizes = [e[4]["bytes"] // W for e in TRACE.events if e[3] == "Allreduce"]
    want = expected_allreduces(args) if P > 1 else []
    assert sizes == want, f"{args.model} {update}: Allreduces {sizes}, formula {want}"
    s = tp_comm.stats
    assert s["Allreduce"]["calls"] == len(want)
    assert s["Allreduce"]["sent"] == s["Allreduce"]["recv"] == W * sum(want)
    ops = {op for op, v in s.items() if v["calls"]}
    if update == "local":
        assert ops <= {"Allreduce"}, ops
        return
    assert ops == ({"Allreduce"} if want else set()) | {"Gatherv", "Scatterv"} \
        | ({"Bcast"} if replicated else set()), ops
    mine = W * sum(p.size for p in shards)
    total = W * sum(int(np.prod(p.full_shape)) for p in shards)
    if rank == 0:  # the master receives and sends every other rank's shards
        assert s["Gatherv"]["recv"] == s["Scatterv"]["sent"] == total - mine
        assert s["Bcast"]["sent"] == (P - 1) * W * sum(p.size for p in replicated)
    else:
        assert s["Gatherv"]["sent"] == s["Scatterv"]["recv"] == mine
        assert s["Bcast"]["recv"] == W * sum(p.size for p in replicated)
    assert all(s[op]["calls"] == 1 for op in ("Gatherv", "Scatterv"))


def run(argv, update):
    task = make_task(argv + ["--dtype", "float64", "--update", update], "tensor_parallel", P)
    args = task.args
    ref = task.build_model().init(args.seed)
    ref_opt = serial.make_optimizer(args, ref.parameters())
    trainer = tp.TensorParallel(task, grid, args)
    model = trainer.model
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], "canonical names differ"
    assert [n for n, _ in model.layers] == [n for n, _ in ref.layers], "layer names differ"
    shards, replicated = split_parameters(model)
    assert len(shards) > 0
    for step in range(STEPS):
        x, y = task.to_device(*task.batch(step))
        ref_loss = serial.train_step(ref, task.loss_fn, ref_opt, x, y)
        tp_comm.reset_stats()
        TRACE.clear()
        loss = trainer.step(step)
        assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss), (step, loss, ref_loss)
        if step == 0:
            check_traffic(args, update, shards, replicated)
        digests = [hashlib.sha256(p.data.tobytes()).hexdigest() for p in replicated]
        for other in tp_comm.allgather_obj(digests):
            assert other == digests, f"{args.model} {update} step {step}: replicas differ"
    full = trainer.full_params()
    if rank == 0:
        assert list(full) == names
        for name, p in ref.named_parameters():
            err = rel_err(full[name], p.data)
            assert err <= TOL, f"{args.model} P={P} {update}: {name} rel. error {err:.3g}"
        # the comparison catches a one-element slip of 1e-9
        name = names[len(names) // 2]
        bad = full[name].copy()
        bad.flat[bad.size // 2] += 1e-9 * np.abs(bad).max()
        assert rel_err(bad, dict(ref.named_parameters())[name].data) > TOL
    return full


for argv in CONFIGS:
    local, master = run(argv, "local"), run(argv, "master")
    if rank == 0:
        for name in local:
            assert np.array_equal(local[name], master[name]), f"{argv[1]}: {name} local/master"

tp_comm.Barrier()
if rank == 0:
    print(f"tp model checks passed on {P} ranks", flush=True)
sys.exit(0)
