"""Running the engine model: one system over one scenario in simulated time, on a fresh
virtual GPU with a SimClock, recording power, knobs and each request's TTFT and TPOT; and
the engine model's saturated capacity.

Which system runs is the caller's: it passes a factory. It must not import bench.
"""

from __future__ import annotations

import math
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wattserve.controller.policy import ControlMode, Policy
from wattserve.sim.calibration import Calibration
from wattserve.sim.engine_model import SimRequest, SimulatedEngine
from wattserve.sim.scenarios import RequestMix, Scenario, arrivals, prompt_tokens
from wattserve.sim.systems import PERIOD_S, Controlled, System

if TYPE_CHECKING:
    from wattserve.daemon.config import DeviceConfig

# (engine, device, clock, policy) -> the system to run; policy is the run's, budget set.
SystemFactory = Callable[[SimulatedEngine, object, object, Policy], System]


@dataclass
class Sample:
    t_s: float
    power_w: float  # mean over the span since the previous sample (energy counter)
    budget_w: float
    temp_c: float
    sm_clock_mhz: int
    running: int
    waiting: int
    knobs: dict = field(default_factory=dict)


@dataclass
class RunResult:
    scenario: str
    system: str
    requests: list[tuple[float, float | None, float | None, int]]  # arrival, ttft, tpot, out
    samples: list[Sample]
    energy_j: float
    output_tokens: int
    duration_s: float
    knob_changes: int
    reasons: dict[str, int] = field(default_factory=dict)
    # The system's own models frozen when the arrivals ended (System.freeze_view).
    view: Callable[[Any], dict] | None = None


def energy_sample(device):
    """A snapshot and (the 100 ms boundary its energy counter stands at, the counter J)."""
    t = device.read()
    period = 0.1
    boundary = math.floor(t.timestamp_s / period + 1e-9) * period
    return t, (boundary, t.energy_j or 0.0)


def power_sample(device, last, t0_s: float, budget_w: float, engine, knobs: dict):
    """The mean power since `last` (an energy_sample mark) as a Sample stamped t0_s
    earlier, and the new mark; (None, last) while the counter is at the same boundary."""
    tel, cur = energy_sample(device)
    if cur[0] <= last[0]:
        return None, last
    power = (cur[1] - last[1]) / (cur[0] - last[0])
    sample = Sample(
        cur[0] - t0_s,
        power,
        budget_w,
        tel.gpu_temp_c or 0.0,
        tel.sm_clock_mhz or 0,
        engine.num_running,
        engine.num_waiting,
        dict(knobs),
    )
    return sample, cur


def scenario_device_config(
    scenario: Scenario, state_dir: Path, calibration: Path | None
) -> DeviceConfig:
    """The virtual GPU a control bench runs a scenario on: seeded and at the inlet
    temperature of the scenario's start, in control mode, with the measured power
    calibration if one is given. Both engines' benches build theirs here."""
    from wattserve.daemon.config import DeviceConfig

    return DeviceConfig(
        backend="virtual",
        mode="control",
        state_dir=state_dir,
        virtual_seed=scenario.seed,
        virtual_ambient_c=scenario.ambient_c(0.0),
        virtual_power_calibration=calibration,
    )


def run_scenario(
    scenario: Scenario,
    make_system: SystemFactory,
    cal: Calibration,
    capacity_req_s: float,
    mix: RequestMix,
    policy: Policy,
    start_level: str,
    drain_s: float = 60.0,
    device_calibration: Path | None = None,
) -> RunResult:
    """One scenario with one system (`make_system` builds it over the engine model, the
    device, the clock and the policy at the scenario's first budget, in auto mode) on the
    engine model, in simulated time. device_calibration: a measured power calibration for
    the virtual GPU (`[device] virtual_power_calibration`); None: its profile's model."""
    from wattserve.daemon.device import SimClock, open_device

    clock = SimClock(0.0)
    with tempfile.TemporaryDirectory() as state_dir:
        device = open_device(
            scenario_device_config(scenario, Path(state_dir), device_calibration), clock=clock
        )
        try:
            return _run(
                scenario,
                make_system,
                cal,
                capacity_req_s,
                mix,
                policy,
                start_level,
                drain_s,
                clock,
                device,
            )
        finally:
            device.close(restore=False)


def _run(
    scenario,
    make_system,
    cal,
    capacity_req_s,
    mix,
    policy,
    start_level,
    drain_s,
    clock,
    device,
) -> RunResult:
    engine = SimulatedEngine(cal, start_level, clock, device, seed=scenario.seed)
    policy = policy.with_changes(power_budget_w=scenario.budget_w(0.0), mode=ControlMode.AUTO)
    system = make_system(engine, device, clock, policy)
    engine.add_step_hook(system.on_step)
    gpu = device.backend
    todo = arrivals(scenario, capacity_req_s, mix)
    reqs = [SimRequest(f"r{i}", t, p, o) for i, (t, p, o) in enumerate(todo)]
    samples: list[Sample] = []
    next_req = 0
    next_tick = 0.0
    budget = scenario.budget_w(0.0)
    ambient = scenario.ambient_c(0.0)
    t0_tel, last = energy_sample(device)
    e_start = last[1]
    reported = first_seen = 0
    end_s = scenario.duration_s + drain_s
    knobs: dict = {}
    view = None
    frozen = False
    while True:
        now = clock()
        if not frozen and now >= scenario.duration_s:
            # The load's last moment: the drain after it would read the load as gone.
            view, frozen = system.freeze_view(), True
        if now >= end_s or (now >= scenario.duration_s and not engine.has_work()):
            break
        b = scenario.budget_w(now)
        woken = b != budget
        if woken:
            budget = b
            system.set_budget_w(b)
        a = scenario.ambient_c(now)
        if abs(a - ambient) >= 0.5:
            ambient = a
            gpu.set_ambient_c(a)
        while next_req < len(reqs) and reqs[next_req].arrival_s <= now:
            engine.add_request(reqs[next_req])
            next_req += 1
        # As the API does: TTFT at the first token, TPOT when the request finishes.
        while first_seen < len(engine.first_tokens):
            system.record_ttft_s(engine.first_tokens[first_seen].ttft_s)
            first_seen += 1
        while reported < len(engine.finished):
            r = engine.finished[reported]
            reported += 1
            if r.tpot_s is not None and r.generated > 1:
                system.record_tpot_s(r.tpot_s)
        periodic = now >= next_tick
        # As a policy change wakes the daemon's loop (ControlLoop.set_policy): a system
        # decides on a new budget now, not up to a period later; the period's ticks stand.
        if periodic or woken:
            knobs = system.tick()
        if periodic:
            next_tick += PERIOD_S
            if next_tick < now:
                next_tick = now + PERIOD_S
        stats = engine.step()
        if stats is None:
            upcoming = [next_tick, end_s, *(t for t in scenario.budget_steps_s if t > now)]
            if next_req < len(reqs):
                upcoming.append(reqs[next_req].arrival_s)
            if (resume := engine.resume_at_s()) is not None:
                upcoming.append(resume)
            clock.advance(max(min(min(upcoming) - clock(), 0.1), 1e-6))
        sample, last = power_sample(device, last, 0.0, budget, engine, knobs)
        if sample is not None:
            samples.append(sample)
    requests = []
    for r in reqs:
        requests.append((r.arrival_s, r.ttft_s, r.tpot_s if r.finish_s else None, r.generated))
    return RunResult(
        scenario=scenario.name,
        system=system.name,
        requests=requests,
        samples=samples,
        energy_j=last[1] - e_start,
        output_tokens=engine.counters.generation_tokens,
        duration_s=last[0],
        knob_changes=system.knob_changes,
        reasons=decision_reasons(system),
        view=view,
    )


def decision_reasons(system: System) -> dict[str, int]:
    """A controlled system's decision counts by reason (none zero); {} for a baseline."""
    if not isinstance(system, Controlled):
        return {}
    return {k: v for k, v in system.loop.controller.counters.decisions.items() if v}


def measure_capacity(
    cal: Calibration, level: str, mix: RequestMix, seconds: float = 120.0
) -> float:
    """Requests/s the uncontrolled engine (max clock, caps 64/512) sustains when saturated."""
    from wattserve.daemon.config import DeviceConfig
    from wattserve.daemon.device import SimClock, open_device

    clock = SimClock(0.0)
    rng = random.Random(99)
    with tempfile.TemporaryDirectory() as state_dir:
        device = open_device(
            DeviceConfig(backend="virtual", mode="control", state_dir=Path(state_dir)), clock=clock
        )
        engine = SimulatedEngine(cal, level, clock, device, seed=99)
        n = 0

        def add() -> None:
            nonlocal n
            p = prompt_tokens(rng, mix)
            engine.add_request(
                SimRequest(
                    f"c{n}", clock(), p, rng.randint(mix.output_min_tokens, mix.output_max_tokens)
                )
            )
            n += 1

        for _ in range(128):
            add()
        warm = seconds / 4
        done0 = None
        while clock() < seconds:
            engine.step()
            while engine.num_running + engine.num_waiting < 128:
                add()
            if done0 is None and clock() >= warm:
                done0 = len(engine.finished)
        device.close(restore=False)
    return (len(engine.finished) - (done0 or 0)) / (seconds - warm)
