"""Context parallelism: every algorithm and context size equals the serial trainer with its
bytes counted exactly, and the planted mistakes fail (tests/mpi/cp_checks.py); the online
softmax's merge survives logits of 1e4; the command line trains, narrates and saves what the
serial trainer does; a checkpoint moves between layouts; bad input ends every rank with one
line."""

import math
import re

import numpy as np
import pytest
from conftest import MPI_SCRIPTS, assert_params_close, assert_refused

from mpipar import context_parallel as X

TINY = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2", "--seq-len",
        "16", "--batch-size", "6", "--dtype", "float64", "--quiet"]


def assert_matches_serial(out, flags, saved, tmp_path, capsys):
    """The run's final line is the serial trainer's, and every parameter it saved is within
    1e-10 of the serial one, relative to the tensor's largest value: the key bias's gradient
    is zero in exact arithmetic (a softmax does not move when every logit of a row moves
    alike), so its values are rounding noise that another order of sums changes."""
    from mpipar import train

    reference = tmp_path / "serial.npz"
    train.main("serial", [*flags, "--save-params", str(reference)])
    want = [line for line in capsys.readouterr().out.splitlines() if "final" in line]
    assert want and [line for line in out.splitlines() if "final" in line] == want
    assert_params_close(train.load_params(saved), train.load_params(reference))


@pytest.mark.parametrize("ssend", ["0", "1"])
def test_every_layout_equals_serial_and_the_mistakes_fail(mpirun, ssend):
    """ring, zigzag and Ulysses on cp 4, cp 2 x 2 replicas and cp 2 on 2 ranks, cp 1; 1 and 2
    micro-batches; with synchronous sends too (no exchange relies on buffering)."""
    out = mpirun(4, [MPI_SCRIPTS / "cp_checks.py"], timeout=120, env={"MPIPAR_SSEND": ssend})
    assert "context-parallel checks passed on 4 ranks" in out.stdout, out.stdout
    for mistake in ("DKVLeftBehind", "MergeWithoutLSE"):
        assert f"planted {mistake}: caught" in out.stdout, out.stdout


def direct_attention(q, k, v):
    """Softmax attention of q over every key at once (no mask), its maximum subtracted."""
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("magnitude", [1.0, 1e4])
def test_the_merge_of_blocks_is_the_softmax_over_their_union(magnitude):
    """Three key blocks merged one by one, with logits of about ``magnitude``: the direct
    softmax over all the keys, with no overflow (exp(1e4) is inf) and no NaN."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    q *= magnitude / np.abs(q @ k.transpose(0, 1, 3, 2)).max() * 2  # logits up to magnitude
    blocks = np.split(k, [1, 3], axis=2), np.split(v, [1, 3], axis=2)
    out, lse = np.zeros_like(q), np.full(q.shape[:-1] + (1,), -np.inf)
    for kb, vb in zip(*blocks):
        out, lse = X.merge(out, lse, *X.block_attention(q, kb, vb, causal=False))
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, direct_attention(q, k, v), rtol=1e-10, atol=1e-12)


def test_the_zigzag_balances_the_causal_pairs():
    """Of the causal chunk pairs, the plain ring gives rank r r + 1 of G blocks; the zigzag
    gives every rank the same count, 2G + 1 (half of the 4G pairs with one more diagonal)."""
    g = 4
    ring = [sum(len(X.pairs(X.chunks_of(r, g, "ring")[0], X.chunks_of(s, g, "ring")[0]))
                for s in range(g)) for r in range(g)]
    zigzag = [sum(len(X.pairs(X.chunks_of(r, g, "zigzag")[0], X.chunks_of(s, g, "zigzag")[0]))
                  for s in range(g)) for r in range(g)]
    assert ring == [1, 2, 3, 4]
    assert zigzag == [2 * g + 1] * g
    assert sorted(np.concatenate([X.positions(r, g, "zigzag", 16) for r in range(g)])) == \
        list(range(16))


def test_command_line_matches_serial_and_narrates_every_step(mpirun, tmp_path, capsys):
    saved = tmp_path / "cp.npz"
    flags = [*TINY, "--steps", "3"]
    out = mpirun(4, ["-m", "mpipar.context_parallel", *flags, "--cp-algo", "zigzag",
                     "--micro-batches", "2", "--explain", "--save-params", saved],
                 timeout=90).stdout
    assert_matches_serial(out, flags, saved, tmp_path, capsys)
    assert "on 4 ranks: cp groups of 4 (zigzag attention, 4 of each sequence's 16 tokens a " \
           "rank), 1 replica(s)" in out, out
    for rank in range(4):  # Step 1 once; 2 and 7 per step; 3 per micro-batch; 4, 5 per layer
        assert out.count(f"[rank {rank}] CP Step 1:") == 1
        for step, times in ((2, 1), (3, 2), (4, 4), (5, 4), (7, 1)):
            assert out.count(f"[rank {rank}] CP Step {step}:") == times, (rank, step, out)
    assert "[rank 1] CP Step 1: rank 1 is rank 1 of a cp group of 4: chunk(s) [1, 6] of 8 " \
           "of every sequence, 4 of its 16 tokens" in out, out
    assert re.search(r"\[rank 2, cp 2\] Sendrecv +-> 3, <- 1 .*\(dK, dV of rank 2\)", out), out
    assert re.search(r"attention compute per rank \(traced, median of 2 step\(s\); varies\): "
                     r"(\d+\.\d+, ){3}\d+\.\d+ ms a step; mean over the busiest \d\.\d+, where "
                     r"the layout allows 1: every rank the same work", out), out


def test_the_ring_reports_its_attention_balance_against_the_formula(mpirun):
    out = mpirun(4, ["-m", "mpipar.context_parallel", *TINY, "--steps", "1"], timeout=90).stdout
    assert "where the layout allows G/(2G-1) = 0.571 for the causal work, (G+1)/(2G) = 0.625 " \
           "for the blocks computed here (a diagonal block whole)" in out, out
    assert "attention compute per rank (traced, median of 1 step(s); varies)" in out, out


def test_ulysses_narrates_its_all_to_alls(mpirun, tmp_path, capsys):
    saved = tmp_path / "cp.npz"
    flags = [*TINY, "--steps", "2"]
    out = mpirun(4, ["-m", "mpipar.context_parallel", *flags, "--cp-algo", "ulysses", "--cp",
                     "2", "--explain", "--save-params", saved], timeout=90).stdout
    assert_matches_serial(out, flags, saved, tmp_path, capsys)
    lines = [line for line in out.splitlines() if "] Alltoall " in line]
    assert len(lines) == 4 * 2 * 4, out  # the first step: 4 ranks, 2 layers, 4 all-to-alls
    assert out.count("[rank 0] CP Step 6:") == 2 * 4, out
    assert all("all <-> all (2)" in line for line in lines), out


def test_a_checkpoint_moves_between_context_parallel_layouts(mpirun, tmp_path, capsys):
    """3 steps of the ring on cp 4, then 3 more of Ulysses on cp 2 x 2 replicas with Adam's
    state: the serial trainer's 6 steps."""
    from mpipar import train

    ckpt, saved, whole = tmp_path / "ckpt", tmp_path / "cp.npz", tmp_path / "serial.npz"
    mpirun(4, ["-m", "mpipar.context_parallel", *TINY, "--steps", "3", "--checkpoint", ckpt],
           timeout=90)
    out = mpirun(4, ["-m", "mpipar.context_parallel", *TINY, "--steps", "6", "--cp", "2",
                     "--cp-algo", "ulysses", "--resume", ckpt, "--save-params", saved],
                 timeout=90).stdout
    assert "resumed from" in out and "after step 3" in out, out
    train.main("serial", [*TINY, "--steps", "6", "--save-params", str(whole)])
    assert_params_close(train.load_params(saved), train.load_params(whole), "cp 4 -> cp 2")


def test_clipping_and_the_memory_ledger_read_the_placements(mpirun, tmp_path, capsys):
    """--clip-grad counts every parameter once (replicated on every rank); --memory shows
    each rank holding the whole model, as the cost model predicts."""
    from mpipar import train

    saved, whole = tmp_path / "cp.npz", tmp_path / "serial.npz"
    clipped = [*TINY, "--steps", "3", "--clip-grad", "0.05"]
    out = mpirun(4, ["-m", "mpipar.context_parallel", *clipped, "--memory", "--save-params",
                     saved], timeout=90).stdout
    train.main("serial", [*clipped, "--save-params", str(whole)])
    assert "scaled down, in 3 of 3 steps" in capsys.readouterr().out
    assert_params_close(train.load_params(saved), train.load_params(whole), "clipped")
    assert "scaled down, in 3 of 3 steps" in out, out
    n = sum(v.size for v in train.load_params(whole).values())
    for rank in range(4):
        assert re.search(rf"^ +{rank}  cp {rank} +{8 * n:,} +{8 * n:,} +{16 * n:,} ", out,
                         re.M), out
    assert f"its largest rank: parameters {8 * n:,}, gradients {8 * n:,}, optimizer " \
           f"{16 * n:,}, activations " in out, out  # the cost model holds the same


@pytest.mark.parametrize("n,flags,message", [
    (4, ["--seq-len", "18"], "--cp-algo ring cuts each sequence into 4 chunks, but --seq-len "
                             "18 is not divisible by 4"),
    (4, ["--cp-algo", "zigzag", "--seq-len", "12"],
     "--cp-algo zigzag cuts each sequence into 2 x 4 chunks, but --seq-len 12 is not "
     "divisible by 8"),
    (4, ["--cp-algo", "ulysses", "--n-heads", "2", "--d-model", "16"],
     "--cp-algo ulysses gives each of the 4 ranks of a group whole heads, but --n-heads 2"),
    (2, ["--model", "mlp"], "context parallelism splits the GPT's sequences, and the MLP"),
    (4, ["--cp", "3"], "--cp 3 must be at least 1 and divide the job's 4 ranks"),
    (2, ["--experts", "4"], "--experts trains on the serial, expert-parallel and hybrid"),
    (2, ["--recompute"], "--recompute is not in the context-parallel trainer"),
])
def test_bad_input_ends_every_rank_with_one_line(n, flags, message):
    assert_refused(n, "context_parallel", flags, message)


# ----------------------------------------------------------------------------- in the hybrid
@pytest.mark.parametrize("n,layout", [
    (4, ["--dp", "2", "--pp", "2", "--cp", "2"]),
    (4, ["--dp", "4", "--cp", "2", "--cp-algo", "zigzag"]),
    (4, ["--dp", "2", "--tp", "2", "--cp", "2", "--cp-algo", "ulysses"]),
    (4, ["--dp", "2", "--tp", "2", "--cp", "2", "--sequence-parallel"]),
    (8, ["--dp", "4", "--pp", "2", "--cp", "2", "--cp-algo", "ulysses"]),
    (8, ["--dp", "4", "--pp", "2", "--cp", "4", "--cp-algo", "zigzag"]),
    (8, ["--dp", "2", "--tp", "2", "--pp", "2", "--cp", "2", "--cp-algo", "zigzag",
         "--sequence-parallel"]),
])
def test_the_hybrid_with_context_parallelism_equals_serial(mpirun, tmp_path, capsys, n, layout):
    """cp groups inside each stage's replicas, with data parallelism, the pipeline (1F1B, 2
    micro-batches), tensor parallelism (the ring or Ulysses on the tp rank's heads) and
    sequence parallelism (the cp rank's tokens split over tp once more)."""
    saved = tmp_path / "hybrid_cp.npz"
    flags = [*TINY, "--steps", "3"]
    out = mpirun(n, ["-m", "mpipar.hybrid", *flags, *layout, "--micro-batches", "2",
                     "--save-params", saved], timeout=120).stdout
    assert_matches_serial(out, flags, saved, tmp_path, capsys)
    cp = int(layout[layout.index("--cp") + 1])
    assert f"context: each sequence over cp groups of {cp} replicas ({16 // cp} of its 16 " \
           f"tokens a rank)" in out, out


@pytest.mark.parametrize("n,flags,message", [
    (4, ["--dp", "4", "--cp", "3"], "--cp 3 must be at least 1 and divide the 4 data-parallel"),
    (4, ["--dp", "2", "--tp", "2", "--cp", "2", "--cp-algo", "ulysses", "--n-heads", "2",
         "--d-model", "16"], "--cp-algo ulysses gives each of the --tp 2 x --cp 2 ranks whole"),
    (4, ["--dp", "4", "--cp", "2", "--experts", "4"], "--cp 2 in the hybrid splits the dense"),
])
def test_the_hybrid_refuses_what_context_parallelism_cannot_split(n, flags, message):
    assert_refused(n, "hybrid", ["--model", "gpt", *flags], message)


def test_a_clipped_hybrid_checkpoint_resumes_in_the_context_parallel_trainer(mpirun, tmp_path,
                                                                           capsys):
    """--clip-grad in the hybrid with cp groups counts every entry once (the placements name
    dp and cp); its checkpoint, 3 steps on dp 2 x pp 2 with cp 2, resumes on the
    context-parallel trainer's zigzag over 4 ranks: the serial trainer's 6 clipped steps."""
    from mpipar import train

    ckpt, saved, whole = tmp_path / "ckpt", tmp_path / "cp.npz", tmp_path / "serial.npz"
    clipped = [*TINY, "--clip-grad", "0.05"]
    out = mpirun(4, ["-m", "mpipar.hybrid", *clipped, "--steps", "3", "--dp", "2", "--pp", "2",
                     "--cp", "2", "--checkpoint", ckpt], timeout=90).stdout
    assert "scaled down, in 3 of 3 steps" in out, out
    out = mpirun(4, ["-m", "mpipar.context_parallel", *clipped, "--steps", "6", "--cp-algo",
                     "zigzag", "--resume", ckpt, "--save-params", saved], timeout=90).stdout
    assert "after step 3" in out, out
    train.main("serial", [*clipped, "--steps", "6", "--save-params", str(whole)])
    assert_params_close(train.load_params(saved), train.load_params(whole), "hybrid -> cp")
