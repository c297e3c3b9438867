"""The cost model agrees with the formulas of REFERENCE.md where they apply."""

import pytest

from mpipar import nn, schedules
from mpipar import simulate as S

HW = S.this_machine(flops=1e9, alpha=1e-5, beta=1e-9)


def test_ring_allreduce_formula():
    n, p = 8e6, 4
    assert S.ring_allreduce_time(n, p, 1e-5, 1e-9) == pytest.approx(
        2 * 3 * 1e-5 + 2 * 3 / 4 * n * 1e-9)
    assert S.ring_allreduce_time(n, 1, 1e-5, 1e-9) == 0.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_replayed_bubble_is_the_formula_for_equal_stages(name, p, m):
    """Equal stages, free messages: the replay's idle share is (p-1)/(m+p-1)."""
    spec = S.GPTSpec(vocab=8, d_model=32, n_heads=4, n_layers=p, seq_len=16, blocks_only=True)
    free = S.this_machine(flops=1e9, alpha=0.0, beta=0.0)
    r = S.predict(spec, free, pp=p, global_batch=4 * m, n_micro=m, schedule=name, dtype_bytes=4)
    busy = r["compute_s"]
    bubble = 1 - busy / r["step_s"]
    assert bubble == pytest.approx(schedules.bubble_formula(p, m, name), rel=1e-6)


def test_pipeline_messages_add_alpha_beta_per_hop():
    spec = S.GPTSpec(8, 32, 4, 2, 16, blocks_only=True)
    free = S.predict(spec, S.this_machine(1e9, 0.0, 0.0), pp=2, global_batch=4, n_micro=1)
    paid = S.predict(spec, S.this_machine(1e9, 1e-3, 0.0), pp=2, global_batch=4, n_micro=1)
    # one activation forward, one gradient back, both on the critical path
    assert paid["step_s"] - free["step_s"] == pytest.approx(2e-3)


def test_tensor_parallel_splits_compute_and_adds_four_allreduces_per_block():
    spec = S.GPTSpec(8, 64, 4, 3, 16, blocks_only=True)
    one = S.predict(spec, HW, tp=1, global_batch=4)
    two = S.predict(spec, HW, tp=2, global_batch=4)
    assert two["compute_s"] == pytest.approx(one["compute_s"] / 2)
    allreduce = S.ring_allreduce_time(4 * 16 * 64 * 2, 2, HW.tp_alpha, HW.tp_beta)
    assert two["tp_comm_s"] == pytest.approx(3 * 4 * allreduce)


def test_memory_follows_korthikanti_and_zero():
    spec = S.GPTSpec(50, 64, 4, 2, 32)
    s, b, h, a = 32, 4, 64, 4
    block = nn.Block(h, a)
    assert spec.stash_bytes(block, b, 1, 2) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert spec.stash_bytes(block, b, 2, 2) == pytest.approx(
        s * b * h * (10 + 24 / 2 + 5 * a * s / (h * 2)))
    plain = S.predict(spec, HW, dp=4, global_batch=16)
    zero = S.predict(spec, HW, dp=4, global_batch=16, zero=1)
    assert zero["mem_optimizer_bytes"] == pytest.approx(plain["mem_optimizer_bytes"] / 4)


def test_gpt3_parameter_count():
    """h V + L (12 h^2 + 13 h) + 2 h, plus the learned positions (s h) of this GPT."""
    g = S.GPT3
    table = S.layer_table(g, 1)
    total = sum(r["params"] for r in table)
    h, L, V = g.d_model, g.n_layers, g.vocab
    # the head here has its own matrix and bias (no weight tying): + h V + V
    assert total == h * V + g.seq_len * h + L * (12 * h * h + 13 * h) + 2 * h + h * V + V


def test_cli_prints_a_prediction(capsys):
    S.main(["--tp", "2", "--pp", "2", "--micro-batches", "4"])
    out = capsys.readouterr().out
    assert "predicted step" in out and "bubble" in out and "memory per rank" in out


def test_mixed_precision_adam_holds_16_bytes_per_parameter():
    """ZeRO (Rajbhandari et al. 2020): 2 + 2 + 12 bytes per parameter; stage 1 divides the 12."""
    spec = S.GPTSpec(50, 64, 4, 2, 32)
    n = sum(r["params"] for r in S.layer_table(spec, 1))
    plain = S.predict(spec, HW, dp=4, global_batch=16, dtype_bytes=2)
    state = sum(plain[f"mem_{k}_bytes"] for k in ("params", "grads", "optimizer"))
    assert state == pytest.approx(16 * n)
    zero = S.predict(spec, HW, dp=4, global_batch=16, dtype_bytes=2, zero=1)
    assert zero["mem_optimizer_bytes"] == pytest.approx(12 * n / 4)
