"""The power guard: the budget in force (derated as the GPU nears its thermal limit), and
measured power over it lowering the clock at once and holding that ceiling (anti-windup)
until power has stayed under the release margin. It overrides the models; it must not
import torch or the daemon, read a clock, or touch a device or an engine.

States: no ceiling -- over budget --> ceiling held (hold_s) -- hold passed, power under
power_release_margin x budget --> ceiling raised a step (or to the safe clock) ... --> no
ceiling once it reaches the top clock. A guard firing again within twice its hold doubles
the hold (up to power_hold_max_s).
"""

from __future__ import annotations

import math

from wattserve.controller.guard_state import PowerGuardState
from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits
from wattserve.controller.outlook import Outlook
from wattserve.controller.part import Part
from wattserve.controller.policy import Knobs
from wattserve.controller.signals import Telemetry
from wattserve.controller.state import Choice, ControllerState, Reason


class PowerGuard(Part):
    """Measured power against the budget; the clock ceiling it holds."""

    def __init__(self, limits: Limits, learner: Learner) -> None:
        super().__init__(limits, learner)
        self.state = PowerGuardState(hold_s=limits.params.power_guard.power_hold_s)

    @property
    def derate(self) -> float:
        return self.state.derate

    def limit_failed_within(self, now_s: float, seconds: float) -> bool:
        """See PowerGuardState.limit_failed_within."""
        return self.state.limit_failed_within(now_s, seconds)

    def effective_budget_w(self, telemetry: Telemetry | None, budget_w: float) -> float:
        """The policy's budget derated linearly from thermal_derate_start_c of thermal
        margin down to thermal_derate_min at thermal_derate_full_c."""
        p = self.params
        derate = 1.0
        if telemetry is not None and telemetry.thermal_margin_c is not None:
            m = telemetry.thermal_margin_c
            if m <= p.power_guard.thermal_derate_full_c:
                derate = p.power_guard.thermal_derate_min
            elif m < p.power_guard.thermal_derate_start_c:
                frac = (p.power_guard.thermal_derate_start_c - m) / (
                    p.power_guard.thermal_derate_start_c - p.power_guard.thermal_derate_full_c
                )
                derate = 1.0 - frac * (1.0 - p.power_guard.thermal_derate_min)
        # Smooth: derating follows temperature at once, recovers a little each observation.
        s = self.state
        if derate < s.derate:
            s.derate = derate
        else:
            s.derate = min(derate, s.derate + 0.02)
        return budget_w * s.derate

    def check(
        self, telemetry: Telemetry, knobs: Knobs, now_s: float, budget_w: float, power_w: float
    ) -> Choice | None:
        """Over the budget: the highest clock the power model puts under power_margin x
        budget in the phase running now (or, without a trusted model, the clock cut in
        proportion), at least one candidate down, held as the ceiling. None: within it.
        knobs carry the board limit this budget sets."""
        s = self.state
        if knobs.power_limit_w != s.limit_w:
            s.limit_w, s.limit_since_s = knobs.power_limit_w, now_s
        # One noisy short-window reading just over is not a violation; a sustained one, or
        # one clearly over, is.
        avg = telemetry.power_avg_w if telemetry.power_avg_w is not None else power_w
        tolerance = 1.0 + self.params.power_guard.power_noise_tolerance
        if power_w <= budget_w * tolerance and not (power_w > budget_w and avg > budget_w):
            return None
        p, lim = self.params, self.limits
        actual = telemetry.sm_clock_mhz or knobs.sm_clock_mhz or lim.top_mhz
        model = self.learner.power
        one_down = lim.move(lim.snap(actual), -1)
        target = None
        if model.samples >= p.learning.learning_min_power_samples:
            prefill = self.learner.prefill_lately(20)
            for f in reversed(lim.clocks_mhz):
                if f > one_down:
                    continue
                peak = model.predict_w(
                    f, 0.0 if prefill else 1.0, 1.0 if prefill else 0.0, telemetry.gpu_temp_c
                )
                if peak <= budget_w * p.targets.power_margin:
                    target = f
                    break
        if target is None:
            # No trusted model: cut the clock in proportion (dynamic power ~ f^2 or more).
            scaled = actual * math.sqrt(budget_w / power_w) * p.targets.power_margin
            target = min(lim.snap(scaled), one_down)
        target = max(target, lim.device.sm_clock_min_mhz)
        self._hold_ceiling(target, now_s)
        # Only readings that cover the board limit's time in force tell that it failed to
        # hold the budget: right after a cut the device's windows still average power from
        # under the higher limit before (the guard cuts at once all the same).
        window_s = max(telemetry.power_avg_window_s or 0.0, 0.1)
        if knobs.power_limit_w is None or now_s - s.limit_since_s >= window_s:
            s.limit_failed_s = now_s
        return Choice(
            ControllerState.GUARD_POWER,
            knobs.with_changes(sm_clock_mhz=target),
            Reason.OVER_BUDGET,
            f"power {power_w:.0f} W over the budget {budget_w:.0f} W"
            + (f" (derated x{s.derate:.2f})" if s.derate < 1 else "")
            + f": clock {actual} -> {target} MHz, held for {s.hold_s:g} s",
        )

    def _hold_ceiling(self, target_mhz: int, now_s: float) -> None:
        """Transition: fired. A guard that fires again soon after its ceiling was released
        holds twice as long (up to power_hold_max_s): the release was too early, and must
        not become a limit cycle."""
        p, s = self.params, self.state
        if now_s - s.last_fired_s < 2 * s.hold_s:
            s.hold_s = min(s.hold_s * 2, p.power_guard.power_hold_max_s)
        else:
            s.hold_s = p.power_guard.power_hold_s
        s.last_fired_s = now_s
        s.ceiling_mhz = target_mhz
        s.ceiling_until_s = now_s + s.hold_s

    def active_ceiling(
        self, outlook: Outlook, power_w: float, budget_w: float, temp_c: float | None = None
    ) -> int | None:
        """The clock ceiling in force (anti-windup: nothing raises the clock above it).
        Transition: past the hold, with power below the release margin, it rises by one
        candidate, or at once to the highest clock the power model predicts safe when that
        is higher; released once it reaches the top clock."""
        s = self.state
        if s.ceiling_mhz is None:
            return None
        p, lim = self.params, self.limits
        now_s = outlook.now_s
        if now_s >= s.ceiling_until_s and power_w < budget_w * p.power_guard.power_release_margin:
            raised = max(lim.move(s.ceiling_mhz, +1), outlook.safe_clock(budget_w, temp_c))
            if raised >= lim.top_mhz:
                s.ceiling_mhz = None
                return None
            s.ceiling_mhz = raised
            s.ceiling_until_s = now_s + p.clock.clock_min_interval_s
        return s.ceiling_mhz

    def clock_as_power_limit(
        self, wanted: Knobs, clamped: Knobs, budget_w: float, temp_c: float | None
    ) -> Knobs:
        """Where clocks cannot be locked, the chosen clock becomes a power limit: the
        predicted peak power at that clock, never above the budget's limit."""
        model = self.learner.power
        limit = self.limits.power_limit_for(budget_w)
        if wanted.sm_clock_mhz is not None and model.samples > 0:
            peak = model.predict_w(wanted.sm_clock_mhz, 0.0, 1.0, temp_c) * 1.05
            limit = self.limits.clamp_power(min(peak, limit if limit is not None else peak))
        return clamped.with_changes(power_limit_w=limit)
