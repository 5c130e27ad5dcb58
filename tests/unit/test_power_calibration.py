"""The virtual GPU's power calibrated from measurement (daemon/device/power_calibration.py).

The H200's three measured loads of 2026-12-04 (tests/data/power-h200-2026-12-04.json) are
the fixture: the fit and the virtual GPU that loads it must reproduce each within 10 %,
where the profile's physical model alone predicted 0.94x, 1.29x and 3.03x.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wattserve.daemon.device.power_calibration import (
    LoadPoint,
    PowerCalibration,
    PowerCalibrationError,
    fit_power_calibration,
)
from wattserve.daemon.device.protocol import EngineActivity
from wattserve.daemon.device.virtual import (
    SimClock,
    VirtualGpu,
    VirtualGpuParams,
    fv_squared,
    run_activity,
)

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "power-h200-2026-12-04.json"
PROFILE = VirtualGpuParams()


def _points() -> list[LoadPoint]:
    return [LoadPoint(**p) for p in json.loads(FIXTURE.read_text())["points"]]


def _fit(points: list[LoadPoint]) -> PowerCalibration:
    return fit_power_calibration(
        points,
        gpu_name="NVIDIA H200",
        prior_memory_w=PROFILE.memory_full_bandwidth_w,
        prior_compute_w=PROFILE.compute_w_per_ghz_v2 * fv_squared(PROFILE, 1980.0),
        source="fixture",
    )


def test_the_fit_reproduces_the_h200s_three_loads_within_ten_percent():
    cal = _fit(_points())
    assert cal.idle_w == pytest.approx(124.17)
    for p in _points():
        predicted = cal.predict_w(p.busy_fraction, p.memory_utilization, p.compute_utilization)
        assert predicted == pytest.approx(p.power_w, rel=0.10), p.label


def _window_power_w(gpu: VirtualGpu, clock: SimClock, point: LoadPoint, window_s: float) -> float:
    """Drive the virtual GPU through one window shaped like a measured load: back-to-back
    steps for busy_fraction of it, reading the point's bytes and FLOPs, idle for the rest;
    the mean power from the energy counter."""
    start_j = gpu.read().energy_j
    busy_s = point.busy_fraction * window_s
    if busy_s > 0:
        steps = 200
        step_s = busy_s / steps
        activity = EngineActivity(
            step_duration_s=step_s,
            decode_tokens=1,
            weight_bytes_read=round(
                point.memory_utilization * window_s * PROFILE.peak_memory_bandwidth_bytes_per_s
                / steps
            ),
            flops=point.compute_utilization * window_s * PROFILE.peak_flops / steps,
        )
        run_activity(gpu, clock, activity, busy_s)
    run_activity(gpu, clock, None, window_s - busy_s)
    clock.advance(PROFILE.telemetry_period_s)  # the counter updates at its next tick
    return (gpu.read().energy_j - start_j) / (window_s + PROFILE.telemetry_period_s)


@pytest.mark.parametrize("calibrated", [True, False])
def test_the_virtual_gpu_with_the_calibration_draws_what_the_h200_drew(calibrated):
    cal = _fit(_points()) if calibrated else None
    clock = SimClock(0.0)
    gpu = VirtualGpu(PROFILE, clock=clock, calibration=cal)
    gpu.set_context_open(True)  # the H200's idle was measured with the engine's context open
    run_activity(gpu, clock, None, 5.0)
    ratios = {p.label: _window_power_w(gpu, clock, p, 8.0) / p.power_w for p in _points()}
    if calibrated:
        assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios
    else:  # what the calibration is for: the profile alone over-prices the batch by far
        assert ratios["batch64"] > 1.5, ratios


def test_four_loaded_points_fit_every_slope_and_predict_a_held_out_load():
    truth = PowerCalibration(
        "g", 1980.0, idle_w=100.0, active_w=20.0, memory_w=90.0, compute_w=300.0
    )
    loads = [(0.5, 0.1, 0.01), (0.9, 0.3, 0.05), (0.99, 0.6, 0.2), (0.8, 0.2, 0.3), (1.0, 0.8, 0.1)]
    points = [LoadPoint("idle", 100.0, 0.0, 0.0, 0.0, 1980.0)] + [
        LoadPoint(f"l{i}", truth.predict_w(b, m, c), b, m, c, 1980.0)
        for i, (b, m, c) in enumerate(loads)
    ]
    cal = _fit(points[:-1])  # the last load held out
    assert (cal.active_w, cal.memory_w, cal.compute_w) == pytest.approx((20.0, 90.0, 300.0))
    held = points[-1]
    assert cal.predict_w(1.0, 0.8, 0.1) == pytest.approx(held.power_w)


def test_a_calibration_round_trips_and_a_bad_file_is_named(tmp_path):
    cal = _fit(_points())
    path = tmp_path / "power-calibration.json"
    path.write_text(cal.to_json())
    assert PowerCalibration.load(path) == cal
    path.write_text(cal.to_json().replace('"idle_w": 124.17', '"idle_w": -1'))
    with pytest.raises(PowerCalibrationError, match=rf"{path}: idle_w must be > 0"):
        PowerCalibration.load(path)
    with pytest.raises(PowerCalibrationError, match="nowhere.json"):
        PowerCalibration.load(tmp_path / "nowhere.json")


def test_a_bad_calibration_file_stops_the_config_naming_the_key(tmp_path):
    from wattserve.daemon.config import ConfigError, load_config

    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    toml = tmp_path / "c.toml"
    toml.write_text(f'[device]\nvirtual_power_calibration = "{bad}"\n')
    with pytest.raises(ConfigError, match="device.virtual_power_calibration.*not JSON"):
        load_config(toml)
