"""`bench control --engine real`'s arithmetic: the Wilson interval on attainment and the
rule that sets each scenario's duration from the requests it must bring. No engine runs."""

from __future__ import annotations

import pytest

from bench.control_real import attainment_interval, duration_for_requests, wilson_interval
from daemon.sim.scenarios import RequestMix, arrivals, make_scenarios


@pytest.mark.parametrize(
    ("successes", "count", "lo", "hi"),
    [
        (5, 10, 0.2366, 0.7634),  # symmetric about 1/2
        (0, 10, 0.0, 0.2775),  # no success: lo is 0, hi is not
        (10, 10, 0.7225, 1.0),
        (190, 200, 0.9104, 0.9726),
    ],
)
def test_wilson_interval_matches_the_score_formula(successes, count, lo, hi):
    got = wilson_interval(successes, count)
    assert got == pytest.approx((lo, hi), abs=5e-5)


def test_a_wider_confidence_or_fewer_requests_widen_the_interval():
    lo95, hi95 = wilson_interval(190, 200)
    lo99, hi99 = wilson_interval(190, 200, 0.99)
    assert lo99 < lo95 and hi99 > hi95
    lo24, hi24 = wilson_interval(23, 24)  # the old 24-request runs: about 96 %
    assert hi24 - lo24 > 2 * (hi95 - lo95)


def test_attainment_interval_reports_count_successes_and_half_width_in_percent():
    row = attainment_interval(196, 200)
    assert row["count"] == 200 and row["successes"] == 196 and row["confidence"] == 0.95
    assert row["lo_pct"] < 98.0 < row["hi_pct"]
    assert row["half_width_pct"] == pytest.approx((row["hi_pct"] - row["lo_pct"]) / 2, abs=0.01)


@pytest.mark.parametrize("bad", [(-1, 10), (11, 10), (0, 0)])
def test_wilson_interval_refuses_impossible_counts(bad):
    with pytest.raises(ValueError):
        wilson_interval(*bad)


def _build(name: str):
    return lambda d: make_scenarios(d, 300.0, 220.0, 180.0)[name]


@pytest.mark.parametrize(
    ("name", "mean_load"), [("steady60", 0.6), ("budget_step", 0.6), ("burst", 0.575)]
)
def test_each_scenario_lasts_until_its_requests_are_due(name, mean_load):
    mix = RequestMix()
    capacity = 0.75
    d = duration_for_requests(_build(name), 200, capacity, mix)
    expected_s = 200 / (mean_load * capacity)
    # At least the duration that makes 200 arrivals expected (the burst's 15 s of 140 %
    # per minute averages 0.575 over whole minutes), longer only where the seeded draw
    # fell short, and then by no more than a few 5 % steps.
    assert expected_s * 0.97 <= d <= expected_s * 1.25
    assert len(arrivals(_build(name)(d), capacity, mix)) >= 200
    if d > expected_s * 1.01:
        assert len(arrivals(_build(name)(d / 1.05), capacity, mix)) < 200


def test_a_doubled_capacity_halves_the_duration_of_a_steady_load():
    mix = RequestMix()
    d1 = duration_for_requests(_build("steady60"), 100, 1.0, mix, grow=1.0001, rounds=10_000)
    d2 = duration_for_requests(_build("steady60"), 100, 2.0, mix, grow=1.0001, rounds=10_000)
    # The same seeded draw at twice the rate: the n-th arrival comes at half the time.
    assert d2 == pytest.approx(d1 / 2, rel=1e-3)
