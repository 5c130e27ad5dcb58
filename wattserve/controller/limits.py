"""The controller's hard limits: the candidate clocks (snap to one, move along them), the
clamp of any knobs into the device's and the engine's constraints, and whether the board
power limit can hold a budget. Stateless value logic: it must not import torch or the
daemon, read a clock, or touch a device or an engine.
"""

from __future__ import annotations

import bisect

from wattserve.controller.params import ControllerParams
from wattserve.controller.policy import Knobs
from wattserve.controller.signals import DeviceConstraints, EngineConstraints


def candidate_clocks(ladder: tuple[int, ...], count: int) -> tuple[int, ...]:
    """About `count` clocks spread evenly over the ladder, both ends included."""
    if len(ladder) <= count:
        return ladder
    step = (len(ladder) - 1) / (count - 1)
    return tuple(sorted({ladder[round(i * step)] for i in range(count)}))


class Limits:
    """The device's and the engine's constraints, as the controller uses them."""

    def __init__(
        self, device: DeviceConstraints, engine: EngineConstraints, params: ControllerParams
    ) -> None:
        self.device = device
        self.engine = engine
        self.params = params
        # The clocks the controller chooses among (a subset of the device's ladder).
        self.clocks_mhz = candidate_clocks(
            device.sm_clock_ladder_mhz, params.clock.clock_candidates
        )

    @property
    def top_mhz(self) -> int:
        return self.device.sm_clock_max_mhz

    def snap(self, mhz: float) -> int:
        """The highest candidate clock at or below mhz (the lowest candidate at least)."""
        i = bisect.bisect_right(self.clocks_mhz, mhz) - 1
        return self.clocks_mhz[max(i, 0)]

    def move(self, mhz: int, steps: int) -> int:
        """The candidate `steps` places from mhz (negative: down), within the candidates."""
        i = bisect.bisect_left(self.clocks_mhz, mhz)
        i = min(max(i + steps, 0), len(self.clocks_mhz) - 1)
        return self.clocks_mhz[i]

    def hw_limit_enforces(self, budget_w: float) -> bool:
        """Whether the board power limit, set at power_limit_margin x budget, is within the
        device's range (then it holds the budget at 100 ms; below it only the clock can)."""
        d = self.device
        return d.can_set_power_limit and (
            d.power_limit_min_w is None
            or budget_w * self.params.targets.power_limit_margin >= d.power_limit_min_w
        )

    def power_limit_for(self, budget_w: float) -> float | None:
        """The board power limit that goes with a budget (None: the device sets none)."""
        if not self.device.can_set_power_limit:
            return None
        return self.clamp_power(budget_w * self.params.targets.power_limit_margin)

    def clamp_power(self, watts: float) -> float:
        d = self.device
        if d.power_limit_min_w is not None:
            watts = max(watts, d.power_limit_min_w)
        if d.power_limit_max_w is not None:
            watts = min(watts, d.power_limit_max_w)
        return round(watts, 1)

    def clamp(self, knobs: Knobs) -> Knobs:
        """Never command outside the device's and the engine's constraints."""
        e, d = self.engine, self.device
        seqs = min(max(knobs.max_num_seqs, 1), e.max_num_seqs_max)
        tokens = min(
            max(knobs.max_num_batched_tokens, e.max_num_batched_tokens_min),
            e.max_num_batched_tokens_max,
        )
        level = knobs.quant_level
        if level is not None and level not in {o.level for o in e.quant_options}:
            level = None
        clock = knobs.sm_clock_mhz
        if clock is not None:
            ladder = d.sm_clock_ladder_mhz
            i = bisect.bisect_right(ladder, clock) - 1
            clock = ladder[max(i, 0)] if d.can_lock_clocks else None
        limit = knobs.power_limit_w
        if limit is not None:
            limit = self.clamp_power(limit) if d.can_set_power_limit else None
        interval = min(max(knobs.decode_interval_ms, 0.0), e.decode_interval_max_ms)
        return Knobs(seqs, tokens, level, clock, limit, interval)
