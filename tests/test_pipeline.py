"""Pipeline parallelism under mpirun: every schedule and micro-batch count equals the serial
trainer on 1 to 4 stages (also with synchronous sends), interleaved 1F1B on 2 and 4, zero-bubble
ZB-H1 bit for bit 1F1B's parameters, the stash of activations matches the schedule, the command
line reports what the serial trainer reports, and bad input ends every rank with one clear
message."""

import re
import subprocess
import sys

import pytest
from conftest import MPI_SCRIPTS, ROOT, assert_matches_serial, assert_refused

MLP = ["--model", "mlp", "--sizes", "64,16,16,16,16,10", "--batch-size", "12", "--steps", "4",
       "--dtype", "float64", "--quiet"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_schedule_equals_serial(mpirun, n):
    """naive, gpipe, 1f1b, zb-h1 x m in {1, 2, 4, 8} x {MLP of 9 layers, GPT of 5}: losses
    and parameters after 3 steps (rel. err <= 1e-10), peak stash = in-flight x one micro-batch
    (zb-h1: walked through its list, a micro-batch between B and W holding what W needs),
    zb-h1's parameters bitwise 1F1B's; on 2 and 4 ranks also interleaved 1F1B with 2 chunks,
    m in {4, 8}, MLP and GPT of 8."""
    out = mpirun(n, [MPI_SCRIPTS / "pp_checks.py"], timeout=90)
    assert f"pp checks passed on {n} ranks" in out.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_no_deadlock_with_synchronous_sends(mpirun, n):
    """MPIPAR_SSEND=1: a send completes only when received, so an order that relies on MPI
    buffering a message deadlocks (and fails with "deadlock?") instead of passing."""
    out = mpirun(n, [MPI_SCRIPTS / "pp_checks.py"], timeout=90, env={"MPIPAR_SSEND": "1"})
    assert f"pp checks passed on {n} ranks" in out.stdout


def test_command_line_matches_serial(mpirun, tmp_path, capsys):
    saved, picture = tmp_path / "pp.npz", tmp_path / "timeline.png"
    out = mpirun(3, ["-m", "mpipar.pipeline", *MLP, "--schedule", "gpipe", "--micro-batches",
                     "5", "--save-params", saved, "--timeline", picture], timeout=60).stdout
    assert_matches_serial(out, MLP, saved, tmp_path, capsys)
    assert picture.stat().st_size > 10_000
    assert re.search(r"stage 0 \(rank 0\): fc0", out), out
    assert "peak activation stash per stage" in out and "(5 micro-batches)" in out


def test_interleaved_command_line_matches_serial(mpirun, tmp_path, capsys):
    """--schedule interleaved --chunks 2 on 2 ranks: 4 pieces, the serial result, the formula."""
    saved = tmp_path / "pp.npz"
    out = mpirun(2, ["-m", "mpipar.pipeline", *MLP, "--schedule", "interleaved", "--chunks",
                     "2", "--micro-batches", "4", "--save-params", saved, "--timeline", "none"],
                 timeout=60).stdout
    assert_matches_serial(out, MLP, saved, tmp_path, capsys)
    assert "schedule interleaved with 2 chunks per stage, production warm-up, 4 micro-batches" \
        in out, out
    assert re.search(r"piece 0 \(rank 0, chunk 0\): fc0", out), out
    assert re.search(r"piece 3 \(rank 1, chunk 1\): ", out), out
    assert re.search(r"bubble measured from the trace 0\.\d+ .*\(p-1\)/\(v\*m\+p-1\) = 0\.111",
                     out), out


def test_zero_bubble_command_line_matches_serial_and_1f1b_bitwise(mpirun, tmp_path, capsys):
    """--schedule zb-h1 on 2 ranks: the serial result, and exactly 1F1B's parameters: B and W
    are the backward's arithmetic, run apart; every W adds its micro-batch in 1F1B's order.
    With --explain, each stage narrates its W's (1F1B runs none apart)."""
    from mpipar import train

    saved = {name: tmp_path / f"{name}.npz" for name in ("zb-h1", "1f1b")}
    out = {name: mpirun(2, ["-m", "mpipar.pipeline", *MLP, "--schedule", name,
                            "--micro-batches", "4", "--save-params", path, "--timeline", "none",
                            "--explain"], timeout=60).stdout for name, path in saved.items()}
    assert "schedule zb-h1, 4 micro-batches" in out["zb-h1"], out["zb-h1"]
    for stage in (0, 1):
        assert f"[rank {stage}] PP Step 7: stage {stage} runs W on micro-batch 3" in out["zb-h1"]
    assert "runs W on" not in out["1f1b"], out["1f1b"]
    zb, one = (train.load_params(path) for path in saved.values())
    assert list(zb) == list(one) and all((zb[k] == one[k]).all() for k in zb)
    assert_matches_serial(out["zb-h1"], MLP, saved["zb-h1"], tmp_path, capsys)


def test_default_run_is_the_gpt_on_4_stages(mpirun, tmp_path):
    """The demo's command, shortened to 3 steps: partition, report, bubble, timeline."""
    picture = tmp_path / "t.png"
    out = mpirun(4, ["-m", "mpipar.pipeline", "--steps", "3", "--quiet", "--timeline", picture],
                 timeout=60).stdout
    assert "gpt" in out and "schedule 1f1b, 4 micro-batches" in out
    assert re.search(r"stage 0 \(rank 0\): embed, blocks\.0 ", out), out
    assert re.search(r"stage 3 \(rank 3\): blocks\.3, head ", out), out
    assert "val loss" in out and "unigram loss" in out
    assert re.search(r"bubble measured from the trace 0\.\d+ .*\(p-1\)/\(m\+p-1\) = 0\.429", out)
    assert re.search(rf"timeline of step \d \(the median by duration\): {picture}", out), out
    assert picture.exists()


@pytest.mark.parametrize("ranks,flags,message", [
    (4, ["--model", "mlp", "--sizes", "64,10"], "4 pipeline stages but the mlp model has only 1"),
    (2, ["--schedule", "zigzag"], "unknown --schedule 'zigzag'"),
    (2, ["--micro-batches", "0"], "--micro-batches must be positive"),
    (2, ["--model", "mlp", "--micro-batches", "65"], "exceeds --batch-size 64"),
    (2, ["--model", "mlp", "--partition", "1,1"], "summing to 5"),
    (2, ["--schedule", "interleaved", "--micro-batches", "3"], "multiple of the stages (2)"),
    (2, ["--chunks", "2"], "--chunks 2 needs --schedule interleaved"),
    (2, ["--schedule", "interleaved", "--chunks", "0"], "--chunks must be positive"),
    (2, ["--schedule", "zb-h1", "--chunks", "2"], "--chunks 2 needs --schedule interleaved"),
    (2, ["--schedule", "zb-h1", "--recompute"], "--recompute runs a stage's backward whole"),
    (2, ["--model", "mlp", "--sizes", "64,16,10", "--schedule", "interleaved"],
     "4 model pieces but the mlp model has only 3 layers"),
])
def test_bad_input_ends_every_rank_clearly(ranks, flags, message):
    assert_refused(ranks, "pipeline", flags, message)


def test_print_schedule_needs_no_mpirun():
    out = subprocess.run([sys.executable, "-m", "mpipar.pipeline", "--print-schedule",
                          "--stages", "4", "--micro-batches", "4"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, check=True).stdout
    assert "stage 3 (stashes at most 1): RA0 F0 B0 SG0 RA1 F1 B1 SG1" in out, out
    assert "stage 0 (stashes at most 4): F0 SA0 F1 SA1 F2 SA2 F3 SA3 RG0 B0" in out, out
    assert "bubble 0.429 (formula 0.429)" in out
    out = subprocess.run([sys.executable, "-m", "mpipar.pipeline", "--print-schedule",
                          "--schedule", "interleaved", "--stages", "2", "--micro-batches", "2"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, check=True).stdout
    assert "2 model chunks per stage" in out, out
    assert "stage 1 (stashes at most 3): RA0 F0 SA0 RA1 F1 SA1 RA0.1 F0.1 B0.1" in out, out
    assert "stage 1 |    . F0.0 F1.0 F0.1 B0.1 B0.1" in out, out
    assert "bubble 0.200 (formula 0.200)" in out
    out = subprocess.run([sys.executable, "-m", "mpipar.pipeline", "--print-schedule",
                          "--schedule", "zb-h1", "--stages", "4", "--micro-batches", "8"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, check=True).stdout
    assert "stage 3 (stashes at most 4): RA0 F0 B0 SG0 RA1 F1 B1 SG1" in out, out
    assert "stage 3 |  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1" in out, out
    assert "bubble 0.111 (formula 0.111)" in out


def test_every_seed_step_has_one_banner_in_order():
    source = (ROOT / "mpipar" / "pipeline.py").read_text()
    steps = [int(n) for n in re.findall(r"^\s*# -- PP Step (\d+): ", source, re.M)]
    assert steps == list(range(1, 10)), steps


@pytest.mark.parametrize("kind,first", [("mlp", 0), ("mlp", 1), ("gpt", 0), ("gpt", 1)])
def test_split_backward_is_the_backward_bit_for_bit(kind, first):
    """B of two micro-batches, then their W's (ZB-H1's order on a stage), against the whole
    backward of each: the same input gradients and parameter gradients, bit for bit, and
    nothing left in any cache. The stage from layer ``first`` on: with the data layer (whose
    input has no gradient), or fed a float activation as a later stage is."""
    import numpy as np

    from mpipar.engine import nn

    def stage():
        model = nn.MLP([8, 16, 16, 4]) if kind == "mlp" else \
            nn.GPT(vocab=11, d_model=8, n_heads=2, n_layers=2, seq_len=5)
        return nn.Sequential(model.layers[first:]).init(3)

    rng = np.random.default_rng(0)  # float64: conftest's autouse fixture
    whole, split = stage(), stage()
    if kind == "gpt" and first == 0:
        xs = [rng.integers(0, 11, (2, 5)) for _ in range(2)]  # token ids
    else:
        shape = {("mlp", 0): (3, 8), ("mlp", 1): (3, 16), ("gpt", 1): (2, 5, 8)}[kind, first]
        xs = [rng.standard_normal(shape) for _ in range(2)]
    douts = [rng.standard_normal(whole.forward(x, k).shape) for k, x in enumerate(xs)]
    dx_whole = [whole.backward(d, k) for k, d in enumerate(douts)]
    for k, x in enumerate(xs):
        split.forward(x, k)
    dx_split = [split.backward_input(d, k) for k, d in enumerate(douts)]
    assert any(m._cache for m in split.modules())  # B kept what W needs
    for k in range(len(xs)):
        split.backward_weight(k)
    assert not any(m._cache for m in split.modules())
    for a, b in zip(dx_whole, dx_split):
        assert (a is None) == (b is None) == (first == 0) and (a is None or np.array_equal(a, b))
    for (name, p), (_, q) in zip(whole.named_parameters(), split.named_parameters()):
        assert np.array_equal(p.grad, q.grad), name


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_v_shaped_command_line_matches_serial(mpirun, tmp_path, capsys, schedule):
    """--schedule zb-v / dualpipev on 2 ranks: 4 pieces in a V (rank 0 holds pieces 0 and 3),
    the serial result, the loss from rank 0, the formula beside the measured bubble."""
    saved = tmp_path / "pp.npz"
    out = mpirun(2, ["-m", "mpipar.pipeline", *MLP, "--schedule", schedule, "--micro-batches",
                     "4", "--save-params", saved, "--timeline", "none"], timeout=60).stdout
    assert_matches_serial(out, MLP, saved, tmp_path, capsys)
    assert re.search(r"piece 3 \(rank 0, chunk 1\): ", out), out
    assert re.search(r"bubble measured from the trace 0\.\d+ .*\(p-1\)/\(6m\+p-1\) = 0\.040",
                     out), out


def test_a_v_shaped_checkpoint_resumes_as_1f1b_bit_for_bit(mpirun, tmp_path):
    """3 steps of ZB-V (4 pieces in a V), a checkpoint, 3 more as 1F1B (2 pieces): the bits of
    6 steps of 1F1B, since every layer adds its micro-batches' gradients in the same order."""
    from mpipar import train

    at = MLP.index("--steps")
    flags = [*MLP[:at], *MLP[at + 2:], "--timeline", "none"]  # MLP without its --steps
    run = lambda *more: mpirun(2, ["-m", "mpipar.pipeline", *flags, *more])  # noqa: E731
    run("--schedule", "zb-v", "--steps", "3", "--checkpoint", tmp_path / "ck")
    run("--steps", "6", "--resume", tmp_path / "ck", "--save-params", tmp_path / "a.npz")
    run("--steps", "6", "--save-params", tmp_path / "b.npz")
    got, want = train.load_params(tmp_path / "a.npz"), train.load_params(tmp_path / "b.npz")
    assert sorted(got) == sorted(want) and all((got[k] == want[k]).all() for k in want)
