"""The virtual GPU's physics, its engine coupling, and the telemetry sampler.

Everything runs on a SimClock: minutes of simulated time per test, no sleeping,
except the one test that checks the simulator also runs on the real monotonic clock.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest

from wattserve.daemon.device.gate import ActuationGate
from wattserve.daemon.device.managed import ManagedDevice
from wattserve.daemon.device.protocol import EngineActivity, SetOutcome, energy_between_j
from wattserve.daemon.device.sampler import TelemetrySampler, sampling_period_s
from wattserve.daemon.device.state import StateFile
from wattserve.daemon.device.virtual import (
    SimClock,
    VirtualGpu,
    VirtualGpuParams,
    compute_fraction,
    power_w,
    run_activity,
    stretch_factor,
)

P = VirtualGpuParams()

# A 7B-parameter bf16 Llama-style model with grouped-query attention: 2 bytes per weight;
# KV per token = 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes = 128 KiB.
_PARAMS = 7e9
_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


def decode(batch: int, step_s: float = 0.02, context_tokens: int = 1024) -> EngineActivity:
    attention_flops = 4 * batch * context_tokens * 4096 * 32
    return EngineActivity(
        step_duration_s=step_s,
        decode_tokens=batch,
        weight_bytes_read=int(2 * _PARAMS),
        kv_bytes_read=batch * context_tokens * _KV_BYTES_PER_TOKEN,
        flops=2 * _PARAMS * batch + attention_flops,
    )


def prefill(tokens: int = 4096, step_s: float = 0.05) -> EngineActivity:
    return EngineActivity(
        step_duration_s=step_s,
        prefill_tokens=tokens,
        weight_bytes_read=int(2 * _PARAMS),
        kv_bytes_read=tokens * _KV_BYTES_PER_TOKEN,
        flops=2 * _PARAMS * tokens,
    )


def make(params: VirtualGpuParams = P, tmp_path=None, mode="control"):
    clock = SimClock()
    gpu = VirtualGpu(params, clock=clock)
    device = None
    if tmp_path is not None:
        device = ManagedDevice(gpu, ActuationGate(mode), StateFile(tmp_path / "state.json"))
    return clock, gpu, device


def test_calibration_points_match_the_published_figures(tmp_path):
    clock, gpu, device = make(tmp_path=tmp_path)
    bare = gpu.read()
    assert 65 <= bare.power_avg_w <= 75  # idle, no CUDA context
    assert bare.sm_clock_mhz == 345 and bare.clock_event_reasons == ("GpuIdle",)

    gpu.set_context_open(True)
    run_activity(gpu, clock, None, 5)
    ctx = gpu.read()
    assert 110 <= ctx.power_avg_w <= 125  # idle with a context
    assert ctx.sm_clock_mhz == 1980

    # Decode of a 7B model, batch 1..64, anywhere on the clock ladder: 137-300 W published.
    for batch in (1, 8, 64):
        fraction = compute_fraction(P, decode(batch))
        for clock_mhz in P.sm_clock_ladder_mhz():
            assert 130 <= power_w(P, clock_mhz, 45.0, fraction) <= 315

    run_activity(gpu, clock, decode(64), 60)
    assert 250 <= gpu.read().power_avg_w <= 315

    # Prefill would exceed the 700 W limit at full clock, so the firmware caps it.
    assert power_w(P, 1980, 60.0, compute_fraction(P, prefill())) > 750
    run_activity(gpu, clock, prefill(), 60)
    capped = gpu.read()
    assert "SwPowerCap" in capped.clock_event_reasons
    assert 680 <= capped.power_avg_w <= 705
    assert capped.sm_clock_mhz < 1980


def test_power_rises_with_sm_clock_and_with_activity(tmp_path):
    for fraction in (
        None,
        0.0,
        compute_fraction(P, decode(1)),
        compute_fraction(P, decode(64)),
        0.95,
    ):
        watts = [power_w(P, f, 50.0, fraction) for f in P.sm_clock_ladder_mhz()]
        assert all(b > a for a, b in zip(watts, watts[1:], strict=False)), fraction

    clock, gpu, device = make(tmp_path=tmp_path)
    by_clock = []
    for clock_mhz in (345, 1005, 1500, 1980):
        assert device.lock_sm_clocks_mhz(clock_mhz, clock_mhz).in_force
        run_activity(gpu, clock, decode(8), 10)
        by_clock.append(gpu.read().power_avg_w)
    assert by_clock == sorted(by_clock) and by_clock[0] < by_clock[-1] - 40

    device.lock_sm_clocks_mhz(1500, 1500)
    by_activity = []
    for activity in (None, decode(1), decode(64), prefill()):
        gpu.set_context_open(True)
        run_activity(gpu, clock, activity, 10)
        by_activity.append(gpu.read().power_avg_w)
    assert by_activity == sorted(by_activity) and by_activity[0] < by_activity[-1] - 200

    # Half the time busy draws less than always busy.
    clock, gpu, _ = make()
    for _ in range(100):
        run_activity(gpu, clock, decode(64, step_s=0.05), 0.05)
        run_activity(gpu, clock, None, 0.05)
    half = gpu.read()
    run_activity(gpu, clock, decode(64, step_s=0.05), 10)
    full = gpu.read()
    assert half.power_avg_w < full.power_avg_w - 50
    assert 40 <= half.gpu_util_pct <= 60 and full.gpu_util_pct == pytest.approx(100.0)


def test_decode_energy_per_token_is_u_shaped_in_the_sm_clock(tmp_path):
    clock, gpu, device = make(tmp_path=tmp_path)
    activity = decode(64)
    joules_per_token = {}
    for clock_mhz in (345, 600, 855, 1005, 1245, 1500, 1755, 1980):
        device.lock_sm_clocks_mhz(clock_mhz, clock_mhz)
        run_activity(gpu, clock, activity, 5)  # settle at this clock
        before = gpu.read()
        steps = run_activity(gpu, clock, activity, 20)
        after = gpu.read()
        joules_per_token[clock_mhz] = energy_between_j(before, after) / (steps * 64)
    best = min(joules_per_token, key=joules_per_token.get)
    assert best not in (345, 1980)
    assert joules_per_token[1980] > 1.2 * joules_per_token[best]
    assert joules_per_token[345] > 1.1 * joules_per_token[best]


def test_thermal_step_response_has_the_configured_time_constant():
    # Leakage off and no rounding, so the response is exactly first order.
    for tau_s in (30.0, 60.0):
        params = dataclasses.replace(
            P,
            leakage_w_per_c=0.0,
            temperature_resolution_c=0.0,
            thermal_time_constant_s=tau_s,
            power_avg_noise_fraction=0.0,
        )
        clock, gpu, _ = make(params)
        gpu.set_context_open(True)
        run_activity(gpu, clock, None, 10 * tau_s)
        start_c = gpu.read().gpu_temp_c
        run_activity(gpu, clock, decode(64, step_s=0.05), tau_s)
        at_tau = gpu.read()
        final_c = params.ambient_c + params.thermal_resistance_c_per_w * at_tau.power_avg_w
        rise = (at_tau.gpu_temp_c - start_c) / (final_c - start_c)
        assert rise == pytest.approx(1 - math.exp(-1), abs=0.01)
        run_activity(gpu, clock, decode(64, step_s=0.05), 9 * tau_s)
        assert gpu.read().gpu_temp_c == pytest.approx(final_c, abs=0.1)


def test_thermal_throttling_engages_above_the_thresholds_with_the_right_reasons():
    clock, gpu, _ = make()
    run_activity(gpu, clock, prefill(), 300)
    cool = gpu.read()
    assert not {"SwThermal", "HwThermal"} & set(cool.clock_event_reasons)

    gpu.set_ambient_c(55.0)  # a hot aisle: 700 W would heat the die past 87 C
    run_activity(gpu, clock, prefill(), 300)
    warm = gpu.read()
    assert "SwThermal" in warm.clock_event_reasons and "HwThermal" not in warm.clock_event_reasons
    assert 87 <= warm.gpu_temp_c < 89  # software slowdown holds the die below the HW threshold
    assert warm.sm_clock_mhz < cool.sm_clock_mhz and warm.thermal_margin_c <= 0

    gpu.set_ambient_c(86.0)  # cooling failure: even idle crosses the 89 C slowdown threshold
    run_activity(gpu, clock, prefill(), 300)
    hot = gpu.read()
    assert {"HwThermal", "HwSlowdown"} <= set(hot.clock_event_reasons)
    assert hot.gpu_temp_c >= 89 and hot.sm_clock_mhz <= 990

    gpu.set_ambient_c(25.0)
    run_activity(gpu, clock, prefill(), 300)
    assert not {"SwThermal", "HwThermal", "HwSlowdown"} & set(gpu.read().clock_event_reasons)

    gpu.set_power_brake(True)
    run_activity(gpu, clock, prefill(), 1)
    braked = gpu.read()
    assert {"HwPowerBrake", "HwSlowdown"} <= set(braked.clock_event_reasons)
    assert braked.sm_clock_mhz == 345


def test_power_limit_is_held_and_reported_as_sw_power_cap(tmp_path):
    clock, gpu, device = make(tmp_path=tmp_path)
    result = device.set_power_limit_w(400)
    assert result.outcome is SetOutcome.APPLIED and not result.clamped
    run_activity(gpu, clock, prefill(), 30)
    t = gpu.read()
    assert t.power_limit_w == 400 and "SwPowerCap" in t.clock_event_reasons
    assert 380 <= t.power_avg_w <= 402
    run_activity(gpu, clock, decode(1), 30)
    assert "SwPowerCap" not in gpu.read().clock_event_reasons  # decode stays under 400 W

    over = device.set_power_limit_w(900)
    assert over.clamped and over.target_w == 700 and over.in_force
    assert device.set_power_limit_w(700).outcome is SetOutcome.UNCHANGED


def test_energy_counter_equals_the_integral_of_power_within_one_percent():
    clock, gpu, _ = make()
    first = previous = gpu.read()
    integral_j = 0.0
    trace = [decode(64), prefill(), None, decode(1), prefill(tokens=512, step_s=0.03), None] * 3
    for activity in trace:
        for _ in range(50):  # 5 s per segment, read about every 0.1 s
            run_activity(gpu, clock, activity, 0.1)
            now = gpu.read()
            integral_j += now.power_w * (now.timestamp_s - previous.timestamp_s)
            previous = now
    counted_j = energy_between_j(first, previous)
    assert counted_j > 20_000
    assert integral_j == pytest.approx(counted_j, rel=0.01)


def test_energy_counter_and_power_readings_update_once_per_period():
    clock, gpu, _ = make()  # starts at t = 1000.0 s, a period boundary
    run_activity(gpu, clock, None, 0.02)
    a = gpu.read()
    clock.advance(0.05)
    b = gpu.read()
    assert a.energy_j == b.energy_j and a.power_w == b.power_w  # same 100 ms period
    clock.advance(0.05)
    c = gpu.read()
    assert c.energy_j > b.energy_j
    assert c.power_avg_window_s == 1.0 and c.power_w_is_instant


def test_step_stretch_follows_the_clock_and_the_arithmetic_intensity(tmp_path):
    ridge = P.peak_flops / P.peak_memory_bandwidth_bytes_per_s
    balanced = EngineActivity(0.1, weight_bytes_read=10**9, flops=ridge * 1e9)
    memory_only = EngineActivity(0.1, weight_bytes_read=10**9)
    assert compute_fraction(P, balanced) == pytest.approx(0.5)
    assert compute_fraction(P, memory_only) == 0.0

    clock, gpu, device = make(tmp_path=tmp_path)
    assert gpu.record_engine_step(balanced) == pytest.approx(0.0)
    device.lock_sm_clocks_mhz(990, 990)  # half of f_max
    assert gpu.record_engine_step(balanced) == pytest.approx(0.1 * 0.5 * (2 - 1))
    assert gpu.record_engine_step(memory_only) == pytest.approx(0.0)
    assert stretch_factor(P, 1.0, 990) == pytest.approx(2.0)

    # Under a power cap the firmware lowers the clock, so prefill steps stretch.
    device.reset()
    run_activity(gpu, clock, prefill(), 5)
    assert gpu.record_engine_step(prefill()) > 0


def test_same_seed_same_telemetry_other_seed_other_noise():
    def trace(seed: int) -> list[tuple]:
        clock, gpu, _ = make(dataclasses.replace(P, seed=seed))
        out = []
        for activity in (decode(8), prefill(), None):
            run_activity(gpu, clock, activity, 3)
            t = gpu.read()
            out.append((t.power_w, t.power_avg_w, t.energy_j, t.gpu_temp_c, t.sm_clock_mhz))
        return out

    assert trace(1) == trace(1)
    assert trace(1) != trace(2)


def test_long_idle_stretches_are_integrated_correctly():
    clock, gpu, _ = make()
    before = gpu.read()
    clock.advance(20_000.0)
    after = gpu.read()
    assert energy_between_j(before, after) == pytest.approx(before.power_avg_w * 20_000, rel=0.01)
    assert 65 <= after.power_avg_w <= 75


def test_runs_on_the_real_monotonic_clock():
    gpu = VirtualGpu(P)  # time.monotonic
    first = gpu.read()
    assert gpu.record_engine_step(decode(8, step_s=0.01)) >= 0.0
    time.sleep(0.25)
    second = gpu.read()
    assert second.timestamp_s > first.timestamp_s
    assert second.energy_j > first.energy_j


def test_params_are_validated():
    with pytest.raises(ValueError, match="thermal_time_constant_s"):
        VirtualGpuParams(thermal_time_constant_s=0)
    with pytest.raises(ValueError, match="whole number of steps"):
        VirtualGpuParams(sm_clock_max_mhz=1981)
    with pytest.raises(ValueError, match="flops"):
        EngineActivity(0.1, flops=-1)


# -- sampler ------------------------------------------------------------------------------


def test_sampler_never_samples_faster_than_the_device_updates(tmp_path):
    assert sampling_period_s(100.0, 0.1) == pytest.approx(0.1)
    assert sampling_period_s(2.0, 0.1) == pytest.approx(0.5)
    _, _, device = make(tmp_path=tmp_path)
    assert TelemetrySampler(device, rate_hz=100.0).rate_hz == pytest.approx(10.0)


def test_sampler_marks_old_samples_stale_and_feeds_sinks(tmp_path):
    clock, _, device = make(tmp_path=tmp_path)
    seen = []

    def broken_sink(t):
        raise RuntimeError("sink down")

    sampler = TelemetrySampler(device, rate_hz=10.0, sinks=(broken_sink, seen.append))
    assert sampler.latest() is None
    sampled = sampler.sample_once()
    assert seen == [sampled] and not sampler.latest().stale
    clock.advance(0.15)
    assert not sampler.latest().stale
    clock.advance(0.1)  # now 0.25 s old: more than two 0.1 s periods
    assert sampler.latest().stale


def test_sampler_thread_starts_and_stops(tmp_path):
    gpu = VirtualGpu(P)  # real time for the thread
    device = ManagedDevice(gpu, ActuationGate("observe"), StateFile(tmp_path / "s.json"))
    got_three = threading.Event()
    samples = []

    def sink(t):
        samples.append(t)
        if len(samples) >= 3:
            got_three.set()

    sampler = TelemetrySampler(device, rate_hz=20.0, sinks=(sink,))
    started_s = time.monotonic()
    sampler.start()
    try:
        assert got_three.wait(5.0)
    finally:
        sampler.stop()
    elapsed_s = time.monotonic() - started_s
    count = len(samples)
    time.sleep(0.25)
    assert len(samples) == count  # stopped
    # 20 Hz asked, the device updates at 10 Hz: deadlines 0.1 s apart, never more samples.
    assert sampler.period_s == pytest.approx(0.1)
    assert count <= elapsed_s / 0.1 + 1
