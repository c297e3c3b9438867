"""--recompute (full and selective): the same parameters as without it, bit for bit in float64,
in every scheme that takes it; a pipeline stage then stashes one input per micro-batch in
flight, nothing more; selective recomputation stashes exactly the attention softmax less than
none, and more than full, as the memory ledger counts them."""

import numpy as np
import pytest
from conftest import run_mpi
from test_memory import rows_of

from mpipar import train

GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "4",
       "--seq-len", "8", "--batch-size", "8", "--dtype", "float64", "--steps", "3",
       "--optim", "adam", "--quiet"]
RUNS = {
    "serial": (1, ["serial"]),
    "serial mlp": (1, ["serial", "--model", "mlp"]),
    "tensor parallel": (2, ["tensor_parallel"]),
    "pipeline 1f1b": (2, ["pipeline", "--timeline", "none"]),
    "pipeline interleaved": (2, ["pipeline", "--schedule", "interleaved", "--micro-batches", "2",
                                 "--timeline", "none"]),
    "hybrid, overlap": (4, ["hybrid", "--dp", "2", "--pp", "2", "--bucket-mb", "0.001",
                            "--overlap"]),
    "hybrid tp x pp": (4, ["hybrid", "--tp", "2", "--pp", "2"]),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_recomputation_changes_no_bit(run, tmp_path):
    ranks, (scheme, *flags) = RUNS[run]
    outs, params = [], []
    for extra in ([], ["--recompute"], ["--recompute", "selective"]):
        saved = tmp_path / f"p{len(extra)}.npz"
        outs.append(run_mpi(ranks, ["-m", f"mpipar.{scheme}", *GPT, *flags, *extra,
                                    "--save-params", saved], timeout=120).stdout)
        params.append(train.load_params(saved))
    final = [[line for line in out.splitlines() if "final" in line] for out in outs]
    assert final[0] and final[0] == final[1] == final[2]
    for other in params[1:]:
        assert sorted(params[0]) == sorted(other)
        for name in params[0]:
            assert np.array_equal(params[0][name], other[name]), name


def test_a_recomputing_stage_stashes_its_inputs_only():
    """2 stages, 2 micro-batches of 4 rows: stage 0 holds 2 micro-batches of token ids
    (4 x 8 int64: 256 bytes each), stage 1 one of activations (4 x 8 x 16 float64: 4 KiB)."""
    out = run_mpi(2, ["-m", "mpipar.pipeline", *GPT, "--n-layers", "2", "--micro-batches", "2",
                      "--timeline", "none", "--recompute"], timeout=120).stdout
    assert "peak activation stash per stage: 0.5 KiB (2 micro-batches), 4.0 KiB (1 micro-batch)" \
        in out, out


def test_selective_recomputation_drops_the_softmax_only(mpirun):
    """4 blocks, 8 rows of 8 tokens, 4 heads, float64: selective recomputation stashes exactly
    the softmax, 4 x (8 x 4 x 8 x 8) values of 8 bytes = 65,536 bytes, less than none, and
    still more than full recomputation (which keeps each layer's input alone)."""
    stash = {}
    for how in ("none", "full", "selective"):
        flags = [] if how == "none" else ["--recompute", how]
        out = mpirun(1, ["-m", "mpipar.serial", *GPT, *flags, "--memory"], timeout=60).stdout
        stash[how] = rows_of(out)[0][3]  # the activations column of rank 0's row
    assert stash["none"] - stash["selective"] == 4 * 8 * 4 * 8 * 8 * 8, stash
    assert stash["full"] < stash["selective"] < stash["none"], stash


def test_selective_recomputation_with_the_split_backward_changes_no_bit(tmp_path):
    """--schedule zb-h1 splits each backward into B and W; selective recomputation runs inside
    B (attention's input gradient), so it is allowed there, and changes nothing."""
    params = []
    for extra in ([], ["--recompute", "selective"]):
        saved = tmp_path / f"p{len(extra)}.npz"
        run_mpi(2, ["-m", "mpipar.pipeline", *GPT, "--timeline", "none", "--schedule", "zb-h1",
                    *extra, "--save-params", saved], timeout=120)
        params.append(train.load_params(saved))
    assert sorted(params[0]) == sorted(params[1])
    for name in params[0]:
        assert np.array_equal(params[0][name], params[1][name]), name
