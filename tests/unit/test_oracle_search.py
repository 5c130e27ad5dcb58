"""The hindsight oracle's search and rule (wattserve.sim.oracle) on made-up cost surfaces:
no engine, no device; each "run" is a formula whose best admissible setting is known."""

from __future__ import annotations

import pytest

from wattserve.sim.oracle import Axis, StaticSetting, default_space, rank_key, search

LADDER_MHZ = tuple(range(345, 1981, 15))  # the virtual H200's


def _surface(s: StaticSetting) -> dict:
    """J/token: a cost per level, a bowl around 705 MHz, 48 sequences and 256 tokens, and a
    small gain per ms of pacing; pacing needs the clock: attainment 100 % only where
    clock >= 605 MHz + the interval. So the best admissible setting is int8 @ 705 MHz,
    48 / 256, paced at 100 ms (one step more pacing costs >= 30 MHz of clock, which costs
    more than it saves), none of it on the coarse grid."""
    level_j = {"fp32": 0.5, "bf16": 0.3, "int8": 0.2}[s.level]
    j = (
        level_j
        + ((s.sm_clock_mhz - 705) / 300) ** 2
        + ((s.max_num_seqs - 48) / 64) ** 2
        + ((s.max_num_batched_tokens - 256) / 512) ** 2
        - s.decode_interval_ms / 5000
    )
    ok = s.sm_clock_mhz >= 605 + s.decode_interval_ms
    return {"attainment_pct": 100.0 if ok else 60.0, "j_per_token": j, "over_budget_pct": 0.0}


def test_the_search_finds_the_known_best_setting_off_the_coarse_grid_in_few_runs():
    space = default_space(("fp32", "bf16", "int8"), LADDER_MHZ)
    runs: list[StaticSetting] = []

    def evaluate(s: StaticSetting) -> dict:
        runs.append(s)
        return _surface(s)

    found = search(evaluate, space, target_pct=99.0)
    assert found.setting == StaticSetting("int8", 705, 48, 256, 100.0)
    assert found.admissible and found.summary == _surface(found.setting)
    # Each setting once, and far fewer than the space holds (110 x 8 x 16 x 41 x 3).
    assert len(runs) == len(set(runs)) == found.evaluated
    assert found.evaluated <= 400
    # The coarse grid does not hold the answer: the refinement found it.
    for axis in ("sm_clock_mhz", "max_num_seqs", "max_num_batched_tokens"):
        assert getattr(found.setting, axis) not in space.axes[axis].coarse


def test_the_coarse_walk_stops_below_the_first_clock_that_misses():
    space = default_space(("fp32",), LADDER_MHZ)
    runs: list[StaticSetting] = []

    def evaluate(s: StaticSetting) -> dict:
        runs.append(s)
        return _surface(s)

    search(evaluate, space, target_pct=99.0, starts=0)
    unpaced = sorted(s.sm_clock_mhz for s in runs if s.decode_interval_ms == 0)
    # 645 MHz meets the target unpaced, 495 misses: 345 is never run.
    assert unpaced == [495, 645, 795, 945, 1245, 1545, 1845, 1980]


def test_the_rule_admissible_first_then_attainment_then_j():
    def row(att, j, over=0.0):
        return {"attainment_pct": att, "j_per_token": j, "over_budget_pct": over}

    assert rank_key(row(99.0, 2.0), 99.0) < rank_key(row(98.9, 1.0), 99.0)
    assert rank_key(row(99.5, 1.0), 99.0) < rank_key(row(100.0, 1.1), 99.0)
    # Over budget more than 1 % of the time is not admissible, whatever it saves.
    assert rank_key(row(100.0, 2.0, over=0.5), 99.0) < rank_key(row(100.0, 1.0, over=5.0), 99.0)
    # Where nothing is admissible: within the budget first, then the higher attainment.
    assert rank_key(row(90.0, 2.0), 99.0) < rank_key(row(95.0, 1.0, over=5.0), 99.0)
    assert rank_key(row(95.0, 2.0), 99.0) < rank_key(row(90.0, 1.0), 99.0)


def test_no_admissible_setting_gives_the_best_attainment_flagged_as_such():
    space = default_space(("fp32", "bf16"), LADDER_MHZ)

    def evaluate(s: StaticSetting) -> dict:
        att = 50.0 + s.sm_clock_mhz / 100 - s.decode_interval_ms / 100
        return {"attainment_pct": att, "j_per_token": 1.0, "over_budget_pct": 0.0}

    found = search(evaluate, space, target_pct=99.0)
    assert not found.admissible
    assert found.setting.sm_clock_mhz == 1980 and found.setting.decode_interval_ms == 0.0
    assert found.as_dict()["admissible"] is False


def test_an_axis_refuses_coarse_values_it_does_not_hold():
    with pytest.raises(ValueError, match="subset"):
        Axis.of((1, 2, 3), (4,))
    # Per-phase clocks: a decode-only clock at or above the step clock is not a setting.
    assert not StaticSetting("fp32", 645, decode_clock_mhz=645).is_valid()
    assert StaticSetting("fp32", 645, decode_clock_mhz=495).is_valid()
