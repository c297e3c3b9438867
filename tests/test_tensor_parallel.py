"""Tensor parallelism under mpirun: each layer against its dense twin, whole models against the
serial trainer, counted traffic, replicas, the command line, and refusals of bad sizes."""

import re

import numpy as np
import pytest
from conftest import MPI_SCRIPTS, ROOT, assert_refused

from mpipar import train

TINY_GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2",
            "--seq-len", "8", "--batch-size", "4", "--steps", "3", "--dtype", "float64",
            "--quiet"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_layer_matches_its_dense_twin(mpirun, ranks):
    out = mpirun(ranks, [MPI_SCRIPTS / "tp_layers.py"], timeout=60)
    assert f"tp layer checks passed on {ranks} ranks" in out.stdout


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_models_train_like_serial(mpirun, ranks):
    """GPT and MLPs, --update local and master: parameters after 3 steps, replicas after
    every step, and the Allreduce/Gatherv/Scatterv/Bcast traffic of a step."""
    out = mpirun(ranks, [MPI_SCRIPTS / "tp_models.py"], timeout=90)
    assert f"tp model checks passed on {ranks} ranks" in out.stdout


def test_command_line_matches_serial_with_synchronous_sends(mpirun, tmp_path, capsys):
    path = tmp_path / "tp.npz"
    out = mpirun(4, ["-m", "mpipar.tensor_parallel", *TINY_GPT, "--update", "master",
                     "--explain", "--save-params", path], timeout=90,
                 env={"MPIPAR_SSEND": "1"})
    for step in range(1, 6):
        assert f"] TP Step {step}" in out.stdout, step
    assert re.search(r"\[rank 3, tp 3\] Allreduce .* 4\.0 KiB", out.stdout), out.stdout[:2000]
    assert "[rank 0, tp 0] Scatterv" in out.stdout
    train.main("serial", [*TINY_GPT, "--save-params", str(tmp_path / "serial.npz")])
    report = capsys.readouterr().out.splitlines()[-2]  # final train loss ..., val loss ...
    assert report in out.stdout.splitlines(), (report, out.stdout[-500:])
    got, want = train.load_params(path), train.load_params(tmp_path / "serial.npz")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
        assert err <= 1e-10, (name, err)


@pytest.mark.parametrize("bad, message", [
    (["--model", "gpt", "--d-model", "12", "--n-heads", "6"],
     "the head count --n-heads 6 is not divisible by the 4 tensor-parallel ranks; "
     "rank counts that divide it: 1, 2, 3, 6 (or make it 4 or 12 for 4 ranks)"),
    (["--model", "gpt", "--d-model", "18", "--n-heads", "6"],  # 9 and 18 ranks would not split
     "--d-model 18 is not divisible by the 4 tensor-parallel ranks; rank counts that divide "
     "it: 1, 2, 3, 6 (or make it 12 or 24 for 4 ranks)"),  # the 6 heads
])
def test_bad_sizes_are_refused_on_every_rank(bad, message):
    assert_refused(4, "tensor_parallel", bad, message)


def test_every_seed_step_has_one_banner_in_order():
    text = (ROOT / "mpipar" / "tensor_parallel.py").read_text()
    steps = [int(n) for n in re.findall(r"^\s*# -- TP Step (\d+): .+ --$", text, re.M)]
    assert steps == list(range(1, 6)), steps
