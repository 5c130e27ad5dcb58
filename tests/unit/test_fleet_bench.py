"""`wattserve bench fleet` on a short simulated day: its JSON line and the hard partition."""

from __future__ import annotations

import json

from bench import fleet as bench_fleet


def test_bench_fleet_reports_and_never_exceeds_the_site_budget(capsys):
    assert bench_fleet.main(["--nodes", "8", "--day-s", "600"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "nodes",
        "goodput_gain_vs_equal_split_pct",
        "attainment_pct",
        "equal_split_attainment_pct",
        "site_over_budget_s",
        "allocation_cpu_ms_p99",
    ):
        assert key in last
    assert last["nodes"] == 8
    assert last["site_over_budget_s"] == 0
    allocator = last["strategies"]["allocator"]
    assert allocator["caps_over_budget_s"] == 0  # the limits in force, not only the draw
    assert allocator["goodput_tok_s"] >= last["strategies"]["equal_split"]["goodput_tok_s"]
