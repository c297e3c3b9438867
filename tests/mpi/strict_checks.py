"""mpirun -n 2 (or 4) python tests/mpi/strict_checks.py: the distributed schemes on an array module
that refuses implicit host conversions (tests/strict_xp.py, CuPy's rules on NumPy).

Every MPI call stages device arrays through host buffers (``backend.host``, ``host_out`` and
``copy_back``, called by mpipar.comm); with CuPy that is the only way an array reaches MPI.
For each scheme below, the trainer is built twice in float64 from the same flags, once on
NumPy and once on the strict module (set after ``parse_args``, which selects NumPy), and run
for 2 steps; the strict one must hold strict arrays, and the full parameters gathered to rank 0
must equal NumPy's bit for bit (the strict module computes with NumPy, so any difference is a
path that runs differently on a device). On 2 ranks: data parallelism (master, ring,
allreduce with buckets and overlap, ZeRO-1), tensor and pipeline (1F1B) parallelism, the
hybrid's data parallelism; on 4 ranks the hybrid with dp=2, tp=2 and with dp=2, pp=2.

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

from mpipar import backend as B
from mpipar import comm as C
from mpipar import serial
from mpipar.cli import parse_args
from mpipar.grid import Grid
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
    ("dp allreduce, buckets, overlap", "data_parallel",
     GPT + ["--sync", "allreduce", *BUCKET, "--overlap"], dict(dp=N)),
    ("dp zero 1", "data_parallel",
     MLP + ["--sync", "allreduce", "--zero", "1", "--optim", "adam"], dict(dp=N)),
    ("tp gpt", "tensor_parallel", GPT, dict(tp=N)),
    ("pp 1f1b gpt", "pipeline", GPT + ["--schedule", "1f1b", "--micro-batches", "2"],
     dict(pp=N)),
    ("hybrid dp", "hybrid", GPT + ["--dp", str(N), "--tp", "1", "--pp", "1"], dict(dp=N)),
] if N == 2 else [  # 4 ranks: the hybrid's replicas of a tensor-parallel model
    ("hybrid dp=2 tp=2", "hybrid", GPT + ["--dp", "2", "--tp", "2", "--pp", "1"],
     dict(dp=2, tp=2, pp=1)),
    ("hybrid dp=2 pp=2", "hybrid", GPT + ["--dp", "2", "--tp", "1", "--pp", "2"],
     dict(dp=2, tp=1, pp=2)),
]


def parameters(trainer):
    """This rank's parameters, wherever the scheme keeps its model."""
    for attr in ("model", "stage", "module"):
        holder = getattr(trainer, attr, None)
        for module in holder if isinstance(holder, list) else [holder]:
            if hasattr(module, "parameters"):
                yield from module.parameters()


def run(scheme, flags, grid_shape, strict):
    """Rank 0's full parameters {name: host array} after STEPS steps, on NumPy or strict."""
    args = parse_args(scheme, flags + ["--dtype", "float64", "--steps", str(STEPS), "--quiet"],
                      N)
    if strict:
        B.xp = strict_xp  # after parse_args, which calls B.use
    try:
        trainer = trainer_class(scheme, args)(serial.Task(args), Grid(**grid_shape), args)
        kinds = {type(p.data) for p in parameters(trainer)}
        assert kinds == {B.xp.ndarray}, (scheme, kinds)
        for step in range(STEPS):
            trainer.step(step)
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
