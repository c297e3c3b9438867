"""Hybrid 3D parallelism under mpirun: the layouts (D, T, P) = (2,1,2), (1,2,2), (2,2,1) of 4
ranks and (2,2,2) of 8, with GPipe and 1F1B, equal the serial trainer; the command line (with
synchronous sends) reports and saves what the serial trainer does; the grid prints as the layout
formula says; bad layouts and sizes end every rank with one message."""

import re

import pytest
from conftest import MPI_SCRIPTS, ROOT, assert_matches_serial, assert_refused

TINY_GPT = ["--model", "gpt", "--d-model", "8", "--n-heads", "2", "--n-layers", "2",
            "--seq-len", "8", "--batch-size", "8", "--steps", "3", "--dtype", "float64",
            "--quiet"]


@pytest.mark.parametrize("n", [4, 8])
def test_every_layout_equals_serial(mpirun, n):
    """4 ranks: (D,T,P) = (2,1,2), (1,2,2), (2,2,1); 8 ranks: (2,2,2); each with gpipe and 1f1b,
    plus overlapped buckets and an MLP cut inside a column/row pair: losses, every parameter
    (rel. err <= 1e-10), replicas bitwise, one dp Allreduce per step after the last backward."""
    out = mpirun(n, [MPI_SCRIPTS / "hybrid_checks.py"], timeout=90)
    assert f"hybrid checks passed on {n} ranks" in out.stdout


def test_no_deadlock_with_synchronous_sends(mpirun):
    """MPIPAR_SSEND=1: a send completes only when received, so no ordering that relies on MPI
    buffering a message (between stages, or against a tp or dp collective) can pass."""
    out = mpirun(4, [MPI_SCRIPTS / "hybrid_checks.py"], timeout=90, env={"MPIPAR_SSEND": "1"})
    assert "hybrid checks passed on 4 ranks" in out.stdout


def test_command_line_matches_serial_with_synchronous_sends(mpirun, tmp_path, capsys):
    saved = tmp_path / "hybrid.npz"
    out = mpirun(8, ["-m", "mpipar.hybrid", "--dp", "2", "--tp", "2", "--pp", "2", *TINY_GPT,
                     "--schedule", "gpipe", "--micro-batches", "2", "--explain",
                     "--save-params", saved], timeout=90, env={"MPIPAR_SSEND": "1"}).stdout
    assert_matches_serial(out, TINY_GPT, saved, tmp_path, capsys)
    assert re.search(r"stage 0 \(ranks \[0, 1, 4, 5\]\): embed, blocks\.0 ", out), out
    # --explain: every rank narrates Steps 1-6 of the first step once; replica 0 gathers
    for rank in range(8):
        for step in range(1, 7):
            assert out.count(f"[rank {rank}] HY Step {step}:") == 1, (rank, step)
        assert out.count(f"[rank {rank}] HY Step 7:") == (rank < 4), rank
    # every call names the world rank and the group rank (rank 5 is dp 1, pp 0, tp 1)
    assert "[rank 5, dp 1] Iallreduce done" in out and "[rank 1, tp 1] Allreduce" in out
    assert "[rank 2, pp 1] Send" in out and "[rank 2, pp 1] Isend posted" in out


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_command_line_matches_serial(mpirun, tmp_path, capsys, zero):
    """--zero 1 and 2 over the dp groups of dp 2 x pp 2 (ZeRO-2 in overlapped buckets): the
    runner reports it, trains as the serial trainer, and each rank keeps Adam's state for half
    its stage, and with ZeRO-2 half its gradients between steps (the --memory table)."""
    saved = tmp_path / "hybrid_zero.npz"
    buckets = ["--bucket-mb", "0.002", "--overlap"] if zero == 2 else []
    out = mpirun(4, ["-m", "mpipar.hybrid", "--dp", "2", "--pp", "2", "--zero", str(zero),
                     *buckets, *TINY_GPT, "--save-params", saved, "--memory"], timeout=90).stdout
    assert_matches_serial(out, TINY_GPT, saved, tmp_path, capsys)
    assert f"dp ZeRO-{zero} (Reduce_scatter, Allgather)" in out, out
    if zero == 2:
        assert re.search(r"Allgather\) in [2-9]\d* bucket\(s\) overlapped;", out), out
    # rank, where (4 words), parameters, gradients, optimizer: Adam's two moments of 1/2 of the
    # stage take as many bytes as its (padded) parameters, not twice as many; ZeRO-2's gradient
    # is 1/2 of them (ZeRO-1 keeps the whole gradient)
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d  dp \d pp \d", line)]
    assert len(rows) == 4, out
    for row in rows:
        params, grads, optimizer = (int(v.replace(",", "")) for v in row[5:8])
        assert params == optimizer == (grads if zero == 1 else 2 * grads), row


def test_print_grid_follows_the_layout_formula(mpirun):
    """--tp 2 alone on 4 ranks: dp defaults to 4 // 2 = 2, pp to 1."""
    out = mpirun(4, ["-m", "mpipar.hybrid", "--tp", "2", "--print-grid"], timeout=30).stdout
    assert "grid dp 2 x tp 2 x pp 1 = 4 ranks; world_rank = dp*2 + pp*2 + tp" in out, out
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        assert (f"rank {rank}: dp={dp} tp={tp} pp=0   tp group {[2 * dp, 2 * dp + 1]}   "
                f"pp group [{rank}]   dp group {[tp, tp + 2]}") in out, out


BAD = {
    "product is not the job": (4, ["--dp", "3"],
                               "dp*tp*pp = 3*1*1 = 3, but the job has 4 ranks. Layouts for 4 "
                               "ranks: --dp 1 --tp 1 --pp 4, --dp 1 --tp 2 --pp 2"),
    "heads not divisible": (4, ["--tp", "4", "--n-heads", "2"],
                            "the head count --n-heads 2 is not divisible by the 4 "
                            "tensor-parallel ranks"),
    "too many stages": (4, ["--pp", "4", "--model", "mlp", "--sizes", "64,10"],
                        "4 pipeline stages but the mlp model has only 1 layers"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_on_every_rank_quickly(case):
    n, flags, message = BAD[case]
    assert_refused(n, "hybrid", flags, message)


def test_every_step_has_its_banner_in_order():
    """Steps 5 and 6 under their banners in each of the three updates (plain, ZeRO-1, ZeRO-2)
    where they run; every other step once."""
    source = (ROOT / "mpipar" / "hybrid.py").read_text()
    steps = [int(n) for n in re.findall(r"^\s*# -- HY Step (\d+): .+ --$", source, re.M)]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 5, 6, 7], steps


def test_built_from_the_three_schemes():
    """The hybrid reuses the schemes' code: it makes no MPI call of its own on arrays and
    defines no layer."""
    source = (ROOT / "mpipar" / "hybrid.py").read_text()
    for name in ("tp_models.build_tp_model", "tp_models.tp_loss", "TP.LocalUpdate",
                 "TP.gather_full_params", "plan.plan_stages", "PP.build_stage",
                 "PP.run_pipeline", "PP.gather_params", "DP.GradSync", "Z.ShardedGradSync"):
        assert name in source, name
    assert not re.search(r"\.(Allreduce|Iallreduce|Send|Isend|Recv|Bcast)\(", source)
