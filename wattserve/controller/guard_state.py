"""The guards' holds: the state the power and latency guards keep (ceilings, floors, bars,
holds, the descent on probation) and the read-only questions the outlook and the timescales
ask of it. The guards (power_guard.py, latency_guard.py) write it; nothing else does. It
must not import the guards, the outlook or the timescales (that would tie them in a cycle),
nor torch or the daemon.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DescentWatch:
    """A descent on probation: the setting it left (before the first descent of a chain
    not yet earned), when the latest began, and the latencies measured since then."""

    from_mhz: int
    from_interval_ms: float
    since_s: float
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)


@dataclass
class LatencyGuardState:
    waiting_hist: deque[int] = field(default_factory=deque)  # queue lengths, latest last
    running_hist: deque[int] = field(default_factory=deque)  # running batches, latest last
    last_fired_s: float = -math.inf
    floor_mhz: int | None = None  # no clock below this while it holds
    floor_until_s: float = -math.inf
    watch: DescentWatch | None = None
    bar_mhz: int | None = None  # a reverted descent: no clock below this while it holds
    bar_until_s: float = -math.inf
    pace_bar_ms: float | None = None  # and no decode interval longer than this
    hold_until_s: float = -math.inf  # the timescales hold still until then
    queue_floor: bool = False  # the floor in force was put up by a queue, not a miss

    def floor(self, now_s: float) -> int | None:
        """The clock floor in force: a guard's step up or a reverted descent's bar (None:
        none holds)."""
        held = [
            f
            for f, until in ((self.floor_mhz, self.floor_until_s), (self.bar_mhz, self.bar_until_s))
            if f is not None and now_s < until
        ]
        return max(held) if held else None

    def pace_limit_ms(self, now_s: float) -> float | None:
        """The longest decode interval a reverted descent allows (None: no bar)."""
        return self.pace_bar_ms if now_s < self.bar_until_s else None

    def fired_within(self, now_s: float, seconds: float) -> bool:
        return now_s - self.last_fired_s < seconds

    def holding(self, now_s: float) -> bool:
        """Fired within guard_hold_s (or until its floor let go): the timescales do not
        shrink or switch meanwhile."""
        return now_s < self.hold_until_s


@dataclass
class PowerGuardState:
    derate: float = 1.0  # the share of the policy's budget in force (thermal derating)
    ceiling_mhz: int | None = None  # no clock above this (None: no ceiling)
    ceiling_until_s: float = -math.inf  # held unchanged until then
    hold_s: float = 0.0  # how long the next ceiling is held
    last_fired_s: float = -math.inf
    limit_w: float | None = None  # the board limit the knobs carry, and since when
    limit_since_s: float = -math.inf
    # The last firing on readings taken wholly under that limit: it did not hold.
    limit_failed_s: float = -math.inf

    def limit_failed_within(self, now_s: float, seconds: float) -> bool:
        """Power was measured over the budget under the board limit set for it (the
        limit did not hold, or not in time) within the last `seconds`."""
        return now_s - self.limit_failed_s < seconds
