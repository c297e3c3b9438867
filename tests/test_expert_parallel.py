"""Expert parallelism under mpirun: every layout, both all-to-alls and micro-batches equal the
serial trainer with its bytes counted exactly, and the planted mistakes fail
(tests/mpi/ep_checks.py); the command line trains, narrates and saves what the serial trainer
does; a checkpoint moves between expert-parallel sizes; bad input ends every rank with one
line."""

import re

import pytest
from conftest import MPI_SCRIPTS, assert_matches_serial, assert_params_close, assert_refused

TINY = ["--model", "gpt", "--experts", "4", "--top-k", "2", "--d-model", "16", "--n-heads",
        "2", "--n-layers", "2", "--seq-len", "8", "--batch-size", "8", "--dtype", "float64",
        "--quiet"]


@pytest.mark.parametrize("ssend", ["0", "1"])
def test_every_layout_equals_serial_and_the_mistakes_fail(mpirun, ssend):
    """ep 4, 2 (x 2 replicas) and 1 on 4 ranks, ep 2 on 2; MPI's and the pairwise exchange;
    1 and 2 micro-batches; with synchronous sends too (no exchange relies on buffering)."""
    out = mpirun(4, [MPI_SCRIPTS / "ep_checks.py"], timeout=120, env={"MPIPAR_SSEND": ssend})
    assert "expert-parallel checks passed on 4 ranks" in out.stdout, out.stdout
    for mistake in ("AuxPerMicroBatch", "ExpertsOverEveryRank"):
        assert f"planted {mistake}: caught" in out.stdout, out.stdout


def test_command_line_matches_serial_and_narrates_every_step(mpirun, tmp_path, capsys):
    saved = tmp_path / "ep.npz"
    flags = [*TINY, "--steps", "3"]
    out = mpirun(4, ["-m", "mpipar.expert_parallel", *flags, "--ep", "2", "--a2a", "pairwise",
                     "--micro-batches", "2", "--explain", "--save-params", saved],
                 timeout=90).stdout
    assert_matches_serial(out, flags, saved, tmp_path, capsys)
    assert "on 4 ranks: ep groups of 2 (2 experts a rank, each on 2 rank(s)), all-to-all " \
           "pairwise" in out, out
    for rank in range(4):  # Step 1 once; Steps 3-6 per layer and micro-batch; 8 twice each
        assert out.count(f"[rank {rank}] EP Step 1:") == 1
        for step, times in ((2, 1), (3, 4), (4, 4), (5, 4), (6, 4), (7, 1), (8, 8), (9, 1)):
            assert out.count(f"[rank {rank}] EP Step {step}:") == times, (rank, step, out)
    assert "[rank 1] EP Step 1: rank 1 is rank 1 of an ep group of 2: experts [2, 3] of " \
           "every layer, replicated on 2 rank(s); the rest on all 4" in out, out
    assert re.search(r"\[rank 3, ep 1\] Sendrecv +-> 0, <- 0 .*\(tokens to experts, round 1 "
                     r"of 1\)", out), out
    assert "routing of the last step:" in out


def test_mpi_alltoallv_narrates_its_counts(mpirun):
    out = mpirun(4, ["-m", "mpipar.expert_parallel", *TINY, "--steps", "1", "--explain"],
                 timeout=90).stdout
    lines = [line for line in out.splitlines() if "] Alltoallv" in line]
    assert len(lines) == 4 * 2 * 4, out  # 4 ranks, 2 layers, dispatch/combine x 2
    for line in lines:
        out_rows, in_rows = re.search(r"rows out (\[[\d, ]+\]), in (\[[\d, ]+\])", line).groups()
        assert len(eval(out_rows)) == len(eval(in_rows)) == 4, line


def test_a_checkpoint_moves_between_expert_parallel_sizes(mpirun, tmp_path, capsys):
    """3 steps on ep 4, then 3 more on ep 2 x 2 replicas with Adam's state: the serial 6."""
    from mpipar import train

    ckpt, saved, whole = tmp_path / "ckpt", tmp_path / "ep.npz", tmp_path / "serial.npz"
    mpirun(4, ["-m", "mpipar.expert_parallel", *TINY, "--steps", "3", "--checkpoint", ckpt],
           timeout=90)
    out = mpirun(4, ["-m", "mpipar.expert_parallel", *TINY, "--steps", "6", "--ep", "2",
                     "--resume", ckpt, "--save-params", saved], timeout=90).stdout
    assert "resumed from" in out and "after step 3" in out, out
    train.main("serial", [*TINY, "--steps", "6", "--save-params", str(whole)])
    assert_params_close(train.load_params(saved), train.load_params(whole), "ep 4 -> ep 2")


def test_clipping_and_the_memory_ledger_read_the_placements(mpirun, tmp_path, capsys):
    """--clip-grad counts each expert once (split over ep) and the replicated part once (ep
    rank 0); --memory shows each rank holding its experts only, as the cost model predicts."""
    from mpipar import train

    saved, whole = tmp_path / "ep.npz", tmp_path / "serial.npz"
    clipped = [*TINY, "--steps", "3", "--clip-grad", "0.05"]
    out = mpirun(4, ["-m", "mpipar.expert_parallel", *clipped, "--ep", "2", "--memory",
                     "--save-params", saved], timeout=90).stdout
    train.main("serial", [*clipped, "--save-params", str(whole)])
    assert "scaled down, in 3 of 3 steps" in capsys.readouterr().out
    assert_params_close(train.load_params(saved), train.load_params(whole), "clipped")
    assert "scaled down, in 3 of 3 steps" in out, out
    want = train.load_params(whole)
    dense = sum(v.size for n, v in want.items() if ".mlp.experts." not in n)
    experts = sum(v.size for n, v in want.items() if ".mlp.experts." in n)
    held = 8 * (dense + experts // 2)  # float64: the replicated part and 2 of the 4 experts
    for rank in range(4):
        assert re.search(rf"^ +{rank}  ep {rank % 2} edp {rank // 2} +{held:,} +{held:,} "
                         rf"+{2 * held:,} ", out, re.M), out
    assert (f"its largest rank: parameters {held:,}, gradients {held:,}, optimizer "
            f"{2 * held:,}, activations ") in out, out  # the cost model holds the same


@pytest.mark.parametrize("n,flags,message", [
    (4, ["--experts", "6"], "--experts 6 do not split over the 4 ranks of an expert-parallel "
                            "group (--ep 4)"),
    (4, ["--ep", "3"], "--ep 3 must be at least 1 and divide the job's 4 ranks"),
    (2, ["--model", "mlp"], "--experts 8: a mixture of experts replaces the GPT's"),
    (2, ["--top-k", "0"], "--top-k 0 of --experts 8: each token goes to between 1 and E"),
    (2, ["--aux-loss-coef", "inf"], "--aux-loss-coef must be 0 or more and finite, got inf"),
])
def test_bad_input_ends_every_rank_with_one_line(n, flags, message):
    assert_refused(n, "expert_parallel", flags, message)



# ----------------------------------------------------------------------------- in the hybrid
@pytest.mark.parametrize("n,layout", [
    (4, ["--dp", "2", "--pp", "2", "--ep", "2"]),
    (4, ["--dp", "4", "--ep", "2", "--a2a", "pairwise"]),
    (8, ["--dp", "4", "--pp", "2", "--ep", "4"]),
    (8, ["--dp", "2", "--pp", "4", "--ep", "2", "--a2a", "pairwise"]),
])
def test_the_hybrid_with_experts_equals_serial(mpirun, tmp_path, capsys, n, layout):
    """Experts over replicas of each pipeline stage: GPipe's order, 2 micro-batches a replica,
    the aux loss of each stage's layers over the global batch, summed over the stages."""
    saved = tmp_path / "hybrid_ep.npz"
    flags = [*TINY, "--steps", "3"]
    out = mpirun(n, ["-m", "mpipar.hybrid", *flags, *layout, "--schedule", "gpipe",
                     "--micro-batches", "2", "--save-params", saved], timeout=90).stdout
    assert_matches_serial(out, flags, saved, tmp_path, capsys)
    ep = layout[layout.index("--ep") + 1]
    assert f"experts: 4 a block over ep groups of {ep}" in out, out


@pytest.mark.parametrize("n,flags,message", [
    (4, ["--dp", "2", "--pp", "2", "--schedule", "1f1b"],
     "--experts in the hybrid runs --schedule gpipe"),
    (4, ["--dp", "2", "--tp", "2"], "--experts in the hybrid takes no --tp"),
    (4, ["--dp", "4", "--ep", "3"], "--ep 3 must divide the 4 data-parallel replicas"),
    (4, ["--dp", "2", "--pp", "2", "--zero", "1", "--schedule", "gpipe"],
     "--experts in the hybrid takes no --zero"),
])
def test_the_hybrid_refuses_what_experts_cannot_do(n, flags, message):
    assert_refused(n, "hybrid", [*TINY, *flags], message)
