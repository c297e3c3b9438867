"""--recompute: the same parameters as without it, bit for bit in float64, in every scheme that
takes it; a pipeline stage then stashes one input per micro-batch in flight, nothing more."""

import numpy as np
import pytest
from conftest import run_mpi

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
    for extra in ([], ["--recompute"]):
        saved = tmp_path / f"p{len(extra)}.npz"
        outs.append(run_mpi(ranks, ["-m", f"mpipar.{scheme}", *GPT, *flags, *extra,
                                    "--save-params", saved], timeout=120).stdout)
        params.append(train.load_params(saved))
    final = [[line for line in out.splitlines() if "final" in line] for out in outs]
    assert final[0] and final[0] == final[1]
    assert sorted(params[0]) == sorted(params[1])
    for name in params[0]:
        assert np.array_equal(params[0][name], params[1][name]), name


def test_a_recomputing_stage_stashes_its_inputs_only():
    """2 stages, 2 micro-batches of 4 rows: stage 0 holds 2 micro-batches of token ids
    (4 x 8 int64: 256 bytes each), stage 1 one of activations (4 x 8 x 16 float64: 4 KiB)."""
    out = run_mpi(2, ["-m", "mpipar.pipeline", *GPT, "--n-layers", "2", "--micro-batches", "2",
                      "--timeline", "none", "--recompute"], timeout=120).stdout
    assert "peak activation stash per stage: 0.5 KiB (2 micro-batches), 4.0 KiB (1 micro-batch)" \
        in out, out
