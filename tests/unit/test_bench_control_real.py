"""`bench control --engine real`'s arithmetic: the Wilson interval on attainment, the
rule that sets each scenario's duration from the requests it must bring, and the check of
the real engine's target. No engine runs."""

from __future__ import annotations

import json

import pytest

from wattserve.bench.control_real import (
    attainment_interval,
    describe_targets,
    duration_for_requests,
    real_targets,
    wilson_interval,
)
from wattserve.sim.scenarios import RequestMix, arrivals, make_scenarios


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


def _row(successes: int, count: int, j: float | None, over_s: float = 0.0) -> dict:
    return {
        "attainment_pct": round(100.0 * successes / count, 2),
        "attainment_ci": attainment_interval(successes, count),
        "j_per_token": j,
        "over_budget_s": over_s,
    }


def test_real_targets_check_the_controller_against_max_clock_less_its_half_width():
    # An fp32 burst of 2026-12-06: max clock over the budget, static_cap (the top clock
    # within it) and the controller both under max clock's bar.
    burst = {
        "controller": _row(132, 225, 0.6273),
        "max_clock": _row(177, 226, 0.7851, over_s=6.3),
        "static_cap": _row(158, 226, 0.7813),
    }
    steady = {"controller": _row(204, 204, 0.4802), "max_clock": _row(204, 204, 0.6216)}
    got = real_targets({"burst": burst, "steady60": steady, "pid_only": {"pid_power": burst}})
    assert set(got) == {"burst", "steady60"}  # a scenario without both is left out
    b = got["burst"]
    bar = round(78.32 - burst["max_clock"]["attainment_ci"]["half_width_pct"], 2)
    assert b["attainment_bar_pct"] == bar and 72.0 < bar < 74.0
    assert b["attainment_pct"] == 58.67 and not b["attainment_met"]
    assert b["j_per_token_met"] and b["max_clock_over_budget_s"] == 6.3
    assert b["static_cap_attainment_pct"] == 69.91 and not b["static_cap_reaches_bar"]
    s = got["steady60"]
    # 100 % against 100 % less its half-width: met; cheaper: met; no static_cap ran.
    assert s["attainment_met"] and s["j_per_token_met"] and s["over_budget_met"]
    assert "static_cap_reaches_bar" not in s
    lines = describe_targets(got)
    assert len(lines) == 2 and "not met" in lines[0] and "under the bar" in lines[0]


def test_real_targets_fail_the_energy_check_when_the_controller_costs_more_or_has_no_figure():
    over = {"controller": _row(200, 200, 0.70), "max_clock": _row(200, 200, 0.65)}
    none = {"controller": _row(200, 200, None), "max_clock": _row(200, 200, 0.65)}
    got = real_targets({"a": over, "b": none})
    assert got["a"]["attainment_met"] and not got["a"]["j_per_token_met"]
    assert not got["b"]["j_per_token_met"]


def test_real_targets_fail_the_budget_check_for_any_second_over():
    over = {"controller": _row(200, 200, 0.60, over_s=0.1), "max_clock": _row(200, 200, 0.65)}
    got = real_targets({"a": over})["a"]
    assert got["j_per_token_met"] and got["over_budget_s"] == 0.1 and not got["over_budget_met"]
    assert "0.1 s over budget (not met)" in describe_targets({"a": got})[0]


def test_a_trace_has_each_sample_each_changed_decision_and_each_request(tmp_path):
    from wattserve.bench.control import write_trace
    from wattserve.sim.run import RunResult, Sample

    steady = {"state": "tracking", "reason": "steady", "sm_clock_mhz": 945}
    samples = [
        Sample(0.1, 150.0, 300.0, 40.0, 1980, 2, 0, {"state": "learning", "sm_clock_mhz": 1980}),
        Sample(0.2, 140.0, 300.0, 40.0, 945, 2, 0, steady),
        Sample(0.3, 141.0, 300.0, 40.0, 945, 3, 1, dict(steady)),  # the same decision
    ]
    res = RunResult(
        "s", "controller", [(0.05, 0.4, 0.05, 12), (0.25, None, None, 0)], samples, 42.0, 12, 0.3, 1
    )
    path = tmp_path / "t.jsonl"
    write_trace(res, path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    kinds = [x["kind"] for x in lines]
    assert kinds == ["decision", "sample", "decision", "sample", "sample", "request", "request"]
    assert lines[2]["state"] == "tracking" and lines[2]["t_s"] == 0.2
    assert lines[4]["waiting"] == 1 and lines[4]["power_w"] == 141.0
    assert lines[6] == {
        "kind": "request",
        "arrival_s": 0.25,
        "ttft_s": None,
        "tpot_s": None,
        "output_tokens": 0,
    }
