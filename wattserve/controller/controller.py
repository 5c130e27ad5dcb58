"""The feedback controller: observe(telemetry, engine stats, now) -> Decision (+ reason).

Pure decision logic over plain values: it learns step-latency and power models from what
it observes, predicts each candidate configuration, picks the cheapest one predicted to
meet the SLOs inside the power budget, and lets feedback guards override the models. It
keeps its own state (named states, explicit transitions, counters) and nothing else: it
must not import torch or the daemon, read a clock, sleep, or touch a device or an engine.
The daemon's control loop (wattserve/daemon/control_loop.py) feeds it and applies its decisions.
"""

from __future__ import annotations

from wattserve.controller.batch_caps import BatchCaps
from wattserve.controller.clock import ClockTimescale
from wattserve.controller.latency_guard import LatencyGuard
from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits, candidate_clocks
from wattserve.controller.models import (
    Workload,
)
from wattserve.controller.outlook import Outlook
from wattserve.controller.pacing import DecodePacing
from wattserve.controller.params import ControllerParams
from wattserve.controller.policy import ControlMode, Knobs, Policy, allowed_quant_levels
from wattserve.controller.power_guard import PowerGuard
from wattserve.controller.quant import QuantTimescale
from wattserve.controller.reference import ReferenceCheck
from wattserve.controller.signals import (
    DeviceConstraints,
    EngineConstraints,
    EngineStats,
    Telemetry,
)
from wattserve.controller.state import (
    Choice,
    ControllerCounters,
    ControllerState,
    Decision,
    Reason,
)

__all__ = [
    "Controller",
    "ControllerCounters",
    "ControllerParams",
    "ControllerState",
    "Decision",
    "Reason",
    "candidate_clocks",
]


_INFEASIBLE = (
    "no candidate predicted to meet every target: the reference's prefill chunk, unpaced, at "
    "the clock with the most headroom within the budget"
)


class Controller:
    """Decides the knobs from observations, on separate timescales.

    The core: each observation runs learn (Learner) -> guards (PowerGuard, LatencyGuard)
    -> timescales (QuantTimescale, BatchCaps, ClockTimescale, DecodePacing), which ask an
    Outlook (the models' predictions at that moment); it assembles the Decision. Each part
    keeps its own state dataclass; the core keeps the named state and the knobs.

    NOTE: predict, then guard. Every observation first feeds the models: each engine step
    teaches the step-latency model of its quantization level (RLS over the batch's tokens,
    with a f_max/f - 1 slowdown term per token kind), each power reading teaches one power
    model (RLS over the window's decode and prefill busy shares at each clock); measured
    TTFT/TPOT over the model's smoothed mean give the percentile ratios, and measured
    100 ms power over the modelled prefill phase gives the peak ratio. Guards come first
    and override the models: power over the thermally derated budget lowers the clock at
    once and holds that ceiling (anti-windup: nothing raises the clock above it until the
    hold has passed with power under the release margin; a re-trigger doubles the hold);
    a growing queue, a waiting queue predicted to get its first tokens late at this clock
    (feed-forward: the queued prompts' prefill, with arrivals meanwhile) or a measured
    TTFT/TPOT miss raises the clock at once (to the top for a request waiting half its
    TTFT SLO), never above what the budget allows, and holds that floor. Predictions carry
    an adaptive margin: the split-conformal quantile of measured over predicted percentile
    latencies at their level and clock (1 where the model's percentiles hold). Descents earn
    their way: one whose measured latencies come near an SLO within descent_watch_s is
    reverted before a miss and the lower setting barred for descent_bar_s. Without a
    guard, three timescales: the clock each observation (the least predicted J/token
    whose percentile TTFT/TPOT meet slo_margin x SLO and whose power fits the budget;
    fast up, slow down: a lower clock needs a tighter margin, a gain of clock_gain_min_pct
    and descend_hold_s since the last move up, none while requests wait, and only clocks
    a few candidates beyond those seen are trusted); the batch caps every batch_period_s
    (the prefill chunk sized for the clock in force, so that no step outlasts a fraction
    of the SLOs; a bigger chunk comes with a faster clock at once); the quantization
    level after quant_dwell_s for a quant_gain_min_pct gain (twice that to go back),
    levels compared over the same clocks, only on models that have seen batches like
    the largest of the last quant_peak_window_s, never while a queue is served, a
    never-run level tried once (fastest measured first), and when the current one cannot
    cope for quant_stuck_s an escape to a level with more headroom, or a new trial of a
    faster level whose model has not seen this load. Where the board power limit can hold
    the budget it is set to it (the 100 ms backstop); below its range only the clock holds
    the budget, with predicted peak phases. Idle: the lowest trusted clock whose predicted TTFT for
    the next arrival meets the SLO. Stale telemetry: hold, then the fallback knobs. While
    the hardware slows the GPU down (HwSlowdown, HwThermal, HwPowerBrake) no decision
    raises the clock, whatever chose it; lowering it stays allowed.
    """

    def __init__(
        self,
        policy: Policy,
        device: DeviceConstraints,
        engine: EngineConstraints,
        initial_knobs: Knobs,
        params: ControllerParams | None = None,
    ) -> None:
        self.params = params or ControllerParams()
        self.device = device
        self.engine = engine
        self._policy = policy
        self.limits = Limits(device, engine, self.params)
        reference_w = device.power_limit_max_w or policy.power_budget_w
        self.learner = Learner(self.params, device.sm_clock_max_mhz, reference_w)
        self.power_guard = PowerGuard(self.limits, self.learner)
        self.latency_guard = LatencyGuard(self.limits, self.learner)
        self.clock = ClockTimescale(self.limits, self.learner)
        self.quant = QuantTimescale(self.limits, self.learner)
        self.caps = BatchCaps(self.limits, self.learner, self.clock)
        self.pacing = DecodePacing(self.limits, self.learner)
        self.counters = ControllerCounters()
        self.state = ControllerState.LEARNING
        self._knobs = self.limits.clamp(initial_knobs)
        self.reference = ReferenceCheck(self.limits, self.learner)
        self._manual_knobs: Knobs | None = None
        self._last_safe = self._knobs
        self._seq = 0
        self._last: Decision | None = None
        self._stale_since_s: float | None = None
        self._idle_since_s: float | None = None
        self._now_s = 0.0

    def outlook(self, now_s: float | None = None) -> Outlook:
        """The models' view at now_s (default: the latest observation)."""
        return Outlook(
            self.params,
            self.limits,
            self.learner,
            self.power_guard.state,
            self.latency_guard.state,
            self._policy,
            self._now_s if now_s is None else now_s,
            self._knobs.decode_interval_ms,
        )

    # ---- public surface ----------------------------------------

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def knobs(self) -> Knobs:
        """The knobs of the latest decision (advice only in observe mode)."""
        return self._knobs

    @property
    def last_decision(self) -> Decision | None:
        return self._last

    def set_policy(self, policy: Policy) -> None:
        """Take a new policy (HTTP, MQTT or config); acted on at the next observation.

        A budget cut takes effect at once: the next observation sees power against it.
        """
        if policy.mode == ControlMode.MANUAL and self._manual_knobs is None:
            self._manual_knobs = self._knobs
        self._policy = policy

    def set_manual_knobs(self, knobs: Knobs) -> Knobs:
        """The operator's knobs for manual mode (clamped into the constraints)."""
        self._manual_knobs = self.limits.clamp(knobs)
        return self._manual_knobs

    def observe(self, telemetry: Telemetry | None, stats: EngineStats, now_s: float) -> Decision:
        """Learn from one observation and decide every knob."""
        self._now_s = now_s
        self.learn(telemetry, stats, now_s)
        if self._policy.mode == ControlMode.AUTO:
            self.reference.note(telemetry, stats, self._knobs, self._policy, self.outlook(), now_s)
        budget_w = self.power_guard.effective_budget_w(telemetry, self._policy.power_budget_w)
        choice = self._choose(telemetry, stats, now_s, budget_w)
        return self._finish(choice, now_s, budget_w, telemetry)

    def status(self) -> dict:
        """JSON-ready state for /v1/status and MQTT."""
        last = self._last
        allowed = self._allowed_levels()
        return {
            "state": self.state.value,
            "mode": self._policy.mode.value,
            "policy": {
                "power_budget_w": self._policy.power_budget_w,
                "ttft_slo_ms": self._policy.ttft_slo_ms,
                "tpot_slo_ms": self._policy.tpot_slo_ms,
                "slo_percentile": self._policy.slo_percentile,
                "objective": self._policy.objective.value,
                "max_ppl_increase_pct": self._policy.max_ppl_increase_pct,
            },
            "effective_budget_w": last.effective_budget_w if last else None,
            "thermal_derate": round(self.power_guard.derate, 3),
            "last_decision": last.to_dict() if last else None,
            "counters": self.counters.snapshot(),
            "models": {
                level: {
                    "step_samples": m.samples,
                    "seen_clocks_mhz": m.seen_clocks(self.params.learning.trust_min_samples),
                }
                for level, m in self.learner.step_models.items()
            },
            "power_samples": self.learner.power.samples,
            "reference": self.reference.status(),
            # What bench quant's table says of each level, and which the quality limit allows.
            "quant_levels": {
                o.level: {
                    "allowed": o.level in allowed,
                    "ppl_increase_pct": o.ppl_increase_pct,
                    "decode_tok_s": o.decode_tok_s,
                    "prefill_tok_s": o.prefill_tok_s,
                }
                for o in self.engine.quant_options
            },
            # The adaptive margin at the knobs in force (1: the model's percentiles held).
            "latency_error_factor": {
                kind: round(
                    self.learner.error_factor(
                        kind,
                        self._knobs.quant_level or self.engine.full_precision_level,
                        self._knobs.sm_clock_mhz or self.device.sm_clock_max_mhz,
                        self._now_s,
                    ),
                    3,
                )
                for kind in ("ttft", "tpot")
            },
            "latency_ratio": {
                "ttft": round(
                    self.learner.ttft_ratio.ratio(self._now_s, self._policy.slo_percentile), 3
                ),
                "tpot": round(
                    self.learner.tpot_ratio.ratio(self._now_s, self._policy.slo_percentile), 3
                ),
            },
        }

    def _allowed_levels(self) -> tuple[str, ...]:
        """The levels the policy's quality limit allows (bench quant's table decides)."""
        return allowed_quant_levels(
            self.engine.quant_options,
            self.engine.full_precision_level,
            self._policy.max_ppl_increase_pct,
        )

    # ---- learning ----------------------------------------

    def learn(self, telemetry: Telemetry | None, stats: EngineStats, now_s: float) -> None:
        """Learn from one observation without deciding (observe does this first)."""
        self.learner.learn(
            telemetry,
            stats,
            now_s,
            self._clock_now(telemetry),
            paced=self._knobs.decode_interval_ms > 0,
            tracking=self.state == ControllerState.TRACKING,
            since_clock_change_s=self.clock.since_change_s(now_s),
            before_step=self.quant.judge_trial_step,
        )
        self.clock.note_first_tokens(stats.ttft_s, now_s)
        self.latency_guard.note_queue(stats.num_waiting, stats.num_running, now_s)
        self.latency_guard.note_latencies(stats.ttft_s, stats.tpot_s, now_s)

    def _clock_now(self, telemetry: Telemetry | None) -> int | None:
        if telemetry is not None and telemetry.sm_clock_mhz:
            return telemetry.sm_clock_mhz
        return self._knobs.sm_clock_mhz or self.device.sm_clock_max_mhz

    # ---- the decision ----------------------------------------

    def _choose(
        self, telemetry: Telemetry | None, stats: EngineStats, now_s: float, budget_w: float
    ) -> Choice:
        p = self.params
        current = self._current_knobs(telemetry, stats)
        # 1. Stale or missing telemetry: hold the last safe configuration, then fall back.
        if telemetry is None or not telemetry.usable:
            return self._stale(telemetry, current, now_s, budget_w)
        self._stale_since_s = None
        outlook = self.outlook()
        power_w = telemetry.power_w or 0.0
        power_limit = self.limits.power_limit_for(budget_w)

        # 2. Manual: the operator's knobs, with only the power and thermal guards.
        if self._policy.mode == ControlMode.MANUAL:
            return self._manual(telemetry, current, outlook, now_s, budget_w, power_w, power_limit)

        # 3. Over budget: step down at once, whatever the model says.
        base = current.with_changes(power_limit_w=power_limit)
        guarded = self.power_guard.check(telemetry, base, now_s, budget_w, power_w)
        if guarded is not None:
            self.latency_guard.release_floor()  # power wins over latency
            return guarded
        ceiling = self.power_guard.active_ceiling(outlook, power_w, budget_w, telemetry.gpu_temp_c)
        reference = self.reference.knobs(base, ceiling, outlook, budget_w)

        allowed = self._allowed_levels()
        level = base.quant_level or self.engine.full_precision_level
        if level not in allowed:
            target = self.quant.best_allowed_level(allowed, level)
            return Choice(
                self.state if self.state != ControllerState.IDLE else ControllerState.TRACKING,
                base.with_changes(quant_level=target),
                Reason.QUANT_FORBIDDEN,
                f"quantization level {level} is not allowed by the policy "
                f"(max_ppl_increase_pct {self._policy.max_ppl_increase_pct}): "
                f"switching to {target}",
            )

        # Before anything is learned: the level bench quant's table ranks first.
        start = self.quant.start(base, allowed, level)
        if start is not None:
            return start

        # A trial whose steps measure much slower than the level before ends at once.
        verdict = self.quant.verdict(base, now_s)
        if verdict is not None:
            return verdict

        # 4. Latency guards: queue growth or a measured SLO miss steps up at once.
        workload = self.learner.workload.current()
        latency = self.latency_guard.check(
            telemetry, stats, base, outlook, ceiling, budget_w, workload
        )
        if latency is not None:
            return self._answer_latency(
                latency, base, allowed, workload, telemetry, outlook, budget_w, ceiling
            )

        step_model = self.learner.step_model(level)

        # 5. Idle: the lowest clock whose TTFT for the next arrival meets the SLO.
        if self._idle_for(stats, now_s) >= p.fallback.idle_after_s:
            return self.clock.idle(base, step_model, workload, outlook, ceiling)

        # 6. Learning: too little data to trust the models; the highest clock the budget allows.
        if (
            step_model.samples < p.learning.learning_min_steps
            or self.learner.power.samples < p.learning.learning_min_power_samples
        ):
            return self._learning(base, level, ceiling)

        # 7. Not measured ahead of the reference: the reference runs.
        if (why := self.reference.holding(now_s)) is not None:
            return Choice(ControllerState.REFERENCE, reference, Reason.REFERENCE, why)

        # 8. Tracking: least predicted J/token meeting the SLOs, on three timescales.
        return self._track(
            base, allowed, workload, telemetry, outlook, budget_w, ceiling, reference
        )

    def _idle_for(self, stats: EngineStats, now_s: float) -> float:
        """How long nothing has run or waited (0 when something does now)."""
        if stats.num_running or stats.num_waiting or stats.steps:
            self._idle_since_s = None
            return 0.0
        if self._idle_since_s is None:
            self._idle_since_s = now_s
        return now_s - self._idle_since_s

    def _stale(
        self, telemetry: Telemetry | None, current: Knobs, now_s: float, budget_w: float
    ) -> Choice:
        """Stale or missing telemetry: hold the last safe configuration for stale_hold_s,
        then the conservative fallback."""
        p = self.params
        if self._stale_since_s is None:
            self._stale_since_s = now_s
        stale_for = now_s - self._stale_since_s
        if stale_for < p.fallback.stale_hold_s:
            return Choice(
                ControllerState.HOLD,
                self._last_safe,
                Reason.STALE_HOLD,
                f"telemetry {'missing' if telemetry is None else 'stale'} for "
                f"{stale_for:.1f} s: holding the last safe configuration",
            )
        return Choice(
            ControllerState.FALLBACK,
            self._fallback_knobs(current, budget_w),
            Reason.STALE_FALLBACK,
            f"telemetry stale for {stale_for:.1f} s (> {p.fallback.stale_hold_s:g} s): "
            "conservative fallback configuration",
        )

    def _manual(
        self,
        telemetry: Telemetry,
        current: Knobs,
        outlook: Outlook,
        now_s: float,
        budget_w: float,
        power_w: float,
        power_limit: float | None,
    ) -> Choice:
        """The operator's knobs, with only the power and thermal guards."""
        manual = (self._manual_knobs or current).with_changes(power_limit_w=power_limit)
        guarded = self.power_guard.check(telemetry, manual, now_s, budget_w, power_w)
        if guarded is not None:
            self.latency_guard.release_floor()  # power wins over latency
            return guarded
        ceiling = self.power_guard.active_ceiling(outlook, power_w, budget_w, telemetry.gpu_temp_c)
        if ceiling is not None and (manual.sm_clock_mhz or self.device.sm_clock_max_mhz) > ceiling:
            manual = manual.with_changes(sm_clock_mhz=ceiling)
        return Choice(
            ControllerState.MANUAL,
            manual,
            Reason.MANUAL,
            "manual knobs (power and thermal guarded)",
        )

    def _answer_latency(
        self,
        latency: Choice,
        base: Knobs,
        allowed: tuple[str, ...],
        workload: Workload,
        telemetry: Telemetry,
        outlook: Outlook,
        budget_w: float,
        ceiling: int | None,
    ) -> Choice:
        """The latency guard fired: its step up, unless a calm quantization trial is to
        blame (it ends) or the level has not coped for quant_stuck_s (an escape)."""
        now_s = outlook.now_s
        # A calm trial that hurts latency ends at once; a trial begun because the
        # previous level could not cope is not its fault, and goes on, as does one
        # whose steps have vouched for it: then the clock is what is short, the guard
        # raises it, and ending the trial would throw it away for a queue it did not
        # cause.
        ended = self.quant.end_calm_trial(now_s)
        if ended is not None:
            tried, before = ended
            latency.knobs = latency.knobs.with_changes(quant_level=before)
            latency.reason += f"; trial of {tried} aborted, back to {before}"
            return latency
        # Guards firing count as the level not coping; after quant_stuck_s of that,
        # the quantization step may escape to a level with more headroom.
        if self.quant.not_coping(now_s):
            escape = self.quant.step(
                base,
                allowed,
                workload,
                telemetry.gpu_temp_c,
                outlook,
                budget_w,
                ceiling,
                self.clock.steady_s(now_s),
            )
            if escape is not None:
                return escape
        return latency

    def _learning(self, base: Knobs, level: str, ceiling: int | None) -> Choice:
        """Too little data to trust the models: the highest clock the budget allows."""
        p = self.params
        step_model = self.learner.step_model(level)
        power_model = self.learner.power
        top = ceiling if ceiling is not None else self.device.sm_clock_max_mhz
        # The first level learns at the top clock, unpaced (nothing is known yet), the
        # second half of its steps at learning_low_clock_fraction of it: its model has
        # then seen two clocks before the first descent (its clock sensitivity starts
        # at nothing, and a descent on the top clock's steps alone took fp32 to a
        # clock where it could not keep up). A level tried later learns where the
        # controller already runs, at its clock and decode interval: its model starts
        # from the other level's clock sensitivity, and the guards stay armed.
        trained = any(
            m.samples >= p.learning.learning_min_steps
            for lv, m in self.learner.step_models.items()
            if lv != level
        )
        interval_ms = 0.0
        if not trained and step_model.samples >= p.learning.learning_min_steps // 2:
            top = self.limits.snap(p.learning.learning_low_clock_fraction * top)
        if trained and power_model.samples >= p.learning.learning_min_power_samples:
            top = min(top, base.sm_clock_mhz or top)
            interval_ms = base.decode_interval_ms
        knobs = base.with_changes(sm_clock_mhz=top, decode_interval_ms=interval_ms)
        return Choice(
            ControllerState.LEARNING,
            knobs,
            Reason.LEARNING,
            f"learning {level}: {step_model.samples}/{p.learning.learning_min_steps} steps, "
            f"{power_model.samples}/{p.learning.learning_min_power_samples} power samples; "
            f"clock {top} MHz",
        )

    def _current_knobs(self, telemetry: Telemetry | None, stats: EngineStats) -> Knobs:
        if self._policy.mode != ControlMode.OBSERVE:
            k = self._knobs
            if stats.quant_level and k.quant_level is None:
                k = k.with_changes(quant_level=stats.quant_level)
            return k
        # Observe mode applies nothing, so advice starts from what is in force.
        clock = telemetry.sm_clock_mhz if telemetry is not None else None
        return self.limits.clamp(
            self._knobs.with_changes(
                quant_level=stats.quant_level or self._knobs.quant_level,
                sm_clock_mhz=self._knobs.sm_clock_mhz if clock is None else self.limits.snap(clock),
            )
        )

    # ---- idle and fallback ----------------------------------------

    def _fallback_knobs(self, current: Knobs, budget_w: float) -> Knobs:
        p = self.params
        ladder = self.device.sm_clock_ladder_mhz
        clock = p.fallback.fallback_sm_clock_mhz or ladder[len(ladder) // 2]
        seqs = p.fallback.fallback_max_num_seqs or max(1, self.engine.max_num_seqs_max // 2)
        return current.with_changes(
            sm_clock_mhz=clock,
            max_num_seqs=min(seqs, current.max_num_seqs),
            power_limit_w=self.limits.power_limit_for(budget_w),
            decode_interval_ms=0.0,
        )

    # ---- tracking ----------------------------------------

    def _track(
        self,
        base: Knobs,
        allowed: tuple[str, ...],
        workload: Workload,
        telemetry: Telemetry,
        outlook: Outlook,
        budget_w: float,
        ceiling: int | None,
        reference: Knobs,
    ) -> Choice:
        """The timescales, slowest first: the level (a switch or a trial decides alone), the
        batch caps, the clock (a shorter decode interval with it), a longer interval."""
        now_s = outlook.now_s
        temp = telemetry.gpu_temp_c
        level = base.quant_level or self.engine.full_precision_level
        clock_now = base.sm_clock_mhz or self.device.sm_clock_max_mhz
        switched = self.quant.step(
            base, allowed, workload, temp, outlook, budget_w, ceiling, self.clock.steady_s(now_s)
        )
        if switched is not None:
            return switched
        surprise = self.learner.step_model(level).surprise
        if surprise > self.params.learning.surprise_max:
            # The engine slowed down suddenly: while the model's fit swings towards the new
            # costs, its predictions may call steps free, so nothing moves on them.
            return Choice(
                ControllerState.LEARNING,
                base,
                Reason.LEARNING,
                f"re-learning {level}: its latest steps took {surprise:.2g}x what its step "
                "model predicted; caps, clock and decode interval held",
            )
        knobs, caps_note = self.caps.step(
            level, clock_now, workload, base, outlook, budget_w, probing=self.quant.probing
        )
        notes = [caps_note] if caps_note is not None else []
        code = Reason.OPTIMIZE if caps_note is not None else Reason.STEADY
        move = self.clock.step(knobs, code, level, workload, temp, outlook, budget_w, ceiling)
        knobs, code, chosen, seqs = move.knobs, move.code, move.chosen, move.knobs.max_num_seqs
        notes += move.notes
        if code is Reason.INFEASIBLE:  # nothing dearer than the reference: its chunk, unpaced
            knobs = reference.with_changes(sm_clock_mhz=knobs.sm_clock_mhz, max_num_seqs=seqs)
            return Choice(ControllerState.TRACKING, knobs, code, _INFEASIBLE, chosen)
        if move.interval_moved:
            self.pacing.note_interval_moved(now_s, move.interval_shortened_for_targets)
        elif (lull := self.pacing.lull(now_s)) or self.pacing.crowded():
            if knobs.decode_interval_ms > 0:
                why = (
                    "no arrivals: pacing would only add waits to the requests still decoding"
                    if lull
                    else "the running batch near the engine's cap: pacing would fill it"
                )
                notes.append(f"decode interval {knobs.decode_interval_ms:g} -> 0 ms ({why})")
                knobs = knobs.with_changes(decode_interval_ms=0.0)
                self.pacing.note_interval_moved(now_s)
                if code is Reason.STEADY:
                    code = Reason.OPTIMIZE
        else:
            paced = self.pacing.step(
                level,
                knobs,
                workload,
                temp,
                outlook,
                budget_w,
                trial_running=self.quant.exploring is not None,
            )
            if paced is not None:
                interval, chosen, why = paced
                notes.append(
                    f"decode interval {knobs.decode_interval_ms:g} -> {interval:g} ms ({why})"
                )
                knobs = knobs.with_changes(decode_interval_ms=interval)
                if code is Reason.STEADY:
                    code = Reason.OPTIMIZE
        reason = "; ".join(notes) if notes else "steady: current configuration within margins"
        return Choice(
            ControllerState.TRACKING, knobs, code, f"{reason} [{chosen.describe()}]", chosen
        )

    # ---- the decision's bookkeeping ----------------------------------------

    def _finish(
        self, choice: Choice, now_s: float, budget_w: float, telemetry: Telemetry | None
    ) -> Decision:
        choice.knobs = self.quant.restore_probe_chunk(choice.knobs)
        self._hold_clock_under_hw_slowdown(choice, telemetry)
        knobs = self.limits.clamp(choice.knobs)
        if not self.device.can_lock_clocks and self.device.can_set_power_limit:
            temp = telemetry.gpu_temp_c if telemetry is not None else None
            knobs = self.power_guard.clock_as_power_limit(choice.knobs, knobs, budget_w, temp)
        previous = self._last.knobs if self._last is not None else None
        changed = knobs.changed_fields(previous) if previous is not None else ()
        if previous is not None and knobs.quant_level != previous.quant_level:
            # Another level: its latencies are not this one's; start the calibration afresh.
            self.learner.forget_latency_calibration()
        self.clock.record_applied(previous, knobs, changed, now_s)
        self.latency_guard.note_applied(previous, knobs, choice.state, now_s)
        if choice.state != self.state:
            key = f"{self.state.value}->{choice.state.value}"
            self.counters.transitions[key] = self.counters.transitions.get(key, 0) + 1
            self.state = choice.state
        self.counters.decisions[choice.code.value] += 1
        for name in changed:
            self.counters.knob_changes[name] = self.counters.knob_changes.get(name, 0) + 1
        self._knobs = knobs
        if choice.state not in (ControllerState.HOLD, ControllerState.FALLBACK):
            self._last_safe = knobs
        self._seq += 1
        decision = Decision(
            at_s=now_s,
            seq=self._seq,
            state=choice.state,
            mode=self._policy.mode,
            knobs=knobs,
            changed=changed,
            apply=self._policy.mode != ControlMode.OBSERVE,
            reason_code=choice.code,
            reason=choice.reason,
            effective_budget_w=budget_w,
            prediction=choice.prediction,
        )
        self._last = decision
        return decision

    def _hold_clock_under_hw_slowdown(self, choice: Choice, telemetry: Telemetry | None) -> None:
        """No decision raises the clock while the hardware slows the GPU down: the latency
        it causes is not the clock's to fix, and a clock raised meanwhile would land all at
        once, with its power, the moment the brake lets go. Lowering stays allowed."""
        if telemetry is None or not telemetry.usable or not telemetry.hw_slowdown:
            return
        held, wanted = self._knobs.sm_clock_mhz, choice.knobs.sm_clock_mhz
        if held is None or wanted is None or wanted <= held:
            return  # no lock in force (the top clock already) or not a raise
        choice.knobs = choice.knobs.with_changes(sm_clock_mhz=held)
        choice.code = Reason.HW_SLOWDOWN_HOLD
        choice.reason += f"; clock held at {held} MHz, not {wanted}: hardware slowdown asserted"
