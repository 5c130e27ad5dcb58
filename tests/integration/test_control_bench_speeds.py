"""`wattserve bench control --engine real` gives the controller a speed table measured on
the machine it runs on (as the daemon's comes from bench quant run there), not the
calibration's, which may come from another machine."""

from __future__ import annotations

import math

from tests.integration.test_control_bench import _calibration, _engine_model
from wattserve.bench.control_real import measure_level_speeds_real
from wattserve.bench.control_systems import make_system
from wattserve.controller.policy import ControlMode, Policy


def test_level_speeds_are_measured_on_the_real_engine(tiny_llama):
    speeds = measure_level_speeds_real(tiny_llama, ("fp32", "bf16"))
    assert list(speeds) == ["fp32", "bf16"]
    for level, row in speeds.items():
        assert set(row) == {"decode_tok_s_bs16", "prefill_tok_s"}, level
        assert all(math.isfinite(v) and v > 0 for v in row.values()), (level, row)


def _options(system) -> dict[str, tuple[float | None, float | None]]:
    options = system.loop.controller.engine.quant_options
    return {o.level: (o.decode_tok_s, o.prefill_tok_s) for o in options}


def test_the_controller_ranks_levels_by_the_table_it_is_given(tmp_path):
    policy = Policy(power_budget_w=300, ttft_slo_ms=2000, tpot_slo_ms=400, mode=ControlMode.AUTO)
    cal = _calibration()
    engine, clock, device = _engine_model(tmp_path)
    # bf16 on a CPU without bf16 instructions: slower than fp32 at both.
    measured = {
        "fp32": {"decode_tok_s_bs16": 147.7, "prefill_tok_s": 430.0},
        "bf16": {"decode_tok_s_bs16": 47.4, "prefill_tok_s": 72.0},
    }
    levels = ("fp32", "bf16")
    given = make_system("controller", engine, device, clock, policy, cal, levels, True, measured)
    assert _options(given) == {"fp32": (147.7, 430.0), "bf16": (47.4, 72.0)}
    # Without a measured table: the calibration's speeds, where bf16 is ahead at both.
    default = _options(make_system("controller", engine, device, clock, policy, cal, levels, True))
    assert default["bf16"][0] > default["fp32"][0] > 0
    assert default["bf16"][1] > default["fp32"][1] > 0


def test_prefill_speed_is_measured_on_computed_tokens(tiny_llama, monkeypatch):
    # Each level's prefill is timed twice on one prompt: a prefix cache would serve the
    # second from its blocks and the speed would read as the cache's, not the level's.
    import wattserve.bench.control_real as control_real

    engines = []
    make = control_real._real_engine

    def spy(*args, **kwargs):
        engines.append(make(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(control_real, "_real_engine", spy)
    measure_level_speeds_real(tiny_llama, ("fp32", "bf16"))
    assert len(engines) == 1
    counters = engines[0].counters
    assert counters.prompt_tokens > 2 * 2 * 256  # both rounds of both levels ran
    assert counters.prefix_cache_hit_tokens == 0
