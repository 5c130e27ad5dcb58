"""The run figures' list of missed requests (wattserve/sim/metrics.py)."""

from __future__ import annotations

from wattserve.controller.policy import Policy
from wattserve.sim.metrics import missed_requests, summarize
from wattserve.sim.run import RunResult, Sample
from wattserve.sim.scenarios import Scenario


def test_misses_name_each_late_or_unfinished_request_with_the_settings_at_its_arrival():
    policy = Policy(power_budget_w=300.0, ttft_slo_ms=1000.0, tpot_slo_ms=100.0)
    samples = [
        Sample(1.0, 200.0, 300.0, 50.0, 1980, 2, 0, {"decode_interval_ms": 0}),
        Sample(2.0, 150.0, 300.0, 50.0, 645, 3, 1, {"decode_interval_ms": 150}),
        Sample(3.0, 150.0, 300.0, 50.0, 795, 1, 0, {"decode_interval_ms": 100}),
    ]
    requests = [
        (0.5, 0.2, 0.05, 10),  # met
        (2.4, 1.5, 0.05, 10),  # TTFT late: arrived under the 645 MHz sample
        (1.2, 0.3, 0.15, 10),  # TPOT late: arrived under the 1980 MHz sample
        (3.5, None, None, 0),  # never finished
    ]
    res = RunResult("steady60", "controller", requests, samples, 100.0, 40, 4.0, 3)
    misses = missed_requests(res, policy)
    assert [m["arrival_s"] for m in misses] == [1.2, 2.4, 3.5]  # in arrival order
    assert misses[0]["tpot_ms"] == 150.0 and misses[0]["at_arrival"]["sm_clock_mhz"] == 1980
    assert misses[1]["ttft_ms"] == 1500.0 and misses[1]["at_arrival"] == {
        "sm_clock_mhz": 645,
        "running": 3,
        "waiting": 1,
        "decode_interval_ms": 150,
    }
    assert misses[2]["ttft_ms"] is None and misses[2]["at_arrival"]["sm_clock_mhz"] == 795
    assert missed_requests(res, policy, limit=1) == misses[:1]
    summary = summarize(res, policy, Scenario("steady60", 4.0, lambda t: 0.6, lambda t: 300.0))
    assert summary["attainment_pct"] == 25.0 and summary["misses"] == misses
