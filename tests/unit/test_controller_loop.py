"""The control loop with a recording fake engine and device: what it feeds the controller,
what it applies, and that observe mode applies nothing. No torch, simulated time."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from wattserve.controller.controller import Controller, ControllerState, Reason
from wattserve.controller.policy import ControlMode, Knobs, Policy
from wattserve.controller.schema import to_policy
from wattserve.controller.signals import DeviceConstraints, EngineConstraints
from wattserve.daemon.config import ControllerConfig, load_config
from wattserve.daemon.control_loop import (
    ControlLoop,
    controller_telemetry,
    device_constraints,
    quant_options,
)
from wattserve.daemon.device.protocol import (
    REASON_HW_POWER_BRAKE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    Capabilities,
    Knob,
    KnobCapability,
    SetOutcome,
    Telemetry,
)

LADDER = tuple(range(345, 1981, 15))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeEngine:
    limits: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=512)
    )
    quant_level: str = "fp32"
    num_running: int = 4
    num_waiting: int = 0
    counters: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(
            prompt_tokens=0, generation_tokens=0, requests_finished={"stop": 0, "length": 0}
        )
    )
    calls: list = field(default_factory=list)

    def set_limits(self, max_num_seqs=None, max_num_batched_tokens=None, decode_interval_ms=None):
        self.calls.append(("set_limits", max_num_seqs, max_num_batched_tokens, decode_interval_ms))
        self.limits = SimpleNamespace(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            decode_interval_ms=decode_interval_ms or 0.0,
        )
        return self.limits

    def set_quant_level(self, level: str) -> str:
        self.calls.append(("set_quant_level", level))
        self.quant_level = level
        return level


class FakeDevice:
    def __init__(self, clock: FakeClock, power_w: float = 250.0) -> None:
        self.clock = clock
        self.power_w = power_w
        self.calls: list = []
        self.fail_reads = False
        self.mask = 0

    def read(self) -> Telemetry:
        if self.fail_reads:
            raise RuntimeError("driver went away")
        return Telemetry(
            timestamp_s=self.clock(),
            power_w=self.power_w,
            power_avg_w=self.power_w,
            power_avg_window_s=1.0,
            gpu_temp_c=50.0,
            thermal_margin_c=37.0,
            sm_clock_mhz=1980,
            clock_event_reasons_mask=self.mask,
            power_limit_min_w=200.0,
            power_limit_max_w=700.0,
            sm_clock_ladder_mhz=LADDER,
        )

    def capabilities(self) -> Capabilities:
        return Capabilities(
            backend="virtual",
            name="fake",
            uuid="GPU-fake",
            pci_bus_id="fake",
            mode="control",
            update_period_s=0.1,
            readable=(),
            knobs=(KnobCapability(Knob.POWER_LIMIT, True), KnobCapability(Knob.SM_CLOCKS, True)),
        )

    def set_power_limit_w(self, watts: float):
        self.calls.append(("set_power_limit_w", watts))
        return SimpleNamespace(outcome=SetOutcome.APPLIED, detail="")

    def lock_sm_clocks_mhz(self, lo: int, hi: int):
        self.calls.append(("lock_sm_clocks_mhz", lo, hi))
        return SimpleNamespace(outcome=SetOutcome.APPLIED, detail="")


def make_loop(mode: ControlMode, power_w: float = 250.0, budget_w: float = 400.0):
    clock = FakeClock()
    engine = FakeEngine()
    device = FakeDevice(clock, power_w)
    ctl = Controller(
        Policy(budget_w, 2000.0, 200.0, mode=mode),
        device_constraints(device, device.read()),
        EngineConstraints(64, 512),
        Knobs(64, 512, "fp32"),
    )
    loop = ControlLoop(
        ctl, engine, device, kv_bytes_per_token=1000, clock=clock, run_blocking=lambda f: f()
    )
    return loop, engine, device, clock


def step(clock: FakeClock, prefill: int = 0, decode: int = 8, dur_s: float = 0.05):
    """A StepStats-like record that ended now."""
    return SimpleNamespace(
        started_at_s=clock() - dur_s,
        duration_s=dur_s / 2,  # what the engine measured before the device's stretch
        prefill_tokens=prefill,
        decode_tokens=decode,
        kv_bytes_read=decode * 300 * 1000,
        quant_level="fp32",
    )


def drive(loop, engine, clock, seconds: float) -> list:
    out = []
    for _ in range(int(seconds / 0.25)):
        for _ in range(5):
            clock.now += 0.05
            loop.on_step(step(clock))
            engine.counters.generation_tokens += 8
        engine.counters.prompt_tokens += 50
        loop.record_ttft_s(0.3)
        loop.record_tpot_s(0.05)
        out.append(loop.tick())
    return out


def test_on_step_records_wall_time_and_context_tokens():
    loop, engine, device, clock = make_loop(ControlMode.AUTO)
    loop.on_step(step(clock, prefill=10, decode=4, dur_s=0.2))
    rec = loop._steps[0]
    assert rec.duration_s == pytest.approx(0.2)  # includes the stretch a device hook slept before
    assert rec.context_tokens == 4 * 300
    assert rec.prefill_tokens == 10 and rec.quant_level == "fp32"


def test_observe_mode_applies_nothing():
    loop, engine, device, clock = make_loop(ControlMode.OBSERVE, power_w=900.0)
    decisions = drive(loop, engine, clock, 20)
    assert all(not d.apply for d in decisions)
    # Power over budget: the advice is to cut, yet nothing reached engine or device.
    assert any(d.reason_code is Reason.OVER_BUDGET for d in decisions)
    assert engine.calls == [] and device.calls == []


def test_auto_mode_applies_clock_power_limit_and_caps_once_each():
    loop, engine, device, clock = make_loop(ControlMode.AUTO, power_w=900.0)
    decisions = drive(loop, engine, clock, 1)
    d = decisions[0]
    assert d.apply and d.reason_code is Reason.OVER_BUDGET
    assert ("lock_sm_clocks_mhz", d.knobs.sm_clock_mhz, d.knobs.sm_clock_mhz) in device.calls
    assert ("set_power_limit_w", 392.0) in device.calls  # 0.98 x the budget
    assert engine.calls[0] == ("set_limits", 64, 512, 0.0)
    n = len(device.calls)
    device.power_w = 250.0
    drive(loop, engine, clock, 1)
    # Unchanged knobs are not sent again.
    assert all(c[0] != "set_power_limit_w" for c in device.calls[n:])


def test_a_budget_change_through_set_policy_acts_at_the_next_tick():
    loop, engine, device, clock = make_loop(ControlMode.AUTO, power_w=300.0)
    drive(loop, engine, clock, 2)
    loop.set_policy(loop.controller.policy.with_changes(power_budget_w=250.0))
    d = drive(loop, engine, clock, 0.25)[0]
    assert d.effective_budget_w == 250.0 and d.reason_code is Reason.OVER_BUDGET
    assert ("set_power_limit_w", 245.0) in device.calls


def test_a_policy_change_wakes_the_loop_thread_to_decide_at_once():
    loop, engine, device, clock = make_loop(ControlMode.AUTO, power_w=300.0)
    loop.period_s = 3600.0  # the clock stands still: the next periodic tick is an hour away
    budgets: list[float] = []
    ticked = threading.Semaphore(0)

    def sink(d) -> None:
        budgets.append(d.effective_budget_w)
        ticked.release()

    loop._sinks = (sink,)
    loop.start()
    thread = loop._thread
    try:
        assert ticked.acquire(timeout=10.0)
        loop.set_policy(loop.controller.policy.with_changes(power_budget_w=250.0))
        assert ticked.acquire(timeout=10.0), "the budget cut waited for the next period"
    finally:
        loop.stop()
    assert not thread.is_alive()  # stop ends the hour's wait too
    assert budgets == [400.0, 250.0]


def test_failing_telemetry_reads_are_stale_not_fatal():
    loop, engine, device, clock = make_loop(ControlMode.AUTO)
    drive(loop, engine, clock, 2)
    device.fail_reads = True
    d = drive(loop, engine, clock, 0.5)[-1]
    assert d.state is ControllerState.HOLD


def test_quant_switch_is_requested_once():
    loop, engine, device, clock = make_loop(ControlMode.AUTO)
    loop._apply(Knobs(64, 512, "int8", 1980, 300.0))
    loop._apply(Knobs(64, 512, "int8", 1980, 300.0))
    assert engine.calls.count(("set_quant_level", "int8")) == 1


def test_telemetry_conversion_decodes_reasons():
    t = FakeDevice(FakeClock()).read()
    hot = Telemetry(
        **{**t.__dict__, "clock_event_reasons_mask": REASON_SW_POWER_CAP | REASON_HW_SLOWDOWN}
    )
    c = controller_telemetry(hot)
    assert c.sw_power_cap and c.hw_slowdown and not c.thermal_throttle
    assert c.power_w == 250.0 and c.sm_clock_mhz == 1980
    # The brake's cause bits alone are a hardware slowdown too (NVML may set them alone).
    for bits in (REASON_HW_POWER_BRAKE, REASON_HW_THERMAL):
        braked = Telemetry(**{**t.__dict__, "clock_event_reasons_mask": bits})
        assert controller_telemetry(braked).hw_slowdown


def test_device_constraints_follow_the_gate():
    dev = FakeDevice(FakeClock())
    dc = device_constraints(dev, dev.read())
    assert isinstance(dc, DeviceConstraints) and dc.can_lock_clocks and dc.can_set_power_limit
    ro = FakeDevice(FakeClock())
    ro.capabilities = lambda: SimpleNamespace(
        knobs=(KnobCapability(Knob.POWER_LIMIT, False), KnobCapability(Knob.SM_CLOCKS, False))
    )
    dc = device_constraints(ro, ro.read())
    assert not dc.can_lock_clocks and not dc.can_set_power_limit


def test_policy_and_quant_options_from_config_and_quality_table(tmp_path, monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("WATTSERVE_"):
            monkeypatch.delenv(name)
    path = tmp_path / "c.toml"
    path.write_text(
        '[controller]\nmode = "auto"\npower_budget_w = 350\nmax_ppl_increase_pct = 2.0\n'
        'objective = "min_latency"\nperiod_s = 0.5\n'
    )
    cfg = load_config(path)
    p = to_policy(cfg.controller)
    assert p.power_budget_w == 350.0 and p.mode is ControlMode.AUTO
    assert p.max_ppl_increase_pct == 2.0 and p.objective.value == "min_latency"
    assert cfg.controller.period_s == 0.5
    assert to_policy(ControllerConfig()).mode is ControlMode.OBSERVE
    table = {"levels": {"fp32": {"ppl_increase_pct": 0.0}, "int8": {"ppl_increase_pct": 0.7}}}
    opts = quant_options(("fp32", "int8", "int4"), table, {"int8": 10})
    assert [(o.level, o.ppl_increase_pct, o.weight_bytes) for o in opts] == [
        ("fp32", 0.0, 0),
        ("int8", 0.7, 10),
        ("int4", None, 0),
    ]
    # Its speeds, where the table has them as positive numbers.
    table["levels"]["fp32"] |= {"decode_tok_s_bs16": 147.7, "prefill_tok_s": 430}
    table["levels"]["int8"] |= {"decode_tok_s_bs16": float("nan"), "prefill_tok_s": -1}
    opts = quant_options(("fp32", "int8"), table)
    assert [(o.decode_tok_s, o.prefill_tok_s) for o in opts] == [(147.7, 430.0), (None, None)]


def test_thread_ticks_until_stopped():
    loop, engine, device, _ = make_loop(ControlMode.AUTO)
    loop._clock = time.monotonic
    loop.period_s = 0.02
    seen = threading.Event()
    loop._sinks = (lambda d: seen.set(),)
    loop.start()
    try:
        assert seen.wait(2.0)
    finally:
        loop.stop()
    assert loop._thread is None
    assert sum(loop.controller.counters.decisions.values()) >= 1
