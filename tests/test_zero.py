"""ZeRO-2 and ZeRO-3 under mpirun: equal to the serial trainer on 1 to 4 ranks, with and without
synchronous sends, with the bytes of the formula and 1/P of the memory; the command line reports
what the serial trainer reports and narrates each step; checkpoints move to and from them."""

import re

import pytest
from conftest import MPI_SCRIPTS, assert_matches_serial, assert_refused
from test_checkpoint import GPT, MLP, run_chain


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zero_2_and_3_equal_serial(mpirun, n):
    out = mpirun(n, [MPI_SCRIPTS / "zero_checks.py"], timeout=120).stdout
    assert f"zero checks passed on {n} ranks" in out
    # the memory a ZeRO-3 rank holds between steps: 1/P of the model's parameters and gradients
    for model, n_bytes in (("mlp", 10_992), ("gpt", 78_576)):
        held = re.search(rf"{model}: a ZeRO-3 rank holds ([\d,]+) parameter and ([\d,]+) "
                         rf"gradient bytes between steps, of the model's {n_bytes:,} ", out)
        params, grads = (int(v.replace(",", "")) for v in held.groups())
        assert params == grads and 0 <= params * n - n_bytes < 8 * n * 4, (model, params)


@pytest.mark.parametrize("n", [2, 4])
def test_zero_2_and_3_with_synchronous_sends(mpirun, n):
    """MPIPAR_SSEND=1: ZeRO-2's posted reduce-scatter (Irecv, Isend) cannot rely on buffering."""
    out = mpirun(n, [MPI_SCRIPTS / "zero_checks.py"], timeout=120, env={"MPIPAR_SSEND": "1"})
    assert f"zero checks passed on {n} ranks" in out.stdout


def run_and_compare(mpirun, n, zero_flags, flags, tmp_path, capsys):
    saved = tmp_path / "zero.npz"
    out = mpirun(n, ["-m", "mpipar.data_parallel", "--sync", "allreduce", *zero_flags, *flags,
                     "--explain", "--save-params", saved], timeout=90).stdout
    assert_matches_serial(out, flags, saved, tmp_path, capsys)
    return out


def test_zero_3_command_line_matches_serial(mpirun, tmp_path, capsys):
    flags = ["--model", "gpt", "--d-model", "16", "--n-heads", "2", "--n-layers", "2",
             "--seq-len", "8", "--batch-size", "10", "--steps", "4", "--dtype", "float64",
             "--quiet"]
    out = run_and_compare(mpirun, 3, ["--zero", "3"], flags, tmp_path, capsys)
    # --explain: each rank narrates each step of the first step once, and ZeRO-3's traffic:
    # per layer, two Allgathers (forward, backward) and one Reduce_scatter
    for rank in range(3):
        for step in ("DP Step 1", "Z3 Step 1", "DP Step 2", "Z3 Step 3", "Z3 Step 4",
                     "Z3 Step 5"):
            assert out.count(f"[rank {rank}] {step}:") == 1, (rank, step, out)
        for layer in ("embed", "blocks.0", "blocks.1", "head"):
            for what in ("parameters, for its forward", "parameters, for its backward",
                         "gradients"):
                calls = re.findall(rf"\[rank {rank}, dp {rank}\] (\w+) .*\({re.escape(layer)}: "
                                   rf"{what}\)", out)
                assert calls == ["Reduce_scatter" if what == "gradients" else "Allgather"], \
                    (rank, layer, what, calls)
    # the optimizer state of Adam per rank: 1/3 of the serial one (plus padding)
    state = re.search(r"optimizer state bytes per rank: \[(\d+), (\d+), (\d+)\]", out)
    serial_state = 2 * 8 * 9_822  # Adam's two moments of the 9,822 parameters, float64
    assert len(set(state.groups())) == 1
    assert 0 <= 3 * int(state.group(1)) - serial_state < 2 * 8 * 3 * 4  # < P pad per layer


def test_zero_2_command_line_matches_serial(mpirun, tmp_path, capsys):
    flags = ["--model", "mlp", "--steps", "4", "--batch-size", "10", "--dtype", "float64",
             "--optim", "adam", "--quiet"]
    out = run_and_compare(mpirun, 2, ["--zero", "2", "--bucket-mb", "0.01", "--overlap",
                                      "--micro-batches", "2"], flags, tmp_path, capsys)
    for rank in range(2):
        for step in range(1, 6):
            assert out.count(f"[rank {rank}] DP Step {step}:") == 1, (rank, step, out)
    # float64 buckets of 0.01 MiB: fc2 and fc1, then fc0; each posted during the backward
    assert out.count("[rank 1, dp 1] Isend posted") == 2 and "2 bucket(s)" in out
    assert out.index("[rank 1, dp 1] Isend posted") < out.index("[rank 1] DP Step 4:")


# each leg: (ranks, scheme and its flags, steps it trains to); legs hand over by checkpoint
CHAINS = {
    "gpt, adam": (GPT + ["--optim", "adam"], [
        (1, ["serial"], 2),
        (2, ["data_parallel", "--sync", "allreduce", "--zero", "2", "--bucket-mb", "0.01"], 4),
        (3, ["data_parallel", "--sync", "allreduce", "--zero", "3"], 6),
        (1, ["serial"], 8)]),
    "mlp, sgd momentum": (MLP + ["--optim", "sgd"], [
        (1, ["serial"], 2),
        (2, ["data_parallel", "--sync", "allreduce", "--zero", "2", "--overlap"], 4),
        (3, ["data_parallel", "--sync", "allreduce", "--zero", "3", "--micro-batches", "2"], 6),
        (1, ["serial"], 8)]),
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_resumed_from_and_to_zero_2_and_3_equals_the_serial_run(chain, tmp_path, capsys):
    """serial -> ZeRO-2 on 2 ranks -> ZeRO-3 on 3 ranks -> serial: each leg continues from the
    last one's checkpoint, and the end equals an uninterrupted serial run."""
    run_chain(*CHAINS[chain], tmp_path, capsys)


@pytest.mark.parametrize("flags,message", [
    (["--zero", "3"], "use --sync allreduce --zero 3"),
    (["--zero", "2", "--sync", "ring"], "which --sync ring does not use"),
    (["--zero", "3", "--sync", "allreduce", "--bucket-mb", "1"], "are ZeRO-2's: use --zero 2"),
    (["--zero", "4"], "invalid choice: 4"),
])
def test_bad_zero_flags_are_refused_on_every_rank(flags, message):
    assert_refused(2, "data_parallel", flags, message)
