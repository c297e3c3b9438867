"""The report's fits recover what they fit."""

import numpy as np
import pytest

from mpipar import report


def test_fit_power_recovers_a_rate_that_grows_with_size():
    flops = np.geomspace(1e6, 1e10, 12)
    seconds = 2e-4 + 3e-9 * flops**0.9
    fixed, scale, power = report.fit_power(flops, seconds)
    assert power == pytest.approx(0.9, abs=1e-9)
    assert fixed == pytest.approx(2e-4, rel=1e-6)
    assert scale == pytest.approx(3e-9, rel=1e-6)


def test_fit_power_with_a_fixed_rate_finds_one():
    flops = np.geomspace(1e6, 1e10, 12)
    fixed, scale, power = report.fit_power(flops, 1e-4 + flops / 1e11)
    assert (power, scale) == pytest.approx((1.0, 1e-11), rel=1e-6)
    assert fixed == pytest.approx(1e-4, rel=1e-6)
