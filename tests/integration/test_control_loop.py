"""The control loop in the running daemon's arrangement, in process: a real engine (tiny
random Llama) on its own thread, the virtual GPU coupled to its steps, the ControlLoop on
its own thread, requests kept in flight; the budget is changed through the same policy
path the HTTP API and MQTT use (ControlLoop.set_policy), and the power must settle below
it. The daemon's server wires these same pieces; this test needs no HTTP.
"""

from __future__ import annotations

import threading
import time

from wattserve.daemon.config import ControllerConfig, DeviceConfig
from wattserve.daemon.control_loop import ControlLoop
from wattserve.daemon.coupling import device_step_hook
from wattserve.daemon.device import open_device
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.request import SamplingParams


def _window_power_w(device, seconds: float) -> float:
    """Mean power over the next `seconds`, from the energy counter."""
    a = device.read()
    time.sleep(seconds)
    b = device.read()
    return (b.energy_j - a.energy_j) / (b.timestamp_s - a.timestamp_s)


def test_power_settles_below_a_budget_set_through_the_policy_path(tiny_llama, tmp_path):
    engine = Engine(
        tiny_llama,
        EngineOptions(kv_cache_bytes=1 << 22, max_num_seqs=16, quantization_levels=("fp32",)),
    )
    device = open_device(DeviceConfig(backend="virtual", mode="control", state_dir=tmp_path))
    engine.add_step_hook(device_step_hook(engine, device))
    # The min-latency objective holds the top clock the budget allows, so the budget cut
    # always finds the clock above what the new budget allows. (With the energy objective
    # this light load's clock was on its way down the ladder when the cut came, and once
    # it reached the bottom first, 2 s in, there was nothing left to step down.)
    cfg = ControllerConfig(mode="auto", power_budget_w=700.0, period_s=0.1, objective="min_latency")
    loop = ControlLoop.build(cfg, engine, device)
    engine.add_step_hook(loop.on_step)  # after the device hook: durations include the stretch
    decisions = []
    loop._sinks = (decisions.append,)
    stop = threading.Event()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def on_output(out) -> None:
        if out.finished and not stop.is_set():
            engine.add_request([5, 6, 7, 8, 9, 10], params, on_output)

    engine.start()
    try:
        for _ in range(12):
            engine.add_request([5, 6, 7, 8, 9, 10] * 4, params, on_output)
        time.sleep(1.0)
        # What this load draws at the top and at the bottom of the clock ladder: the
        # budget goes between the two, below the device's power-limit minimum, so only
        # the controller's clock (not the hardware limit) can hold it.
        top_w = _window_power_w(device, 1.5)
        ladder = device.read().sm_clock_ladder_mhz
        device.lock_sm_clocks_mhz(ladder[0], ladder[0])
        bottom_w = _window_power_w(device, 1.5)
        device.reset()
        budget_w = (top_w + bottom_w) / 2
        assert top_w - bottom_w > 10.0 and budget_w < device.read().power_limit_min_w
        loop.start()
        time.sleep(2.0)
        changed_at = time.monotonic()
        loop.set_policy(loop.controller.policy.with_changes(power_budget_w=budget_w))
        time.sleep(3.0)  # settle
        after = [_window_power_w(device, 1.0) for _ in range(4)]
    finally:
        stop.set()
        loop.stop()
        engine.stop()
        device.close()
    assert all(w <= budget_w for w in after), (top_w, bottom_w, budget_w, after)
    before = [d for d in decisions if d.at_s < changed_at][-1]
    first = next(d for d in decisions if d.at_s >= changed_at)
    assert (before.knobs.sm_clock_mhz or ladder[-1]) > ladder[0]  # room to step down
    # The next tick decides against the new budget, and steps down (guard or prediction).
    assert first.effective_budget_w == budget_w and first.at_s - changed_at < 1.0
    assert first.knobs.sm_clock_mhz < (before.knobs.sm_clock_mhz or 1980)
    assert decisions[-1].knobs.sm_clock_mhz < 1980
    assert engine.counters.generation_tokens > 0


def test_the_loop_the_daemon_builds_sees_how_long_the_oldest_request_waits(tiny_llama, tmp_path):
    # The latency guard's long-wait rule reads EngineStats.oldest_waiting_s; the loop
    # ControlLoop.build makes over the daemon's engine must report it (it used to be None
    # on the real engine whatever waited, so the rule never fired outside the model bench).
    engine = Engine(
        tiny_llama,
        EngineOptions(kv_cache_bytes=1 << 22, max_num_seqs=1, quantization_levels=("fp32",)),
    )
    device = open_device(DeviceConfig(backend="virtual", mode="control", state_dir=tmp_path))
    loop = ControlLoop.build(ControllerConfig(mode="auto", period_s=0.1), engine, device)
    seen = []
    observe = loop.controller.observe

    def spy(telemetry, stats, now_s):
        seen.append(stats)
        return observe(telemetry, stats, now_s)

    loop.controller.observe = spy
    loop.tick()
    assert seen[-1].oldest_waiting_s is None  # nothing waits
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # one slot: the second queues behind the first
        engine.add_request([5, 6, 7, 8, 9, 10], params, lambda out: None)
    assert engine.step() is not None
    time.sleep(0.05)
    loop.tick()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert seen[-1].num_waiting == 1
    assert seen[-1].oldest_waiting_s is not None and seen[-1].oldest_waiting_s >= 0.05
    for _ in range(20):  # the first finishes, the second is admitted
        if not engine.num_waiting:
            break
        engine.step()
    assert engine.num_waiting == 0
    loop.tick()
    assert seen[-1].oldest_waiting_s is None
    device.close(restore=False)
