"""Knobs are verified, not assumed: the control loop over the virtual GPU (a ManagedDevice,
simulated time) reads back what it set, and re-applies and counts a knob changed behind its
back or lost to a device re-initialisation. No torch; a recording fake engine."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from tests.unit.test_controller_loop import FakeEngine
from wattserve.controller.controller import Controller
from wattserve.controller.policy import ControlMode, Knobs, Policy
from wattserve.controller.signals import EngineConstraints
from wattserve.daemon.api.metrics import Metrics
from wattserve.daemon.config import DeviceConfig
from wattserve.daemon.control_loop import ControlLoop, device_constraints
from wattserve.daemon.device.factory import open_device
from wattserve.daemon.device.protocol import Telemetry
from wattserve.daemon.device.virtual import SimClock

CLOCK_MHZ = 1200
BUDGET_W = 400.0
LIMIT_W = 392.0  # the controller sets the board limit to 0.98 x the budget


def make(tmp_path):
    clock = SimClock()
    device = open_device(
        DeviceConfig(backend="virtual", mode="control", state_dir=tmp_path), clock=clock
    )
    ctl = Controller(
        Policy(BUDGET_W, 2000.0, 200.0, mode=ControlMode.MANUAL),
        device_constraints(device, device.read()),
        EngineConstraints(64, 512),
        Knobs(64, 512, "fp32"),
    )
    ctl.set_manual_knobs(Knobs(64, 512, "fp32", sm_clock_mhz=CLOCK_MHZ))
    lost = {"now": False}

    def read() -> Telemetry:
        t = device.read()
        return dataclasses.replace(t, device_lost=True, stale=True) if lost["now"] else t

    events: list[tuple[str, str, dict]] = []
    loop = ControlLoop(
        ctl,
        FakeEngine(),
        device,
        kv_bytes_per_token=1000,
        clock=clock,
        telemetry_source=read,
        run_blocking=lambda f: f(),
        event_sink=lambda kind, message, data: events.append((kind, message, data)),
    )
    return loop, device, clock, lost, events


def tick(loop, clock) -> None:
    clock.advance(0.25)
    loop.tick()


def in_force(device) -> tuple[float | None, tuple[int, int] | None]:
    t = device.read()
    return t.power_limit_w, t.sm_clock_lock_mhz


def test_a_knob_changed_behind_the_loop_is_reapplied_and_counted(tmp_path) -> None:
    loop, device, clock, _, events = make(tmp_path)
    tick(loop, clock)
    assert in_force(device) == (LIMIT_W, (CLOCK_MHZ, CLOCK_MHZ))
    tick(loop, clock)
    assert loop.knob_drift == {} and events == []

    # Someone runs nvidia-smi: default power limit, clocks unlocked.
    device.backend.write_power_limit_w(700.0)
    device.backend.write_sm_clock_unlock()
    tick(loop, clock)
    assert in_force(device) == (LIMIT_W, (CLOCK_MHZ, CLOCK_MHZ))  # re-applied at once
    assert loop.knob_drift == {"power_limit_w": 1, "sm_clock_lock_mhz": 1}
    assert sorted((kind, data["knob"]) for kind, _, data in events) == [
        ("knob_drift", "power_limit_w"),
        ("knob_drift", "sm_clock_lock_mhz"),
    ]
    power = next((message, data) for _, message, data in events if data["knob"] == "power_limit_w")
    assert power[1]["read_back"] == 700.0 and "re-applying" in power[0]
    for _ in range(3):
        tick(loop, clock)
    assert loop.knob_drift == {"power_limit_w": 1, "sm_clock_lock_mhz": 1}  # counted once
    assert loop.status()["knob_drift"] == loop.knob_drift


def test_after_a_device_reinitialisation_the_knobs_are_reapplied(tmp_path) -> None:
    loop, device, clock, lost, events = make(tmp_path)
    tick(loop, clock)
    tick(loop, clock)
    lost["now"] = True  # the GPU fell off the bus; its driver reload resets its settings
    tick(loop, clock)
    device.backend.write_power_limit_w(700.0)
    device.backend.write_sm_clock_unlock()
    tick(loop, clock)
    assert loop.knob_drift == {}  # nothing is judged on a lost device's readings
    lost["now"] = False
    tick(loop, clock)
    assert in_force(device) == (LIMIT_W, (CLOCK_MHZ, CLOCK_MHZ))
    assert loop.knob_drift == {"power_limit_w": 1, "sm_clock_lock_mhz": 1}
    assert all("re-initialised" in data["why"] for _, _, data in events)

    metrics = Metrics()
    policy = SimpleNamespace(power_budget_w=BUDGET_W, ttft_slo_ms=2000.0, tpot_slo_ms=200.0)
    state = SimpleNamespace(
        policy=policy, device_sampler=None, feed=None, engine=None, control_loop=loop
    )
    metrics.bind_device(lambda: state)
    text = metrics.render().decode()
    assert 'wattserve_knob_drift_total{knob="power_limit_w"} 1.0' in text
    assert 'wattserve_knob_drift_total{knob="sm_clock_lock_mhz"} 1.0' in text


def test_a_clock_locked_through_put_knobs_is_not_drift(tmp_path) -> None:
    loop, device, clock, _, events = make(tmp_path)
    tick(loop, clock)
    result = loop.lock_sm_clock_mhz(900)
    assert result.in_force and in_force(device)[1] == (900, 900)
    loop.controller.set_manual_knobs(Knobs(64, 512, "fp32", sm_clock_mhz=900))
    tick(loop, clock)
    assert loop.knob_drift == {} and events == []


def test_in_observe_mode_a_changed_knob_is_not_drift_until_the_loop_steers_again(
    tmp_path,
) -> None:
    loop, device, clock, _, events = make(tmp_path)
    tick(loop, clock)
    manual = loop.controller.policy
    loop.set_policy(dataclasses.replace(manual, mode=ControlMode.OBSERVE))
    device.backend.write_power_limit_w(650.0)  # the operator's to change while observing
    tick(loop, clock)
    tick(loop, clock)
    assert loop.knob_drift == {} and in_force(device)[0] == 650.0
    loop.set_policy(manual)
    tick(loop, clock)
    assert loop.knob_drift == {"power_limit_w": 1} and in_force(device)[0] == LIMIT_W


def test_on_nvidia_a_lock_reset_by_nvidia_smi_is_drift_from_the_gpus_clocks(
    tmp_path, monkeypatch
) -> None:
    """NVML cannot read a clock lock back: the loop sees `nvidia-smi -rgc` because the busy
    GPU's clock leaves the lock, counts it once and writes the lock to the driver again;
    an idle GPU's low clock is no drift."""
    import sys

    from tests.unit.test_device_nvml import GPU0, FakeClock, FakeGpu, FakeNvml

    gpu = FakeGpu(**GPU0)
    clock = FakeClock()
    nvml = FakeNvml([gpu], clock)
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    device = open_device(
        DeviceConfig(backend="nvml", mode="control", gpu="0", state_dir=tmp_path), clock=clock
    )
    ctl = Controller(
        Policy(BUDGET_W, 2000.0, 200.0, mode=ControlMode.MANUAL),
        device_constraints(device, device.read()),
        EngineConstraints(64, 512),
        Knobs(64, 512, "fp32"),
    )
    ctl.set_manual_knobs(Knobs(64, 512, "fp32", sm_clock_mhz=CLOCK_MHZ))
    events: list[tuple[str, str, dict]] = []
    loop = ControlLoop(
        ctl,
        FakeEngine(),
        device,
        kv_bytes_per_token=1000,
        clock=clock,
        telemetry_source=device.read,
        run_blocking=lambda f: f(),
        event_sink=lambda kind, message, data: events.append((kind, message, data)),
    )

    def ticks(n: int) -> None:
        for _ in range(n):
            clock.now_s += 0.25
            loop.tick()

    def lock_writes() -> int:
        return nvml.names().count("nvmlDeviceSetGpuLockedClocks")

    ticks(8)
    assert gpu.locked_mhz == (CLOCK_MHZ, CLOCK_MHZ) and lock_writes() == 1
    gpu.util_gpu_pct, gpu.clock_event_mask, gpu.sm_clock_mhz = 0, 0x1, 345  # idle, low
    ticks(8)
    assert loop.knob_drift == {} and lock_writes() == 1
    gpu.util_gpu_pct, gpu.clock_event_mask, gpu.sm_clock_mhz = 97, 0, None  # busy again

    gpu.locked_mhz = None  # nvidia-smi -rgc
    ticks(8)
    assert loop.knob_drift == {"sm_clock_lock_mhz": 1}
    assert lock_writes() == 2 and gpu.locked_mhz == (CLOCK_MHZ, CLOCK_MHZ)  # re-applied
    (_, message, data), = events
    assert data["knob"] == "sm_clock_lock_mhz" and "SM clock 1980 MHz" in message
    ticks(8)
    assert loop.knob_drift == {"sm_clock_lock_mhz": 1} and lock_writes() == 2
    device.close()
