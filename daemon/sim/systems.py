"""What the runner drives: the System interface every compared system offers (the
bench's baselines subclass it) and `Controlled`, the daemon's own ControlLoop and
Controller in auto mode, the system under test.

No decisions here: Controlled only wires the daemon's loop to an engine and a device.
"""

from __future__ import annotations

from typing import Any

from controller.policy import Policy
from daemon.sim.calibration import Calibration

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
        from controller.controller import Controller
        from controller.policy import Knobs, QuantOption
        from controller.signals import EngineConstraints
        from daemon.control_loop import ControlLoop, device_constraints

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
            "effective_budget_w": d.effective_budget_w,
        }
