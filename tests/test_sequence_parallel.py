"""Sequence parallelism (``--sequence-parallel``): tensor parallelism and the hybrid with the
LayerNorm regions split along the sequence train exactly like the serial trainer, move the same
bytes as the Allreduces they replace, hold 1/t of the LayerNorms' activations, and need the
LayerNorm gradients summed; with clipping, recomputation, --explain and checkpoints; and a
sequence that does not split, or the MLP, is refused on every rank."""

import re

import pytest
from conftest import MPI_SCRIPTS, assert_matches_serial, assert_refused

TINY_GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2",
            "--seq-len", "8", "--batch-size", "4", "--dtype", "float64", "--quiet"]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_checks_under_mpirun(mpirun, ranks):
    """tests/mpi/sp_checks.py: equal to serial (Adam, SGD, --update master), the traffic of a
    step against tensor parallelism's, the LayerNorm caches divided by t, the missing LayerNorm
    Allreduce caught; on 4 ranks also the hybrid, tp 2 x pp 2 (recomputed) and dp 2 x tp 2
    (overlapped)."""
    out = mpirun(ranks, [MPI_SCRIPTS / "sp_checks.py"], timeout=90)
    assert f"sequence-parallel checks passed on {ranks} ranks" in out.stdout
    caches = re.search(r"LayerNorm caches after a forward: ([\d,]+) bytes per rank without "
                       r"--sequence-parallel, ([\d,]+) with it", out.stdout)
    full, mine = (int(v.replace(",", "")) for v in caches.groups())
    assert mine * ranks == full, (full, mine)
    if ranks > 1:
        assert "without the LayerNorm Allreduce: 11 of 30 parameters differ" in out.stdout


def test_command_line_with_clipping_and_recomputation(mpirun, tmp_path, capsys):
    """--clip-grad (active every step) and --recompute, synchronous sends, --explain: the
    serial trainer's report and parameters, and the reduce-scatter/allgather lines."""
    flags = [*TINY_GPT, "--steps", "3", "--optim", "sgd", "--clip-grad", "0.5", "--recompute"]
    saved = tmp_path / "sp.npz"
    out = mpirun(2, ["-m", "mpipar.tensor_parallel", *flags, "--sequence-parallel", "--explain",
                     "--save-params", saved], timeout=90, env={"MPIPAR_SSEND": "1"}).stdout
    assert "scaled down, in 3 of 3 steps" in out, out
    assert_matches_serial(out, flags, saved, tmp_path, capsys)
    for line in [r"\[rank 1, tp 1\] Reduce_scatter .* 4\.0 KiB .*\(g': partial outputs of "
                 r"blocks\.0\.attn\.proj, by rows\)",
                 r"\[rank 1, tp 1\] Allgather .* 4\.0 KiB .*\(f': the rows of the input of "
                 r"head\.out\)",
                 r"\[rank 0, tp 0\] Allreduce .*\(sequence parallel: LayerNorm and position"]:
        assert re.search(line, out), line


def test_checkpoint_resumes_in_another_layout(mpirun, tmp_path, capsys):
    """The parameters keep their layout: 2 steps of tensor parallelism with sequence
    parallelism, then 2 more in the hybrid tp 2 x pp 2 with it, equal 4 serial steps; both
    clip (the LayerNorm gradients summed first, then counted once as replicated tensors)."""
    ckpt, saved = tmp_path / "ckpt", tmp_path / "hy.npz"
    flags = [*TINY_GPT, "--optim", "sgd", "--clip-grad", "0.5"]
    mpirun(2, ["-m", "mpipar.tensor_parallel", *flags, "--steps", "2", "--sequence-parallel",
               "--checkpoint", ckpt], timeout=90)
    out = mpirun(4, ["-m", "mpipar.hybrid", *flags, "--steps", "4", "--tp", "2", "--pp", "2",
                     "--sequence-parallel", "--resume", ckpt, "--save-params", saved],
                 timeout=90).stdout
    assert "resumed from" in out and "scaled down, in 2 of 2 steps" in out, out
    assert_matches_serial(out, [*flags, "--steps", "4"], saved, tmp_path, capsys)


@pytest.mark.parametrize("ranks, scheme, flags, message", [
    (4, "tensor_parallel", ["--model", "gpt", "--seq-len", "6", "--sequence-parallel"],
     "--seq-len 6 is not divisible by 4: use a multiple of 4"),
    (4, "hybrid", ["--model", "mlp", "--tp", "2", "--sequence-parallel"],
     "--sequence-parallel splits the GPT's sequence, and the MLP has none"),
])
def test_refused_on_every_rank(ranks, scheme, flags, message):
    assert_refused(ranks, scheme, flags, message)
