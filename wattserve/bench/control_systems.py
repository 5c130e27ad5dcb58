"""The systems `bench control` compares, by name: the baselines (max clock, a static
power cap, a PI loop on power, fixed settings), the daemon's controller and its variants
(from wattserve.sim.systems), and `best_static`, the hindsight oracle over static settings
(wattserve.sim.oracle). `run_model` runs one of them by name on the engine model.

Baselines and references only: the controller itself is the daemon's, never a copy.
"""

from __future__ import annotations

import bisect
from pathlib import Path

from wattserve.controller.policy import Policy, QuantOption, allowed_quant_levels
from wattserve.daemon.device.virtual import VirtualGpuParams
from wattserve.sim.calibration import Calibration
from wattserve.sim.oracle import (
    OracleResult,
    StaticSetting,
    StaticSystem,
    default_space,
    find_oracle,
)
from wattserve.sim.run import RunResult, run_scenario
from wattserve.sim.scenarios import RequestMix, Scenario
from wattserve.sim.systems import PERIOD_S, Controlled, System


class MaxClock(System):
    """The uncontrolled engine: default power limit, clocks unlocked (top), fixed caps."""

    name = "max_clock"


class StaticCap(System):
    """A board power limit at the budget (clamped to the device's range); nothing else."""

    name = "static_cap"

    def __init__(self, engine, device, clock, budget_w: float) -> None:
        super().__init__(engine, device, clock)
        self.set_budget_w(budget_w)

    def set_budget_w(self, budget_w: float) -> None:
        self.device.set_power_limit_w(budget_w)
        self.knob_changes += 1


class PidOnPower(System):
    """A PI loop on measured power only: the SM clock tracks power to 95 % of the budget
    (conditional-integration anti-windup). It knows nothing of latency or batches."""

    name = "pid_power"

    def __init__(self, engine, device, clock, budget_w: float, ladder: tuple[int, ...]) -> None:
        super().__init__(engine, device, clock)
        self.budget_w = budget_w
        self.ladder = ladder
        self.kp, self.ki = 0.8, 1.5  # per unit of budget error, in units of the clock range
        self.integral = 1.0  # start at the top clock
        self.clock_mhz = ladder[-1]
        self._last_s: float | None = None

    def set_budget_w(self, budget_w: float) -> None:
        self.budget_w = budget_w

    def tick(self) -> dict:
        t = self.device.read()
        now = self.clock()
        dt = PERIOD_S if self._last_s is None else max(now - self._last_s, 1e-3)
        self._last_s = now
        power = t.power_w or 0.0
        err = (0.95 * self.budget_w - power) / self.budget_w
        u = self.integral + self.kp * err
        if 0.0 < u < 1.0 or (u >= 1.0 and err < 0) or (u <= 0.0 and err > 0):
            self.integral = min(1.0, max(0.0, self.integral + self.ki * err * dt))
            u = self.integral + self.kp * err
        u = min(1.0, max(0.0, u))
        lo, hi = self.ladder[0], self.ladder[-1]
        target = lo + u * (hi - lo)
        i = bisect.bisect_right(self.ladder, target) - 1
        mhz = self.ladder[max(i, 0)]
        if mhz != self.clock_mhz:
            self.device.lock_sm_clocks_mhz(mhz, mhz)
            self.clock_mhz = mhz
            self.knob_changes += 1
        return {"sm_clock_mhz": mhz}


def best_static(
    scenario: Scenario,
    cal: Calibration,
    capacity_req_s: float,
    mix: RequestMix,
    policy: Policy,
    levels: tuple[str, ...],
    start_level: str,
    device_calibration: Path | None = None,
) -> tuple[RunResult, OracleResult]:
    """The hindsight oracle (wattserve.sim.oracle), not a controller: the best static setting
    of clock, batch caps, level and decode pacing, searched jointly on the same arrivals
    over the levels the policy's quality limit allows and the controller's knob ranges.
    It knows the whole trace in advance."""
    allowed = allowed_quant_levels(
        tuple(QuantOption(lv, cal.levels[lv].ppl_increase_pct) for lv in levels),
        cal.full_precision,
        policy.max_ppl_increase_pct,
    )
    space = default_space(
        allowed,
        VirtualGpuParams().sm_clock_ladder_mhz(),
        block_size_tokens=cal.block_size_tokens,
    )
    found, res = find_oracle(
        scenario, cal, capacity_req_s, mix, policy, start_level, space,
        device_calibration=device_calibration,
    )
    res.system = "best_static"
    return res, found


def run_model(
    scenario: Scenario,
    system_name: str,
    cal: Calibration,
    capacity_req_s: float,
    mix: RequestMix,
    policy: Policy,
    levels: tuple[str, ...],
    start_level: str,
    drain_s: float = 60.0,
    device_calibration: Path | None = None,
) -> RunResult:
    """One scenario with one system on the engine model, in simulated time."""

    def make(engine, device, clock, run_policy: Policy) -> System:
        return make_system(system_name, engine, device, clock, run_policy, cal, levels, inline=True)

    return run_scenario(
        scenario, make, cal, capacity_req_s, mix, policy, start_level, drain_s, device_calibration
    )


def make_system(
    name: str,
    engine,
    device,
    clock,
    policy: Policy,
    cal,
    levels,
    inline: bool,
    speeds: dict[str, dict[str, float]] | None = None,
):
    """speeds: the controller's speed table, per level its decode_tok_s_bs16 and
    prefill_tok_s (None: the calibration's)."""
    budget = policy.power_budget_w
    if name == "max_clock":
        return MaxClock(engine, device, clock)
    if name == "static_cap":
        return StaticCap(engine, device, clock, budget)
    if name == "pid_power":
        return PidOnPower(engine, device, clock, budget, device.read().sm_clock_ladder_mhz)
    if name == "controller":
        return Controlled(engine, device, clock, policy, cal, levels, inline=inline, speeds=speeds)
    if name == "controller_fixed_quant":
        return Controlled(
            engine,
            device,
            clock,
            policy,
            cal,
            (engine.quant_level,),
            inline=inline,
            name=name,
            speeds=speeds,
        )
    if name == "controller_unpaced":
        return Controlled(
            engine,
            device,
            clock,
            policy,
            cal,
            levels,
            inline=inline,
            name=name,
            decode_interval_max_ms=0.0,
            speeds=speeds,
        )
    if name.startswith("fixed:"):
        # fixed:<level>:<MHz>[:<decode-only MHz>:<decode interval ms>]
        _, level, mhz, *study = name.split(":")
        if len(study) not in (0, 2):
            raise ValueError(
                f"system {name!r}: fixed:<level>:<MHz>[:<decode-only MHz>:<interval ms>]"
            )
        decode_mhz, interval_ms = (int(study[0]), float(study[1])) if study else (None, 0.0)
        setting = StaticSetting(
            level,
            int(mhz),
            decode_interval_ms=interval_ms,
            decode_clock_mhz=None if decode_mhz in (None, int(mhz)) else decode_mhz,
        )
        return StaticSystem(engine, device, clock, budget, setting)
    raise ValueError(f"unknown system {name!r}")
