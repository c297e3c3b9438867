"""The cost-model check's fits recover what they fit."""

import numpy as np
import pytest

from mpipar import validate


def test_fit_power_recovers_a_rate_that_grows_with_size():
    flops = np.geomspace(1e6, 1e10, 12)
    seconds = 2e-4 + 3e-9 * flops**0.9
    fixed, scale, power = validate.fit_power(flops, seconds)
    assert power == pytest.approx(0.9, abs=1e-9)
    assert fixed == pytest.approx(2e-4, rel=1e-6)
    assert scale == pytest.approx(3e-9, rel=1e-6)


def test_fit_power_with_a_fixed_rate_finds_one():
    flops = np.geomspace(1e6, 1e10, 12)
    fixed, scale, power = validate.fit_power(flops, 1e-4 + flops / 1e11)
    assert (power, scale) == pytest.approx((1.0, 1e-11), rel=1e-6)
    assert fixed == pytest.approx(1e-4, rel=1e-6)


def test_lockstep_allreduce_interpolates_measured_costs(monkeypatch):
    rows = [dict(kind="allreduce-lockstep", ranks="4", bytes=str(n), seconds=str(t))
            for n, t in ((1000, 1e-3), (3000, 2e-3), (5000, 4e-3))]
    rows.append(dict(kind="pingpong", ranks="2", bytes="8", seconds="1"))  # not a lockstep row
    monkeypatch.setattr(validate, "read_csv", lambda name: rows)
    cost = validate.lockstep_allreduce()
    assert cost(2000, 4) == pytest.approx(1.5e-3)  # between two measured sizes
    assert cost(10, 4) == pytest.approx(1e-3)  # below them: the smallest's cost
    assert cost(7000, 4) == pytest.approx(6e-3)  # beyond them: the last slope
    assert cost(3000, 2) == pytest.approx(1e-3)  # 2 ranks: 1 of the 2 exchanges of 4
