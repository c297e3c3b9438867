"""The cost-model check's fits recover what they fit."""

import numpy as np
import pytest

from mpipar.tools import validate


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


def _tp_rows(both):
    """One step shape's one-rank rows: idle-partner times 1e-4 + 2e-9 F^0.9 s and, with
    ``both``, both-busy times 3e-4 + 4e-9 F^0.8 s, each plus an update of 1e-5 s per hidden."""
    rows = []
    for h, flops in zip((32, 64, 128, 256, 512, 1024), np.geomspace(1e6, 1e10, 6)):
        row = dict(hidden=str(h), flops=flops, ranks="1",
                   step_ms=str(1e3 * (1e-4 + 2e-9 * flops**0.9 + 1e-5 * h)))
        if both:
            row["step_both_ms"] = str(1e3 * (3e-4 + 4e-9 * flops**0.8 + 1e-5 * h))
        rows.append(row)
    return rows


def _calibrate(rows, ranks, share=0.7):
    return validate.tp_calibration(rows, ranks, share, lambda x: x["flops"],
                                   lambda x: 1e-5 * int(x["hidden"]))


def test_tp_calibration_of_two_ranks_uses_both_busy_times():
    """P = 2 takes the times of a one-rank block with its partner busy, the share already in
    them; P = 1 keeps the idle-partner times; a rank's compute at F / 2 is the formula's."""
    fixed, scale, power, share = _calibrate(_tp_rows(both=True), 2)
    assert (fixed, scale, power, share) == pytest.approx((3e-4, 4e-9, 0.8, 1.0), rel=1e-6)
    f = 3e9
    assert fixed + scale * (f / 2) ** power / share == pytest.approx(
        3e-4 + 4e-9 * (f / 2) ** 0.8, rel=1e-6)
    assert _calibrate(_tp_rows(both=True), 1) == pytest.approx((1e-4, 2e-9, 0.9, 1.0), rel=1e-6)


def test_tp_calibration_without_the_column_falls_back_to_the_flops_share():
    """A tp.csv written before the both-busy column: idle-partner times, flops.csv's share."""
    assert _calibrate(_tp_rows(both=False), 2) == pytest.approx((1e-4, 2e-9, 0.9, 0.7), rel=1e-6)
    empty = [dict(r, step_both_ms="") for r in _tp_rows(both=False)]
    assert _calibrate(empty, 2) == pytest.approx((1e-4, 2e-9, 0.9, 0.7), rel=1e-6)


def test_validation_reads_tp_csv_with_and_without_the_both_busy_column(monkeypatch):
    """The committed CSVs validate as they are; adding step_both_ms (here the one-rank time
    1.5 times) slows only the 2-rank tensor-parallel predictions."""
    from mpipar.tools.bench.common import read_csv

    def rows_with(column):
        def read(name):
            rows = read_csv(name)
            if name == "tp.csv":
                for r in rows:
                    r.pop("step_both_ms", None)
                    if column:
                        r["step_both_ms"] = str(1.5 * float(r["step_ms"]))
            return rows
        monkeypatch.setattr(validate, "read_csv", read)
        return validate.validation_rows()

    old, new = rows_with(False), rows_with(True)
    assert [r["config"] for r in old] == [r["config"] for r in new]
    for a, b in zip(old, new):
        if a["bench"] == "tp" and a["ranks"] == 2:
            assert b["predicted_ms"] > a["predicted_ms"]
        else:
            assert b["predicted_ms"] == a["predicted_ms"]
