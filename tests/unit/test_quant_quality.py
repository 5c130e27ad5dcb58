"""The quality table the quant bench saves and the controller reads (no torch needed)."""

from __future__ import annotations

import math

from wattserve.bench.quant import greedy_agreement_pct
from wattserve.daemon.quant_table import (
    QUALITY_TABLE_VERSION,
    levels_within_ppl_increase,
    load_quality_table,
    quality_table_path,
    save_quality_table,
)


def table(**increase_pct: float) -> dict:
    rows = {lvl.replace("_", "-"): {"ppl_increase_pct": pct} for lvl, pct in increase_pct.items()}
    return {"version": QUALITY_TABLE_VERSION, "full_precision": "fp32", "levels": rows}


def test_levels_over_the_ppl_budget_are_forbidden():
    t = table(fp32=0.0, bf16=0.1, int8=0.4, int4=5.6, int4_g128=12.0)
    assert levels_within_ppl_increase(t, 10.0) == ["fp32", "bf16", "int8", "int4"]
    assert levels_within_ppl_increase(t, 1.0) == ["fp32", "bf16", "int8"]
    assert levels_within_ppl_increase(t, 5.6) == ["fp32", "bf16", "int8", "int4"]
    # full precision qualifies whatever the budget; unmeasured or NaN rows never do
    t["levels"]["int8"] = {"ppl_increase_pct": math.nan}
    t["levels"]["fp8"] = {}
    assert levels_within_ppl_increase(t, 0.0) == ["fp32"]
    assert levels_within_ppl_increase(t, 100.0) == ["fp32", "bf16", "int4", "int4-g128"]


def test_table_round_trips_and_rejects_other_versions(tmp_path):
    path = quality_table_path(tmp_path, "SmolLM2-135M-Instruct")
    assert load_quality_table(path) is None
    t = table(fp32=0.0, int4=5.6)
    save_quality_table(path, t)
    assert path.parent.name == "quant" and load_quality_table(path) == t
    save_quality_table(path, {**t, "version": QUALITY_TABLE_VERSION + 1})
    assert load_quality_table(path) is None
    path.write_text("{not json")
    assert load_quality_table(path) is None


def test_greedy_agreement_counts_tokens_before_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert greedy_agreement_pct(ref, ref) == 100.0
    # first: diverges at index 2 (later matches do not count); second: at index 0
    assert greedy_agreement_pct(ref, [[1, 2, 9, 4], [0, 6, 7, 8]]) == 25.0
