"""mpirun -n 2 (or 4) python tests/mpi/strict_checks.py FOLDER: the distributed schemes on an
array module that refuses implicit host conversions (tests/strict_xp.py, CuPy's rules on NumPy).

Every MPI call stages device arrays through host buffers (``backend.host``, ``host_out`` and
``copy_back``, called by mpipar.mpi.comm); with CuPy that is the only way an array reaches MPI.
For each scheme below, the trainer is built twice in float64 from the same flags, once on
NumPy and once on the strict module (set after ``parse_args``, which selects NumPy), and run
for 2 steps; the strict one must hold strict arrays, and the full parameters gathered to rank 0
must equal NumPy's bit for bit (the strict module computes with NumPy, so any difference is a
path that runs differently on a device). On 2 ranks: data parallelism (master, ring,
allreduce with buckets, overlap and clipping, ZeRO-1, -2 and -3 with the memory ledger),
tensor parallelism (with sequence parallelism and recomputation), the pipeline (GPipe, 1F1B,
interleaved, ZB-H1), the hybrid's data parallelism; on 4 ranks the hybrid with dp=2, tp=2 and
with dp=2, pp=2. Where the flags name ``--checkpoint``, the trainer saves into FOLDER after the
steps and a new trainer resumes from there and takes one step more.

The pipeline's message headers are NumPy arrays even under CuPy (mpipar/pipeline.py >
send_tensor): ``backend.host_out`` and ``host`` pass a host array through untouched. Before
they did, the posted receive path (any MPIPAR_WAIT but spin) took a header for a device array
and ``copy_back`` wrote a device array into it: a TypeError, as CuPy's would be. The test runs
2 ranks with MPIPAR_WAIT=spin and 4 with MPIPAR_WAIT=backoff, so both paths are taken.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the strict module
import strict_xp  # noqa: E402

from mpipar import serial
from mpipar.engine import backend as B
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.runner import checkpoint, clip, memory, recompute
from mpipar.runner.cli import parse_args
from mpipar.train import trainer_class

C.install_excepthook()
N, RANK = C.world().size, C.world().rank
STEPS = 2
MLP = ["--model", "mlp", "--sizes", "64,16,16,10", "--batch-size", "10", "--lr", "0.1"]
GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "2", "--n-layers", "2",
       "--seq-len", "8", "--batch-size", "4"]
BUCKET = ["--bucket-mb", "0.002"]  # 2 KiB: several buckets
CHECKS = [  # (name, scheme, flags, grid)
    ("dp master", "data_parallel", MLP + ["--sync", "master"], dict(dp=N)),
    ("dp ring", "data_parallel", GPT + ["--sync", "ring"], dict(dp=N)),
    ("dp allreduce, buckets, overlap, clipping", "data_parallel",
     GPT + ["--sync", "allreduce", *BUCKET, "--overlap", "--clip-grad", "0.05"], dict(dp=N)),
    ("dp zero 1, checkpoint", "data_parallel",
     MLP + ["--sync", "allreduce", "--zero", "1", "--optim", "adam", "--checkpoint", "ckpt"],
     dict(dp=N)),
    ("dp zero 2", "data_parallel", MLP + ["--sync", "allreduce", "--zero", "2", "--optim", "adam"],
     dict(dp=N)),
    ("dp zero 3, memory ledger", "data_parallel",
     GPT + ["--sync", "allreduce", "--zero", "3", "--optim", "adam", "--memory"], dict(dp=N)),
    ("tp gpt, checkpoint", "tensor_parallel", GPT + ["--checkpoint", "ckpt"], dict(tp=N)),
    ("tp gpt, sequence parallel, recompute", "tensor_parallel",
     GPT + ["--sequence-parallel", "--recompute", "full"], dict(tp=N)),
    ("pp gpipe mlp", "pipeline", MLP + ["--schedule", "gpipe", "--micro-batches", "2"],
     dict(pp=N)),
    ("pp 1f1b gpt, checkpoint", "pipeline",
     GPT + ["--schedule", "1f1b", "--micro-batches", "2", "--checkpoint", "ckpt"], dict(pp=N)),
    ("pp interleaved mlp", "pipeline",
     MLP + ["--schedule", "interleaved", "--micro-batches", "4"], dict(pp=N)),
    ("pp zb-h1 gpt", "pipeline", GPT + ["--schedule", "zb-h1", "--micro-batches", "4"],
     dict(pp=N)),
    ("hybrid dp", "hybrid", GPT + ["--dp", str(N), "--tp", "1", "--pp", "1"], dict(dp=N)),
] if N == 2 else [  # 4 ranks: the hybrid's replicas of a tensor-parallel model
    ("hybrid dp=2 tp=2", "hybrid", GPT + ["--dp", "2", "--tp", "2", "--pp", "1"],
     dict(dp=2, tp=2, pp=1)),
    ("hybrid dp=2 pp=2", "hybrid", GPT + ["--dp", "2", "--tp", "1", "--pp", "2"],
     dict(dp=2, tp=1, pp=2)),
]
FOLDER = Path(sys.argv[1]) if len(sys.argv) > 1 else None  # for the checkpoints


def parameters(trainer):
    """This rank's parameters, wherever the scheme keeps its model."""
    for attr in ("model", "stage", "module"):
        holder = getattr(trainer, attr, None)
        for module in holder if isinstance(holder, list) else [holder]:
            if hasattr(module, "parameters"):
                yield from module.parameters()


def build(scheme, args, task, grid):
    """The trainer as the runner builds it (mpipar.train.main), with recomputation and
    clipping when the flags ask."""
    trainer = trainer_class(scheme, args)(task, grid, args)
    if args.recompute:
        recompute.apply(trainer, args.recompute)
    if args.clip_grad:
        clip.apply(trainer, args.clip_grad)
    kinds = {type(p.data) for p in parameters(trainer)} - {type(None)}
    gathered = getattr(args, "zero", 0) == 3  # ZeRO-3 holds whole parameters only in a step
    assert kinds == (set() if gathered else {B.xp.ndarray}), (scheme, kinds)
    return trainer


def run(scheme, flags, grid_shape, strict):
    """Rank 0's full parameters {name: host array} after STEPS steps, on NumPy or strict. With
    ``--checkpoint``, the trainer saves after the steps, a new one resumes from there and
    takes one step more (both on the same module)."""
    args = parse_args(scheme, flags + ["--dtype", "float64", "--steps", str(STEPS), "--quiet"],
                      N)
    if args.checkpoint:
        args.checkpoint = FOLDER / f"{scheme}-{'strict' if strict else 'numpy'}"
        args.checkpoint.mkdir(exist_ok=True)
    if strict:
        B.xp = strict_xp  # after parse_args, which calls B.use
    try:
        task, grid = serial.Task(args), Grid(**grid_shape)
        trainer = build(scheme, args, task, grid)
        probe = memory.Probe(trainer) if args.memory else None
        for step in range(STEPS):
            loss = trainer.step(step)
        if probe is not None:  # the ledger's table on rank 0, every rank counted
            table = memory.lines(probe, args, task, grid)
            assert RANK or (table[0].startswith("memory per rank") and len(table) == N + 3)
        if args.checkpoint:
            checkpoint.save(args.checkpoint, trainer, args, STEPS, loss)
            trainer = build(scheme, args, task, grid)
            assert checkpoint.load(args.checkpoint, trainer, args)[0] == STEPS
            trainer.step(STEPS)
        params = trainer.full_params()
    finally:
        B.use("numpy", "float64")
    if RANK != 0:
        return None
    return {n: v.get() if isinstance(v, strict_xp.ndarray) else v for n, v in params.items()}


for name, scheme, flags, grid_shape in CHECKS:
    want = run(scheme, flags, grid_shape, strict=False)
    got = run(scheme, flags, grid_shape, strict=True)
    if RANK == 0:
        assert want and sorted(got) == sorted(want), name
        for key, value in got.items():
            assert type(value) is np.ndarray, (name, key)
            np.testing.assert_array_equal(value, want[key], err_msg=f"{name}: {key}",
                                          strict=True)
    C.world().Barrier()
if RANK == 0:
    print(f"strict checks passed: {', '.join(c[0] for c in CHECKS)}")
