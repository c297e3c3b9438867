"""--clip-grad: every scheme and layout clips by the serial model's global norm (each parameter
counted once) and so trains exactly like the serial trainer with clipping; counting the
replicated tensors on every rank, the classic bug, does not. With --explain, every rank
narrates the norm's Allreduce of its partial sum."""

import re

import numpy as np
import pytest
from conftest import MPI_SCRIPTS, assert_matches_serial, run_mpi

from mpipar import train

FLAGS = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2",
         "--seq-len", "8", "--batch-size", "12", "--dtype", "float64", "--steps", "5",
         "--optim", "sgd", "--clip-grad", "0.5", "--quiet"]
MLP = ["--model", "mlp", "--sizes", "64,32,32,10", *FLAGS[FLAGS.index("--batch-size"):]]
RUNS = {  # a run named with "MLP" trains the MLP, every other the GPT of FLAGS
    "data parallel, master": (3, ["data_parallel"]),
    "data parallel, ring": (3, ["data_parallel", "--sync", "ring"]),
    "data parallel, buckets, overlap, MLP": (3, ["data_parallel", "--sync", "allreduce",
                                                  "--bucket-mb", "0.01", "--overlap"]),
    "ZeRO-1": (3, ["data_parallel", "--sync", "allreduce", "--zero", "1"]),
    "ZeRO-2": (3, ["data_parallel", "--sync", "allreduce", "--zero", "2"]),
    "ZeRO-3": (3, ["data_parallel", "--sync", "allreduce", "--zero", "3"]),
    "tensor parallel": (2, ["tensor_parallel"]),
    "tensor parallel, master": (2, ["tensor_parallel", "--update", "master"]),
    "pipeline": (2, ["pipeline", "--timeline", "none"]),
    "pipeline, interleaved": (2, ["pipeline", "--timeline", "none", "--schedule", "interleaved",
                                  "--chunks", "2"]),
    "pipeline, zb-h1": (2, ["pipeline", "--timeline", "none", "--schedule", "zb-h1",
                            "--explain"]),
    "hybrid dp x tp": (4, ["hybrid", "--dp", "2", "--tp", "2"]),
    "hybrid dp x pp": (4, ["hybrid", "--dp", "2", "--pp", "2"]),
    "hybrid tp x pp": (4, ["hybrid", "--tp", "2", "--pp", "2"]),
    "hybrid dp x tp x pp": (8, ["hybrid", "--dp", "2", "--tp", "2", "--pp", "2"]),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_clipping_equals_the_serial_trainers(run, tmp_path, capsys):
    ranks, (scheme, *flags) = RUNS[run]
    model = MLP if "MLP" in run else FLAGS
    saved = tmp_path / "p.npz"
    out = run_mpi(ranks, ["-m", f"mpipar.{scheme}", *flags, *model, "--save-params", saved],
                  timeout=120).stdout
    assert "scaled down, in 5 of 5 steps" in out, out  # the clipping is active every step
    assert_matches_serial(out, model, saved, tmp_path, capsys)
    if "--explain" in flags:  # the stages' partial sums of squares added by one Allreduce
        for rank in range(ranks):
            assert re.search(rf"^\[rank {rank}, \w+ \d+\] Allreduce .*"
                             r"\(gradient norm: sum of squares\)$", out, re.M), out


def test_counting_replicated_tensors_on_every_rank_is_caught(tmp_path, capsys):
    saved, reference = tmp_path / "p.npz", tmp_path / "serial.npz"
    run_mpi(4, [MPI_SCRIPTS / "clip_mistake.py", *FLAGS, "--save-params", saved], timeout=120)
    train.main("serial", [*FLAGS, "--save-params", str(reference)])
    capsys.readouterr()
    got, want = train.load_params(saved), train.load_params(reference)
    worst = max(float(np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()) for k in want)
    assert worst > 1e-6, worst  # far beyond the 1e-10 the right count meets
