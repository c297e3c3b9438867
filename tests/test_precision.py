"""Number formats and the dynamic loss scale: the formats' facts as their definitions give
them, where fp16 and bf16 overflow and round, and the scale's trajectory through a forced
sequence of overflows exactly as the rules of mpipar/engine/precision.py state them."""

import numpy as np
import pytest

from mpipar.engine import precision as P


@pytest.mark.parametrize("name, exponent, mantissa", [
    ("fp32", 8, 23), ("fp16", 5, 10), ("bf16", 8, 7), ("fp8_e4m3", 4, 3), ("fp8_e5m2", 5, 2)])
def test_the_facts_follow_from_the_bits(name, exponent, mantissa):
    """epsilon 2^-m, smallest normal 2^(2 - 2^(e-1)), smallest subnormal 2^-m times it, and the
    largest number just under 2^(2^(e-1)) (e4m3: 448, its top exponent holding numbers)."""
    f = P.facts(name)
    assert (f["exponent_bits"], f["mantissa_bits"]) == (exponent, mantissa)
    assert f["bits"] == 1 + exponent + mantissa
    bias = 2 ** (exponent - 1) - 1
    assert f["eps"] == 2.0 ** -mantissa
    assert f["smallest_normal"] == 2.0 ** (1 - bias)
    assert f["smallest_subnormal"] == 2.0 ** (1 - bias - mantissa)
    top = 448.0 if name == "fp8_e4m3" else (2 - 2.0 ** -mantissa) * 2.0 ** bias
    assert f["max"] == top


def test_where_fp16_and_bf16_overflow_and_round():
    """The module docstring's examples: in fp16 1e-8 rounds to 0 and 70,000 to inf; bf16
    holds both (fp32's range) but rounds 1 + 2^-9 back to 1."""
    fp16, bf16 = P.dtype_of("fp16"), P.dtype_of("bf16")
    with np.errstate(over="ignore"):
        assert np.array(1e-8, dtype=fp16) == 0 and np.isinf(np.array(7e4, dtype=fp16))
    assert np.array(1e-8, dtype=bf16) > 0 and np.isfinite(np.array(7e4, dtype=bf16))
    assert np.array(1 + 2.0 ** -9, dtype=bf16) == 1
    assert np.array(1 + 2.0 ** -7, dtype=bf16) > 1  # one epsilon is kept


def trajectory(scaler, overflows):
    out = []
    for overflow in overflows:
        taken = scaler.update(overflow)
        out.append((taken, scaler.scale))
    return out


def test_the_scale_follows_megatron_s_rules_with_hysteresis():
    """Growth after 3 finite steps; the first overflow after a growth keeps the scale
    (hysteresis 2), the second and every later one back off; every overflowing step is
    skipped; min_scale bounds the back-off."""
    s = P.LossScaler(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    got = trajectory(s, [False, False, False, True, False, True, True, True, False, False,
                         False])
    assert got == [(True, 8.0), (True, 8.0), (True, 16.0),  # grows after 3 finite
                   (False, 16.0),  # skipped; hysteresis keeps the scale
                   (True, 16.0),  # the count of finite steps restarted
                   (False, 8.0), (False, 4.0), (False, 2.0),  # out of hysteresis: back off
                   (True, 2.0), (True, 2.0), (True, 4.0)]  # growth resets the hysteresis
    assert s.skipped == 4


def test_hysteresis_1_is_pytorch_s_grad_scaler():
    """PyTorch: back off at every overflow, grow after growth_interval finite steps."""
    s = P.LossScaler(init_scale=2.0 ** 16, growth_interval=2, hysteresis=1, min_scale=0.0)
    got = trajectory(s, [True, False, False, True, True, False])
    assert [scale for _, scale in got] == [2.0 ** 15, 2.0 ** 15, 2.0 ** 16, 2.0 ** 15,
                                           2.0 ** 14, 2.0 ** 14]
    assert [taken for taken, _ in got] == [False, True, True, False, False, True]


def test_the_state_resumes_the_trajectory():
    a = P.LossScaler(init_scale=4.0, growth_interval=2)
    trajectory(a, [False, True])
    b = P.LossScaler(init_scale=1.0, growth_interval=2)  # the same rules, another state
    b.load(a.state())
    assert trajectory(b, [False, False, True]) == trajectory(a, [False, False, True])


@pytest.mark.parametrize("kwargs", [dict(init_scale=float("inf")), dict(init_scale=0.0),
                                    dict(init_scale=float("nan")), dict(growth_factor=1.0),
                                    dict(backoff_factor=1.0), dict(hysteresis=0)])
def test_a_scale_that_cannot_work_is_refused(kwargs):
    with pytest.raises(ValueError):
        P.LossScaler(**kwargs)
