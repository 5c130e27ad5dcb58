"""What the runner drives: the System interface every compared system offers (the
bench's baselines subclass it) and `Controlled`, the daemon's own ControlLoop and
Controller in auto mode, the system under test.

No decisions here: Controlled only wires the daemon's loop to an engine and a device.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

from wattserve.controller.policy import Policy
from wattserve.sim.calibration import Calibration

PERIOD_S = 0.25  # the control loop period (and every baseline's)


class System:
    """What every compared system offers the runner; baselines override what they use."""

    name = "system"

    def __init__(self, engine, device, clock) -> None:
        self.engine = engine
        self.device = device
        self.clock = clock
        self.knob_changes = 0

    def on_step(self, stats) -> None:
        pass

    def record_ttft_s(self, ttft_s: float) -> None:
        pass

    def record_tpot_s(self, tpot_s: float) -> None:
        pass

    def set_budget_w(self, budget_w: float) -> None:
        pass

    def tick(self) -> dict:
        """One control period; returns the knobs for the timeline."""
        return {}

    def freeze_view(self) -> Callable[[Any], dict] | None:
        """What this system's own models predict, frozen now, as a function of a static
        setting (wattserve.sim.oracle.StaticSetting); None: a system without models."""
        return None


class Controlled(System):
    """The daemon's ControlLoop and Controller, in auto mode."""

    name = "controller"

    def __init__(
        self,
        engine,
        device,
        clock,
        policy: Policy,
        cal: Calibration,
        levels: tuple[str, ...],
        *,
        inline: bool,
        name: str = "controller",
        decode_interval_max_ms: float = 1000.0,
        speeds: dict[str, dict[str, float]] | None = None,
    ) -> None:
        from wattserve.controller.controller import Controller
        from wattserve.controller.policy import Knobs, QuantOption
        from wattserve.controller.signals import EngineConstraints
        from wattserve.daemon.control_loop import ControlLoop, device_constraints

        super().__init__(engine, device, clock)
        self.name = name
        telemetry = device.read()
        limits = engine.limits

        # What bench quant's table gives the daemon: quality, weight bytes, batch-16 decode
        # and prefill speed (`speeds`, measured on this machine, or the calibration's).
        def speed(lv: str) -> tuple[float, float]:
            if speeds:
                return speeds[lv]["decode_tok_s_bs16"], speeds[lv]["prefill_tok_s"]
            fit = cal.levels[lv]
            return 16 / fit.step_s(0, 16, 16 * 200), 256 / fit.step_s(256, 0, 256)

        options = tuple(
            QuantOption(
                lv,
                cal.levels[lv].ppl_increase_pct,
                cal.levels[lv].weight_bytes,
                *speed(lv),
            )
            for lv in levels
        )

        ctl = Controller(
            policy,
            device_constraints(device, telemetry),
            EngineConstraints(
                max_num_seqs_max=limits.max_num_seqs,
                max_num_batched_tokens_max=limits.max_num_batched_tokens,
                max_num_batched_tokens_min=cal.block_size_tokens,
                quant_options=options,
                full_precision_level=cal.full_precision,
                decode_interval_max_ms=decode_interval_max_ms,
            ),
            Knobs(limits.max_num_seqs, limits.max_num_batched_tokens, engine.quant_level),
        )
        extra: dict[str, Any] = {"oldest_waiting_s": engine.oldest_waiting_s}
        if inline:
            extra["run_blocking"] = lambda fn: fn()
            extra["step_clock_mhz"] = lambda: device.read().sm_clock_mhz
        self.loop = ControlLoop(
            ctl,
            engine,
            device,
            kv_bytes_per_token=cal.kv_bytes_per_token,
            period_s=PERIOD_S,
            clock=clock,
            **extra,
        )
        self._last_knobs = None

    def on_step(self, stats) -> None:
        self.loop.on_step(stats)

    def record_ttft_s(self, ttft_s: float) -> None:
        self.loop.record_ttft_s(ttft_s)

    def record_tpot_s(self, tpot_s: float) -> None:
        self.loop.record_tpot_s(tpot_s)

    def set_budget_w(self, budget_w: float) -> None:
        # The same path a PUT /v1/control/policy takes.
        self.loop.set_policy(self.loop.controller.policy.with_changes(power_budget_w=budget_w))

    def freeze_view(self) -> Callable[[Any], dict] | None:
        """The controller's models as they stand now (a copy), asked what a static setting
        would give at the load they estimate now: J/token, power, the percentile TTFT and
        TPOT with the adaptive margin, and whether the controller could choose it
        (`feasible`). Where the controller never takes the hindsight oracle's setting,
        this says which of its predictions rules it out."""
        ctl = copy.deepcopy(self.loop.controller)
        temp_c = self.device.read().gpu_temp_c
        workload = ctl.learner.workload.current()
        budget_w = ctl.policy.power_budget_w

        def view(setting: Any) -> dict:
            outlook = ctl.outlook()
            pr = outlook.predict(
                setting.level,
                setting.sm_clock_mhz,
                setting.max_num_seqs,
                setting.max_num_batched_tokens,
                workload,
                temp_c,
                setting.decode_interval_ms,
            )
            ttft_ms = pr.ttft_ms * outlook.error_factor("ttft", pr)
            tpot_ms = pr.tpot_ms * outlook.error_factor("tpot", pr)
            return {
                "request_rate_per_s": round(workload.request_rate_per_s, 3),
                "j_per_token": _rounded(pr.j_per_token, 4),
                "power_w": _rounded(pr.power_w, 1),
                "p99_ttft_ms": _rounded(ttft_ms, 1),
                "p99_tpot_ms": _rounded(tpot_ms, 1),
                "stable": pr.stable,  # False: the engine predicted not to keep up
                "feasible": outlook.feasible(pr, budget_w),
            }

        return view

    def tick(self) -> dict:
        d = self.loop.tick()
        self.knob_changes += len(d.changed)
        return {
            "sm_clock_mhz": d.knobs.sm_clock_mhz,
            "max_num_seqs": d.knobs.max_num_seqs,
            "max_num_batched_tokens": d.knobs.max_num_batched_tokens,
            "decode_interval_ms": d.knobs.decode_interval_ms,
            "quant_level": self.engine.quant_level,
            "state": d.state.value,
            "reason_code": d.reason_code.value,
            "reason": d.reason,
            "effective_budget_w": d.effective_budget_w,
            **_predicted(d.prediction),
        }


def _predicted(pr) -> dict:
    """A decision's prediction for the timeline: what the models expected of the knobs."""
    if pr is None:
        return {}
    return {
        "predicted_j_per_token": _rounded(pr.j_per_token, 4),
        "predicted_power_w": _rounded(pr.power_w, 1),
        "predicted_ttft_ms": _rounded(pr.ttft_ms, 1),
        "predicted_tpot_ms": _rounded(pr.tpot_ms, 1),
    }


def _rounded(x: float, digits: int) -> float | None:
    """JSON-ready: None for an infinite or undefined prediction."""
    return round(x, digits) if math.isfinite(x) else None
