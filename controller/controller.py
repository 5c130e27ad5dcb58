"""The feedback controller: observe(telemetry, engine stats, now) -> Decision (+ reason).

Pure decision logic over plain values: it learns step-latency and power models from what
it observes, predicts each candidate configuration, picks the cheapest one predicted to
meet the SLOs inside the power budget, and lets feedback guards override the models. It
keeps its own state (named states, explicit transitions, counters) and nothing else: it
must not import torch or the daemon, read a clock, sleep, or touch a device or an engine.
The daemon's control loop (daemon/control_loop.py) feeds it and applies its decisions.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from controller.models import (
    Ewma,
    PowerModel,
    PowerSegment,
    Prediction,
    QuantileRatio,
    StepTimeModel,
    Workload,
    WorkloadEstimator,
    idle_ttft_ms,
    predict,
)
from controller.policy import ControlMode, Knobs, Objective, Policy, allowed_quant_levels
from controller.quant_timescale import QuantTimescale
from controller.signals import (
    DeviceConstraints,
    EngineConstraints,
    EngineStats,
    StepRecord,
    Telemetry,
)
from controller.state import (
    Choice,
    ControllerCounters,
    ControllerParams,
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

# The percentile of measured-over-modelled prefill power the peak prediction uses (a few
# 100 ms readings per second: p90 of the last hundred, not their maximum).
PEAK_PERCENTILE = 90.0


def candidate_clocks(ladder: tuple[int, ...], count: int) -> tuple[int, ...]:
    """About `count` clocks spread evenly over the ladder, both ends included."""
    if len(ladder) <= count:
        return ladder
    step = (len(ladder) - 1) / (count - 1)
    return tuple(sorted({ladder[round(i * step)] for i in range(count)}))


class Controller(QuantTimescale):
    """Decides the knobs from observations, on separate timescales.

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
    TTFT SLO), never above what the budget allows, and holds that floor. Without a
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
        self._clocks = candidate_clocks(device.sm_clock_ladder_mhz, self.params.clock_candidates)
        self._levels = {o.level: o for o in engine.quant_options}
        reference_w = device.power_limit_max_w or policy.power_budget_w
        self._reference_w = reference_w
        self._step_models: dict[str, StepTimeModel] = {}
        # One power model for every level: it is learned all the time, so comparisons
        # between levels never rest on a stale one (levels differ mostly in how long their
        # steps keep the GPU busy, which the step models capture).
        self._power = PowerModel(device.sm_clock_max_mhz, self._reference_w)
        self._ttft_ratio = QuantileRatio(default=1.5)
        self._tpot_ratio = QuantileRatio(default=1.3)
        self._peak_ratio = QuantileRatio(default=1.1, window=100)
        self._workload = WorkloadEstimator()
        self.counters = ControllerCounters()
        self.state = ControllerState.LEARNING
        self._knobs = self._clamp(initial_knobs)
        self._manual_knobs: Knobs | None = None
        self._last_safe = self._knobs
        self._seq = 0
        self._last: Decision | None = None
        # timescale bookkeeping
        self._last_clock_change_s = -math.inf
        self._last_clock_up_s = -math.inf
        # The longest TTFT of the requests that arrived since the clock or the chunk cap
        # last changed (None until one has its first token): a step down of either waits
        # for one within slo_margin.
        self._ttft_since_change_ms: float | None = None
        self._last_shape_change_s = -math.inf
        self._last_batch_s = -math.inf
        self._last_pace_s = -math.inf
        self._last_chunk_change_s = -math.inf
        self._init_quant_state()
        # guards
        self._waiting_hist: deque[int] = deque(maxlen=max(2, self.params.queue_growth_ticks + 1))
        self._last_guard_s = -math.inf
        self._floor_mhz: int | None = None
        self._floor_until_s = -math.inf
        self._ceiling_mhz: int | None = None
        self._ceiling_until_s = -math.inf
        self._power_hold_s = self.params.power_hold_s
        self._last_power_guard_s = -math.inf
        self._stale_since_s: float | None = None
        self._idle_since_s: float | None = None
        self._slowdown_active = False
        # history for the power model
        self._recent_steps: deque[StepRecord] = deque(maxlen=512)
        self._pred_ttft_ms = Ewma(5.0)  # the model's mean predictions in force, smoothed
        self._pred_tpot_ms = Ewma(5.0)
        self._pred_step_ms = Ewma(5.0)  # the unpaced mean step, which sets TPOT's spread
        self._pred_at_s: float | None = None
        self._last_telemetry: Telemetry | None = None
        self._derate = 1.0
        self._now_s = 0.0
        self._feasible_since_s: float | None = None
        self._stuck_since_s: float | None = None
        self._infeasible_since_s: float | None = None
        self._waiting_now = 0  # requests queued at the latest observation
        self._running_now = 0  # and running
        # (time, running) with running decreasing: the most running over the last
        # quant_peak_window_s is the first entry (a monotonic queue).
        self._running_peaks: deque[tuple[float, int]] = deque()

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
        self._manual_knobs = self._clamp(knobs)
        return self._manual_knobs

    def observe(self, telemetry: Telemetry | None, stats: EngineStats, now_s: float) -> Decision:
        """Learn from one observation and decide every knob."""
        self._now_s = now_s
        self._ingest(telemetry, stats, now_s)
        budget_w = self._effective_budget_w(telemetry)
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
            "thermal_derate": round(self._derate, 3),
            "last_decision": last.to_dict() if last else None,
            "counters": self.counters.snapshot(),
            "models": {
                level: {
                    "step_samples": m.samples,
                    "seen_clocks_mhz": m.seen_clocks(self.params.trust_min_samples),
                }
                for level, m in self._step_models.items()
            },
            "power_samples": self._power.samples,
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
            "latency_ratio": {
                "ttft": round(self._ttft_ratio.ratio(self._now_s, self._policy.slo_percentile), 3),
                "tpot": round(self._tpot_ratio.ratio(self._now_s, self._policy.slo_percentile), 3),
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

    def _step_model(self, level: str) -> StepTimeModel:
        model = self._step_models.get(level)
        if model is None:
            model = self._prior_step_model(level)
            self._step_models[level] = model
        return model

    def _prior_step_model(self, level: str) -> StepTimeModel:
        # The most practised other level (by the time a new level's first step arrives,
        # the knobs in force already name the new level).
        others = [m for lv, m in self._step_models.items() if lv != level and m.samples > 0]
        if not others:
            return StepTimeModel(self.device.sm_clock_max_mhz)
        return max(others, key=lambda m: m.samples).as_prior()

    def _ingest(self, telemetry: Telemetry | None, stats: EngineStats, now_s: float) -> None:
        usable = telemetry is not None and telemetry.usable
        clock_now = self._clock_now(telemetry)
        for step in stats.steps:
            clock = step.sm_clock_mhz or clock_now
            if step.duration_s > 0 and clock:
                self._judge_trial_step(step, clock)
                self._step_model(step.quant_level).learn(step, clock)
            self._recent_steps.append(step)
        self._workload.update(
            now_s,
            stats.requests_total,
            stats.prompt_tokens_total,
            stats.generation_tokens_total,
            stats.steps,
            paced=self._knobs.decode_interval_ms > 0,
        )
        # A request's latency spans seconds of operation, so it is compared with the model's
        # recent mean prediction (smoothed over about a request's life), and only while the
        # controller is tracking at one quantization level (not through learning or trials).
        for x in stats.ttft_s:
            if now_s - x >= self._last_shape_change_s:
                self._ttft_since_change_ms = max(self._ttft_since_change_ms or 0.0, x * 1000.0)
        if self._pred_ttft_ms.value is not None and self.state == ControllerState.TRACKING:
            for x in stats.ttft_s:
                self._ttft_ratio.add(now_s, x * 1000.0, self._pred_ttft_ms.value)
            for x in stats.tpot_s:
                # As an excess over the mean in units of the unpaced step (the same ratio
                # when nothing is paced): a paced request's tokens come an interval apart,
                # and only the steps in between (prefill) spread them.
                step_ms = self._pred_step_ms.value or self._pred_tpot_ms.value or 0.0
                excess_ms = x * 1000.0 - (self._pred_tpot_ms.value or 0.0)
                self._tpot_ratio.add(now_s, step_ms + excess_ms, step_ms)
        self._waiting_hist.append(stats.num_waiting)
        self._waiting_now = stats.num_waiting
        self._running_now = stats.num_running
        peaks = self._running_peaks
        while peaks and peaks[-1][1] <= stats.num_running:
            peaks.pop()
        peaks.append((now_s, stats.num_running))
        while peaks and now_s - peaks[0][0] > self.params.quant_peak_window_s:
            peaks.popleft()
        if usable:
            assert telemetry is not None
            slowdown = telemetry.hw_slowdown or telemetry.thermal_throttle
            if slowdown and not self._slowdown_active:
                # The latency seen under a hardware slowdown says little about the clock
                # commanded: trust the models less so they re-learn quickly, and forget
                # the percentile ratios measured before.
                for m in self._step_models.values():
                    m.rls.inflate(10.0)
                self._ttft_ratio.clear()
                self._tpot_ratio.clear()
            self._slowdown_active = slowdown
            self._learn_power(telemetry, clock_now)
            # How far short-window readings with prefill run above the model's prefill
            # phase (prefill chunks differ in intensity): calibrates the peak prediction.
            recent = [s for s in stats.steps if s.has_prefill]
            settled = now_s - self._last_clock_change_s >= 0.5  # the reading is at this clock
            if recent and settled and telemetry.power_w is not None and clock_now:
                model_peak = self._power.predict_w(clock_now, 0.0, 1.0, telemetry.gpu_temp_c)
                self._peak_ratio.add(now_s, telemetry.power_w, model_peak)
            self._last_telemetry = telemetry

    def _clock_now(self, telemetry: Telemetry | None) -> int | None:
        if telemetry is not None and telemetry.sm_clock_mhz:
            return telemetry.sm_clock_mhz
        return self._knobs.sm_clock_mhz or self.device.sm_clock_max_mhz

    def _learn_power(self, telemetry: Telemetry, idle_clock: int | None) -> None:
        if telemetry.power_avg_w is None or idle_clock is None:
            return
        window = telemetry.power_avg_window_s
        end = telemetry.timestamp_s
        start = end - window
        segments: list[PowerSegment] = []
        busy = 0.0
        for step in self._recent_steps:
            s0 = max(step.started_at_s, start)
            s1 = min(step.started_at_s + step.duration_s, end)
            if s1 <= s0:
                continue
            overlap = (s1 - s0) / window
            busy += overlap
            clock = step.sm_clock_mhz or idle_clock
            if step.has_prefill:
                segments.append(PowerSegment(overlap, clock, 0.0, 1.0))
            else:
                segments.append(PowerSegment(overlap, clock, 1.0, 0.0))
        if busy > 1.05:
            return  # overlapping records: not learnable
        idle = max(0.0, 1.0 - busy)
        if idle > 0:
            segments.append(PowerSegment(idle, idle_clock, 0.0, 0.0))
        self._power.learn(segments, telemetry.gpu_temp_c, telemetry.power_avg_w)

    # ---- budget ----------------------------------------

    def _effective_budget_w(self, telemetry: Telemetry | None) -> float:
        p = self.params
        derate = 1.0
        if telemetry is not None and telemetry.thermal_margin_c is not None:
            m = telemetry.thermal_margin_c
            if m <= p.thermal_derate_full_c:
                derate = p.thermal_derate_min
            elif m < p.thermal_derate_start_c:
                frac = (p.thermal_derate_start_c - m) / (
                    p.thermal_derate_start_c - p.thermal_derate_full_c
                )
                derate = 1.0 - frac * (1.0 - p.thermal_derate_min)
        # Smooth: derating follows temperature at once, recovers a little each observation.
        if derate < self._derate:
            self._derate = derate
        else:
            self._derate = min(derate, self._derate + 0.02)
        return self._policy.power_budget_w * self._derate

    def _hw_limit_enforces(self, budget_w: float) -> bool:
        d = self.device
        return d.can_set_power_limit and (
            d.power_limit_min_w is None
            or budget_w * self.params.power_limit_margin >= d.power_limit_min_w
        )

    def _power_limit_for(self, budget_w: float) -> float | None:
        if not self.device.can_set_power_limit:
            return None
        return self._clamp_power(budget_w * self.params.power_limit_margin)

    # ---- the decision ----------------------------------------

    def _choose(
        self, telemetry: Telemetry | None, stats: EngineStats, now_s: float, budget_w: float
    ) -> Choice:
        p = self.params
        policy = self._policy
        current = self._current_knobs(telemetry, stats)
        # 1. Stale or missing telemetry: hold the last safe configuration, then fall back.
        if telemetry is None or not telemetry.usable:
            if self._stale_since_s is None:
                self._stale_since_s = now_s
            stale_for = now_s - self._stale_since_s
            if stale_for < p.stale_hold_s:
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
                f"telemetry stale for {stale_for:.1f} s (> {p.stale_hold_s:g} s): "
                "conservative fallback configuration",
            )
        self._stale_since_s = None
        power_w = telemetry.power_w or 0.0
        power_limit = self._power_limit_for(budget_w)

        # 2. Manual: the operator's knobs, with only the power and thermal guards.
        if policy.mode == ControlMode.MANUAL:
            manual = (self._manual_knobs or current).with_changes(power_limit_w=power_limit)
            guarded = self._power_guard(telemetry, manual, now_s, budget_w, power_w)
            if guarded is not None:
                return guarded
            ceiling = self._active_ceiling(now_s, power_w, budget_w, telemetry.gpu_temp_c)
            if (
                ceiling is not None
                and (manual.sm_clock_mhz or self.device.sm_clock_max_mhz) > ceiling
            ):
                manual = manual.with_changes(sm_clock_mhz=ceiling)
            return Choice(
                ControllerState.MANUAL,
                manual,
                Reason.MANUAL,
                "manual knobs (power and thermal guarded)",
            )

        # 3. Over budget: step down at once, whatever the model says.
        base = current.with_changes(power_limit_w=power_limit)
        guarded = self._power_guard(telemetry, base, now_s, budget_w, power_w)
        if guarded is not None:
            return guarded
        ceiling = self._active_ceiling(now_s, power_w, budget_w, telemetry.gpu_temp_c)

        allowed = self._allowed_levels()
        level = base.quant_level or self.engine.full_precision_level
        if level not in allowed:
            target = self._best_allowed_level(allowed, level)
            return Choice(
                self.state if self.state != ControllerState.IDLE else ControllerState.TRACKING,
                base.with_changes(quant_level=target),
                Reason.QUANT_FORBIDDEN,
                f"quantization level {level} is not allowed by the policy "
                f"(max_ppl_increase_pct {policy.max_ppl_increase_pct}): switching to {target}",
            )

        # A trial whose steps measure much slower than the level before ends at once.
        verdict = self._trial_verdict(base, now_s)
        if verdict is not None:
            return verdict

        # 4. Latency guards: queue growth or a measured SLO miss steps up at once.
        workload = self._workload.current()
        latency = self._latency_guard(telemetry, stats, base, now_s, ceiling, budget_w, workload)
        if latency is not None:
            if (
                self._exploring is not None
                and not self._exploring_stuck
                and not self._trial_vouched()
            ):
                # A calm trial that hurts latency ends at once; a trial begun because the
                # previous level could not cope is not its fault, and goes on, as does one
                # whose steps have vouched for it (then the clock is what the guard raises:
                # steady60's bf16 trial, as fast as fp32's model, ended on a queue at
                # 645 MHz, and fp32 ran 18 s more).
                tried, before = self._exploring
                self._exploring = None
                latency.knobs = latency.knobs.with_changes(quant_level=before)
                latency.reason += f"; trial of {tried} aborted, back to {before}"
                return latency
            # Guards firing count as the level not coping; after quant_stuck_s of that,
            # the quantization step may escape to a level with more headroom.
            if self._stuck_since_s is None:
                self._stuck_since_s = now_s
            elif now_s - self._stuck_since_s >= p.quant_stuck_s:
                escape = self._quant_step(
                    base, allowed, workload, telemetry.gpu_temp_c, now_s, budget_w, ceiling
                )
                if escape is not None:
                    return escape
            return latency

        step_model = self._step_model(level)
        power_model = self._power

        # 5. Idle: the lowest clock whose TTFT for the next arrival meets the SLO.
        idle_now = stats.num_running == 0 and stats.num_waiting == 0 and not stats.steps
        if not idle_now:
            self._idle_since_s = None
        elif self._idle_since_s is None:
            self._idle_since_s = now_s
        if idle_now and now_s - self._idle_since_s >= p.idle_after_s:
            return self._idle_choice(base, step_model, workload, ceiling)

        # 6. Learning: too little data to trust the models; the highest clock the budget allows.
        learning = (
            step_model.samples < p.learning_min_steps
            or power_model.samples < p.learning_min_power_samples
        )
        if learning:
            top = ceiling if ceiling is not None else self.device.sm_clock_max_mhz
            # The first level learns at the top clock (nothing is known yet); a level tried
            # later learns where the controller already runs: its model starts from the
            # other level's clock sensitivity, and the guards stay armed.
            trained = any(
                m.samples >= p.learning_min_steps
                for lv, m in self._step_models.items()
                if lv != level
            )
            if trained and power_model.samples >= p.learning_min_power_samples:
                top = min(top, base.sm_clock_mhz or top)
            knobs = base.with_changes(sm_clock_mhz=top, decode_interval_ms=0.0)
            return Choice(
                ControllerState.LEARNING,
                knobs,
                Reason.LEARNING,
                f"learning {level}: {step_model.samples}/{p.learning_min_steps} steps, "
                f"{power_model.samples}/{p.learning_min_power_samples} power samples; "
                f"clock {top} MHz",
            )

        # 7. Tracking: least predicted J/token meeting the SLOs, on three timescales.
        return self._track(base, allowed, workload, telemetry, now_s, budget_w, ceiling)

    def _current_knobs(self, telemetry: Telemetry | None, stats: EngineStats) -> Knobs:
        if self._policy.mode != ControlMode.OBSERVE:
            k = self._knobs
            if stats.quant_level and k.quant_level is None:
                k = k.with_changes(quant_level=stats.quant_level)
            return k
        # Observe mode applies nothing, so advice starts from what is in force.
        clock = telemetry.sm_clock_mhz if telemetry is not None else None
        return self._clamp(
            self._knobs.with_changes(
                quant_level=stats.quant_level or self._knobs.quant_level,
                sm_clock_mhz=self._knobs.sm_clock_mhz if clock is None else self._snap(clock),
            )
        )

    # ---- guards ----------------------------------------

    def _power_guard(
        self, telemetry: Telemetry, knobs: Knobs, now_s: float, budget_w: float, power_w: float
    ) -> Choice | None:
        # One noisy short-window reading just over is not a violation; a sustained one, or
        # one clearly over, is.
        avg = telemetry.power_avg_w if telemetry.power_avg_w is not None else power_w
        tolerance = 1.0 + self.params.power_noise_tolerance
        if power_w <= budget_w * tolerance and not (power_w > budget_w and avg > budget_w):
            return None
        p = self.params
        actual = telemetry.sm_clock_mhz or knobs.sm_clock_mhz or self.device.sm_clock_max_mhz
        model = self._power
        one_down = self._move(self._snap(actual), -1)
        target = None
        if model.samples >= p.learning_min_power_samples:
            prefill = any(s.has_prefill for s in list(self._recent_steps)[-20:])
            for f in reversed(self._clocks):
                if f > one_down:
                    continue
                peak = model.predict_w(
                    f, 0.0 if prefill else 1.0, 1.0 if prefill else 0.0, telemetry.gpu_temp_c
                )
                if peak <= budget_w * p.power_margin:
                    target = f
                    break
        if target is None:
            # No trusted model: cut the clock in proportion (dynamic power ~ f^2 or more).
            scaled = actual * math.sqrt(budget_w / power_w) * p.power_margin
            target = min(self._snap(scaled), one_down)
        target = max(target, self.device.sm_clock_min_mhz)
        # A guard that fires again soon after its ceiling was released holds twice as long
        # (up to power_hold_max_s): the release was too early, and must not become a limit
        # cycle.
        if now_s - self._last_power_guard_s < 2 * self._power_hold_s:
            self._power_hold_s = min(self._power_hold_s * 2, p.power_hold_max_s)
        else:
            self._power_hold_s = p.power_hold_s
        self._last_power_guard_s = now_s
        self._ceiling_mhz = target
        self._ceiling_until_s = now_s + self._power_hold_s
        self._floor_mhz = None  # power wins over latency
        return Choice(
            ControllerState.GUARD_POWER,
            knobs.with_changes(sm_clock_mhz=target),
            Reason.OVER_BUDGET,
            f"power {power_w:.0f} W over the budget {budget_w:.0f} W"
            + (f" (derated x{self._derate:.2f})" if self._derate < 1 else "")
            + f": clock {actual} -> {target} MHz, held for {self._power_hold_s:g} s",
        )

    def _active_ceiling(
        self, now_s: float, power_w: float, budget_w: float, temp_c: float | None = None
    ) -> int | None:
        """The power guard's clock ceiling (anti-windup: nothing raises the clock above it).
        Past the hold, with power below the release margin, it rises by one candidate, or at
        once to the highest clock the power model predicts safe when that is higher."""
        if self._ceiling_mhz is None:
            return None
        p = self.params
        if now_s >= self._ceiling_until_s and power_w < budget_w * p.power_release_margin:
            raised = max(self._move(self._ceiling_mhz, +1), self._safe_clock(budget_w, temp_c))
            if raised >= self.device.sm_clock_max_mhz:
                self._ceiling_mhz = None
                return None
            self._ceiling_mhz = raised
            self._ceiling_until_s = now_s + p.clock_min_interval_s
        return self._ceiling_mhz

    def _safe_clock(self, budget_w: float, temp_c: float | None) -> int:
        """The highest candidate clock whose predicted power in the hungriest phase seen
        lately (x the measured peak ratio) fits the budget; the top clock where the board
        power limit enforces the budget."""
        p = self.params
        model = self._power
        if self._hw_limit_enforces(budget_w):
            return self.device.sm_clock_max_mhz  # the board limit holds the budget
        if model.samples < p.learning_min_power_samples:
            return self.device.sm_clock_min_mhz
        recent = list(self._recent_steps)[-50:]
        prefill = any(s.has_prefill for s in recent)
        busy = 1.0 if recent else 0.0
        peak_ratio = self._peak_ratio.ratio(self._now_s, PEAK_PERCENTILE)
        for f in reversed(self._clocks):
            watts = peak_ratio * model.predict_w(
                f, 0.0 if prefill else busy, busy if prefill else 0.0, temp_c
            )
            if watts <= budget_w * p.power_margin:
                return f
        return self.device.sm_clock_min_mhz

    def _latency_guard(
        self,
        telemetry: Telemetry,
        stats: EngineStats,
        knobs: Knobs,
        now_s: float,
        ceiling: int | None,
        budget_w: float,
        workload: Workload,
    ) -> Choice | None:
        p = self.params
        policy = self._policy
        hist = list(self._waiting_hist)
        k = p.queue_growth_ticks
        growing = (
            stats.num_waiting > 0
            and len(hist) > p.queue_growth_ticks
            and all(b > a for a, b in zip(hist[-k - 1 : -1], hist[-k:], strict=True))
        )
        long_wait = (
            stats.oldest_waiting_s is not None
            and stats.oldest_waiting_s * 1000.0 > 0.5 * policy.ttft_slo_ms
        )
        ttft_miss = [x for x in stats.ttft_s if x * 1000.0 > policy.ttft_slo_ms]
        tpot_miss = [x for x in stats.tpot_s if x * 1000.0 > policy.tpot_slo_ms]
        clock = knobs.sm_clock_mhz or self.device.sm_clock_max_mhz
        # Feed-forward on the queue: the prompts waiting now, prefilled in chunks beside
        # the running batch at this clock, would bring the newest past slo_margin x its
        # TTFT SLO (the oldest has already waited): step up before anyone misses.
        level = knobs.quant_level or self.engine.full_precision_level
        late_s = p.slo_margin * policy.ttft_slo_ms / 1000.0
        drain_s = self._drain_s(level, clock, stats, knobs, workload)
        queue_late = drain_s is not None and drain_s > late_s
        if not (growing or long_wait or queue_late or ttft_miss or tpot_miss):
            return None
        if now_s - self._last_guard_s < p.guard_cooldown_s:
            # Still within the cooldown of the last step up: keep its floor, no new step.
            return None
        top = ceiling if ceiling is not None else self.device.sm_clock_max_mhz
        # The budget wins over latency: never above what the power model says fits it.
        top = min(top, max(self._safe_clock(budget_w, telemetry.gpu_temp_c), self._snap(clock)))
        # A request already waiting half its TTFT SLO cannot wait for a staircase: jump to
        # the top; otherwise step up by guard_clock_steps candidates, or (a late queue) to
        # the lowest clock predicted to drain it in time.
        step = len(self._clocks) if long_wait else p.guard_clock_steps
        target = min(self._move(self._snap(clock), step), top)
        if queue_late and not long_wait:
            drain_at = top
            for f in self._clocks:
                if f <= clock or f > top:
                    continue
                d = self._drain_s(level, f, stats, knobs, workload)
                if d is not None and d <= late_s:
                    drain_at = f
                    break
            if not (growing or ttft_miss or tpot_miss):
                target = min(self._move(self._snap(clock), 1), top)
            target = max(target, drain_at)
        seqs = knobs.max_num_seqs
        if (growing or long_wait) and stats.num_running >= knobs.max_num_seqs and not tpot_miss:
            seqs = min(self.engine.max_num_seqs_max, max(seqs + 1, math.ceil(seqs * 1.5)))
        tokens = knobs.max_num_batched_tokens
        if (
            target > clock
            and self._step_model(level).samples >= p.learning_min_steps
            and self._hw_limit_enforces(budget_w)
        ):
            # A faster clock takes a bigger chunk within the same step time (never smaller
            # here: the next batch-cap update may shrink it once the guard has let go).
            # Not where only the clock holds the budget: a bigger chunk draws more.
            bigger = self._chunk_cap(
                level, target, max(1, stats.num_running), workload.mean_context_tokens
            )
            tokens = max(tokens, bigger)
        # Decode pacing trades TPOT headroom for energy: a TPOT miss or a long wait leaves
        # none to trade, at the top clock too. (A queue alone leaves it: the engine does not
        # pace while requests wait.)
        pace_off = knobs.decode_interval_ms > 0 and bool(tpot_miss or long_wait)
        unchanged = (target, seqs, tokens) == (
            clock,
            knobs.max_num_seqs,
            knobs.max_num_batched_tokens,
        )
        if unchanged and not pace_off:
            return None  # nothing left to raise: let the optimizer keep its choice
        self._last_guard_s = now_s
        self._floor_mhz = target
        self._floor_until_s = now_s + p.guard_hold_s
        if growing or long_wait or queue_late:
            code = Reason.QUEUE_GROWTH
            if growing:
                what = f"waiting queue growing ({'→'.join(map(str, hist[-k - 1 :]))})"
            elif long_wait:
                what = f"oldest request waiting {stats.oldest_waiting_s:.2f} s"
            else:
                what = (
                    f"{stats.num_waiting} waiting would see their first token in "
                    f"{1000.0 * (drain_s or 0.0):.0f} ms at {clock} MHz"
                )
        else:
            code = Reason.SLO_MISS
            parts = []
            if ttft_miss:
                parts.append(f"TTFT {max(ttft_miss) * 1000:.0f} ms > {policy.ttft_slo_ms:g} ms")
            if tpot_miss:
                parts.append(f"TPOT {max(tpot_miss) * 1000:.0f} ms > {policy.tpot_slo_ms:g} ms")
            what = "measured " + ", ".join(parts)
        return Choice(
            ControllerState.GUARD_LATENCY,
            knobs.with_changes(
                sm_clock_mhz=target,
                max_num_seqs=seqs,
                max_num_batched_tokens=tokens,
                decode_interval_ms=0.0 if pace_off else knobs.decode_interval_ms,
            ),
            code,
            f"{what}: "
            + (f"clock {clock} -> {target} MHz" if target != clock else f"clock {clock} MHz")
            + (
                f", max_num_seqs {knobs.max_num_seqs} -> {seqs}"
                if seqs != knobs.max_num_seqs
                else ""
            )
            + (
                f", max_num_batched_tokens {knobs.max_num_batched_tokens} -> {tokens}"
                if tokens != knobs.max_num_batched_tokens
                else ""
            )
            + f"; floor held {p.guard_hold_s:g} s"
            + ("; decode pacing off" if pace_off else ""),
        )

    # ---- idle and fallback ----------------------------------------

    def _idle_choice(
        self, knobs: Knobs, model: StepTimeModel, workload: Workload, ceiling: int | None
    ) -> Choice:
        p = self.params
        slo = self._policy.ttft_slo_ms * p.slo_margin
        ratio = self._ttft_ratio.ratio(self._now_s, self._policy.slo_percentile)
        top = ceiling if ceiling is not None else self.device.sm_clock_max_mhz
        chosen = None
        if model.samples >= p.learning_min_steps:
            level = knobs.quant_level or self.engine.full_precision_level
            for f in self._clock_range(level, self._now_s, ceiling):
                if f > top:
                    break
                ttft = idle_ttft_ms(
                    model, f, workload.mean_prompt_tokens, knobs.max_num_batched_tokens
                )
                if ttft * ratio <= slo:
                    chosen = (f, ttft * ratio)
                    break
        if chosen is None:
            f = knobs.sm_clock_mhz or top
            return Choice(
                ControllerState.IDLE,
                knobs,
                Reason.IDLE,
                "idle: no trusted latency model yet, keeping the clock",
            )
        f, ttft = chosen
        return Choice(
            ControllerState.IDLE,
            knobs.with_changes(sm_clock_mhz=f),
            Reason.IDLE,
            f"idle: lowest clock meeting the TTFT SLO for the next arrival: {f} MHz "
            f"(predicted {ttft:.0f} ms for a {workload.mean_prompt_tokens:.0f}-token prompt)",
        )

    def _fallback_knobs(self, current: Knobs, budget_w: float) -> Knobs:
        p = self.params
        ladder = self.device.sm_clock_ladder_mhz
        clock = p.fallback_sm_clock_mhz or ladder[len(ladder) // 2]
        seqs = p.fallback_max_num_seqs or max(1, self.engine.max_num_seqs_max // 2)
        return current.with_changes(
            sm_clock_mhz=clock,
            max_num_seqs=min(seqs, current.max_num_seqs),
            power_limit_w=self._power_limit_for(budget_w),
            decode_interval_ms=0.0,
        )

    # ---- tracking ----------------------------------------

    def _feasible(self, pr: Prediction, budget_w: float, tighten: float = 1.0) -> bool:
        """Predicted to meet both SLOs (x slo_margin x tighten) and the budget."""
        p = self.params
        policy = self._policy
        if not pr.stable:
            return False
        margin = p.slo_margin * tighten
        if pr.ttft_ms > policy.ttft_slo_ms * margin or pr.tpot_ms > policy.tpot_slo_ms * margin:
            return False
        return self._within_budget(pr, budget_w)

    def _within_budget(self, pr: Prediction, budget_w: float) -> bool:
        """Where the board power limit enforces the budget, always; elsewhere the predicted
        1 s mean and the hungriest phase (a prefill step, 100 ms windows, scaled by the
        measured peak ratio) must fit power_margin x budget."""
        if (
            self._hw_limit_enforces(budget_w)
            and self._now_s - self._last_power_guard_s >= self.params.power_hold_max_s
        ):
            # The board limit (set at the budget) holds it, at 100 ms; unless the power
            # guard has had to act within power_hold_max_s: then the limit did not hold
            # (or not in time), and a clock predicted over the budget would only be
            # knocked down again.
            return True
        limit = budget_w * self.params.power_margin
        if pr.power_w > limit:
            return False
        return pr.peak_power_w * self._peak_ratio.ratio(self._now_s, PEAK_PERCENTILE) <= limit

    @property
    def _running_peak(self) -> int:
        """The most requests running at once over the last quant_peak_window_s."""
        return self._running_peaks[0][1] if self._running_peaks else self._running_now

    def _drain_s(
        self, level: str, clock: int, stats: EngineStats, knobs: Knobs, workload: Workload
    ) -> float | None:
        """When the newest waiting request would see its first token at this clock: the
        oldest's wait so far plus the prefill of every waiting prompt (the mean prompt
        each), in chunks of what the token cap leaves beside the running batch, stretched
        by the prompts still arriving meanwhile (1 / (1 - share of the time their prefill
        takes); inf when that share reaches 1). None without a queue or a trained model."""
        model = self._step_models.get(level)
        if stats.num_waiting <= 0 or model is None:
            return None
        if model.samples < self.params.learning_min_steps:
            return None
        ctx = workload.mean_context_tokens
        co = model.coefficients(clock, ctx)
        running = stats.num_running
        room = max(knobs.max_num_batched_tokens - running, self.engine.max_num_batched_tokens_min)
        queued = stats.num_waiting * workload.mean_prompt_tokens
        chunk_s = co.step_s(room, running, running * ctx)
        full, rest = divmod(queued, room)
        total = full * chunk_s
        if rest > 0:
            total += co.step_s(rest, running, running * ctx)
        arriving = workload.prompt_tokens_per_s * chunk_s / room
        if arriving >= 1.0:
            return math.inf
        return (stats.oldest_waiting_s or 0.0) + total / (1.0 - arriving)

    def _batch_trusted(self, pr: Prediction, batch: int | None = None) -> bool:
        """A level's prediction rests on steps of about that decode batch: no more than
        batch_trust_factor x the largest batch its model has been fitted around (levels
        tried briefly at a calm moment know little of a burst's batches). The batch is
        at least `batch` (default: the one running now): a model that underestimates a
        level's step also predicts it a small batch, and would vouch for itself."""
        need = max(pr.decode_batch, self._running_now if batch is None else batch)
        return need <= self._trusted_batch(pr.quant_level)

    def _trusted_batch(self, level: str) -> float:
        """The largest decode batch a level's model is trusted at (0 without a model)."""
        p = self.params
        model = self._step_models.get(level)
        if model is None:
            return 0.0
        seen = model.batch_seen(p.trust_min_samples)
        return max(p.batch_trust_min, p.batch_trust_factor * seen)

    def _score(self, pr: Prediction) -> float:
        if self._policy.objective == Objective.MIN_LATENCY:
            return pr.tpot_ms / self._policy.tpot_slo_ms + pr.ttft_ms / self._policy.ttft_slo_ms
        return pr.j_per_token

    def _predict(
        self,
        level: str,
        clock: int,
        seqs: int,
        tokens: int,
        workload: Workload,
        temp_c: float | None,
        interval_ms: float | None = None,
    ) -> Prediction:
        """interval_ms: the decode pacing interval (None: the one in force)."""
        if interval_ms is None:
            interval_ms = self._knobs.decode_interval_ms
        return predict(
            level=level,
            clock_mhz=clock,
            max_num_seqs=seqs,
            max_num_batched_tokens=tokens,
            workload=workload,
            step_model=self._step_model(level),
            power_model=self._power,
            temp_c=temp_c,
            ttft_ratio=self._ttft_ratio.ratio(self._now_s, self._policy.slo_percentile),
            tpot_ratio=self._tpot_ratio.ratio(self._now_s, self._policy.slo_percentile),
            decode_interval_s=interval_ms / 1000.0,
        )

    def _clock_range(self, level: str, now_s: float, ceiling: int | None) -> list[int]:
        """Candidate clocks: below the power ceiling, above the latency floor, and no more
        than trust_clock_steps candidates beyond the clocks this level has been seen at."""
        p = self.params
        top = ceiling if ceiling is not None else self.device.sm_clock_max_mhz
        floor = (
            self._floor_mhz
            if (self._floor_mhz is not None and now_s < self._floor_until_s)
            else None
        )
        seen = self._step_model(level).seen_clocks(p.trust_min_samples)
        if seen:
            lo = self._move(self._snap(min(seen)), -p.trust_clock_steps)
            hi = self._move(self._snap(max(seen)), +p.trust_clock_steps)
        else:
            lo, hi = self.device.sm_clock_max_mhz, self.device.sm_clock_max_mhz
        out = [f for f in self._clocks if lo <= f <= min(hi, top) and (floor is None or f >= floor)]
        if not out:
            out = [min(max(floor or top, self.device.sm_clock_min_mhz), top)]
        return out

    def _track(
        self,
        base: Knobs,
        allowed: tuple[str, ...],
        workload: Workload,
        telemetry: Telemetry,
        now_s: float,
        budget_w: float,
        ceiling: int | None,
    ) -> Choice:
        p = self.params
        temp = telemetry.gpu_temp_c
        level = base.quant_level or self.engine.full_precision_level
        clock_now = base.sm_clock_mhz or self.device.sm_clock_max_mhz
        knobs = base
        code, notes = Reason.STEADY, []

        # Slowest timescale: the quantization level.
        switched = self._quant_step(base, allowed, workload, temp, now_s, budget_w, ceiling)
        if switched is not None:
            return switched

        # Batch caps, every batch_period_s.
        if now_s - self._last_batch_s >= p.batch_period_s:
            self._last_batch_s = now_s
            seqs, tokens = self._choose_caps(level, clock_now, workload, knobs, now_s, budget_w)
            if (seqs, tokens) != (knobs.max_num_seqs, knobs.max_num_batched_tokens):
                notes.append(
                    f"caps {knobs.max_num_seqs}/{knobs.max_num_batched_tokens} -> {seqs}/{tokens}"
                )
                knobs = knobs.with_changes(max_num_seqs=seqs, max_num_batched_tokens=tokens)
                code = Reason.OPTIMIZE

        # Fastest timescale: the clock.
        clocks = self._clock_range(level, now_s, ceiling)

        interval_now = knobs.decode_interval_ms

        def at(f: int, interval: float) -> Prediction:
            return self._predict(
                level,
                f,
                knobs.max_num_seqs,
                knobs.max_num_batched_tokens,
                workload,
                temp,
                interval,
            )

        # With the decode pacing interval in force or a shorter one (a longer one is the
        # pacing step's, below): the two trade TPOT against each other, and a clock-only
        # search went to the top clock to keep a long interval's TPOT. (interval, prediction)
        intervals = [interval_now] + [i for i in self._pace_candidates() if i < interval_now]
        cands = [(i, at(f, i)) for i in intervals for f in clocks]
        now_pred = at(clock_now, interval_now)
        dt = now_s - self._pred_at_s if self._pred_at_s is not None else 0.0
        self._pred_at_s = now_s
        if math.isfinite(now_pred.mean_ttft_ms) and math.isfinite(now_pred.mean_tpot_ms):
            self._pred_ttft_ms.add(now_pred.mean_ttft_ms, dt)
            self._pred_tpot_ms.add(now_pred.mean_tpot_ms, dt)
            self._pred_step_ms.add(1000.0 * now_pred.step_s, dt)
        # Hysteresis band: a lower clock must meet the SLOs with a tighter margin than the
        # one that keeps the current clock, so noise near the edge cannot flip between them.
        feasible = [
            (i, pr)
            for i, pr in cands
            if self._feasible(
                pr, budget_w, p.descend_margin if pr.sm_clock_mhz < clock_now else 1.0
            )
        ]
        if feasible:
            target_interval, best = min(
                feasible, key=lambda c: (self._score(c[1]), -c[1].sm_clock_mhz, -c[0])
            )
            state = ControllerState.TRACKING
        else:
            # Nothing meets everything: no pacing (no TPOT headroom to trade), inside the
            # power budget, then the most headroom.
            unpaced = [c for c in cands if c[0] == 0.0]
            in_budget = [c for c in unpaced if self._within_budget(c[1], budget_w)]
            if not in_budget:
                # The budget wins over model trust: look below the trusted clocks too.
                lower = [
                    (interval_now, at(f, interval_now))
                    for f in self._clocks
                    if f < clocks[0] and (ceiling is None or f <= ceiling)
                ]
                in_budget = [c for c in lower if self._within_budget(c[1], budget_w)]
                in_budget = in_budget or (lower[:1] if lower else unpaced[:1])
            target_interval, best = max(in_budget, key=lambda c: c[1].sm_clock_mhz)
            state = ControllerState.TRACKING
            code = Reason.INFEASIBLE
            notes.append("no candidate predicted to meet every target: most headroom within budget")
        target = best.sm_clock_mhz
        now_ok = clock_now in clocks and self._feasible(now_pred, budget_w)
        gain = 0.0
        if (
            math.isfinite(now_pred.j_per_token)
            and math.isfinite(best.j_per_token)
            and now_pred.j_per_token > 0
        ):
            gain = 100.0 * (1.0 - best.j_per_token / now_pred.j_per_token)
        may_change = now_s - self._last_clock_change_s >= p.clock_min_interval_s
        # Fast up, slow down: after any move up, no move down for descend_hold_s, and none
        # while requests queue (the model's steady state is not what they see). While the
        # level's model is young (under descend_evidence_steps steps), a step below every
        # clock it has been seen at waits for a request that arrived at the clock in force
        # to see its first token within slo_margin x the TTFT SLO: there the clock
        # sensitivity is extrapolated from a few prefill steps (on the real engine, 8 s in,
        # it called 795 MHz safe at 645 ms TTFT; the next request took 2.1 s).
        model = self._step_model(level)
        young = model.samples < p.descend_evidence_steps
        unseen_below = target < min(
            model.seen_clocks(p.trust_min_samples), default=self.device.sm_clock_max_mhz
        )
        may_descend = (
            may_change
            and now_s - self._last_clock_up_s >= p.descend_hold_s
            and self._waiting_now == 0
            and (self._ttft_seen() or not (young and unseen_below))
        )
        if now_ok:
            self._infeasible_since_s = None
        if feasible and now_ok:
            move = (may_descend if target < clock_now else may_change) and (
                gain >= p.clock_gain_min_pct
            )
            why = f"{gain:.1f}% less J/token"
        elif feasible:
            # The current clock is predicted to miss: move once that prediction has held
            # for clock_min_interval_s (one noisy estimate is not a miss; a real one is
            # the guards' to catch at once), or at once when it is over the budget.
            if self._infeasible_since_s is None:
                self._infeasible_since_s = now_s
            held = now_s - self._infeasible_since_s >= p.clock_min_interval_s
            move = held or not self._within_budget(now_pred, budget_w)
            why = "restore feasibility"
        else:
            # Nothing is predicted to meet everything: move towards the most headroom at
            # once when that is up, otherwise no faster than the clock timescale.
            # ... but at once, down too, when the current clock is predicted over budget.
            over = not self._within_budget(now_pred, budget_w)
            move = target > clock_now or may_descend or (over and target < clock_now)
            why = "most headroom within the budget"
        self._feasible_since_s = (
            (self._feasible_since_s or now_s) if feasible and (now_ok or move) else None
        )
        # Pacing goes off at once when nothing meets the targets (no TPOT headroom to trade).
        interval_move = target_interval != interval_now and (move or not feasible)
        if interval_move:
            notes.append(f"decode interval {interval_now:g} -> {target_interval:g} ms ({why})")
            knobs = knobs.with_changes(decode_interval_ms=target_interval)
            self._last_pace_s = now_s
            if code is Reason.STEADY:
                code = Reason.OPTIMIZE
            chosen = best
        if target != clock_now and move:
            notes.append(f"clock {clock_now} -> {target} MHz ({why})")
            knobs = knobs.with_changes(sm_clock_mhz=target)
            if target > clock_now and self._hw_limit_enforces(budget_w):
                # A faster clock takes a bigger prefill chunk at once (a smaller one waits
                # for the batch-cap timescale; and not where only the clock holds the
                # budget: a bigger chunk draws more power).
                bigger = self._chunk_cap(
                    level,
                    target,
                    max(1, min(knobs.max_num_seqs, math.ceil(best.decode_batch))),
                    workload.mean_context_tokens,
                )
                if bigger > knobs.max_num_batched_tokens:
                    notes.append(
                        f"max_num_batched_tokens {knobs.max_num_batched_tokens} -> {bigger}"
                    )
                    knobs = knobs.with_changes(max_num_batched_tokens=bigger)
            if code is Reason.STEADY:
                code = Reason.OPTIMIZE
            chosen = best
        elif not interval_move:
            chosen = now_pred
        paced = (
            None
            if interval_move
            else self._pace_step(level, knobs, workload, temp, now_s, budget_w)
        )
        if paced is not None:
            interval, paced_pred, why = paced
            notes.append(f"decode interval {knobs.decode_interval_ms:g} -> {interval:g} ms ({why})")
            knobs = knobs.with_changes(decode_interval_ms=interval)
            chosen = paced_pred
            if code is Reason.STEADY:
                code = Reason.OPTIMIZE
        reason = "; ".join(notes) if notes else "steady: current configuration within margins"
        return Choice(state, knobs, code, f"{reason} [{chosen.describe()}]", chosen)

    def _pace_candidates(self) -> list[float]:
        """Decode intervals to consider (ms): off, and pace_fractions of the TPOT SLO within
        the engine's longest."""
        slo = self._policy.tpot_slo_ms
        top_ms = self.engine.decode_interval_max_ms
        fractions = self.params.pace_fractions
        return [0.0, *(float(round(f * slo)) for f in fractions if f * slo <= top_ms)]

    def _pace_step(
        self,
        level: str,
        knobs: Knobs,
        workload: Workload,
        temp: float | None,
        now_s: float,
        budget_w: float,
    ) -> tuple[float, Prediction, str] | None:
        """A longer decode pacing interval, at most every pace_period_s, at the clock just
        chosen: the candidate (a fraction of the TPOT SLO) with the least predicted J/token
        that meets the targets with the descend margin, for the clock gain, with no queue
        and no recent guard; one candidate at a time beyond the decode batches the level's
        model is trusted at. (Shorter intervals are the clock search's: _track weighs them
        with the clocks.) Off for the min-latency objective and engines that do not pace.
        Returns (interval ms, its prediction, why), or None to keep the interval."""
        p = self.params
        current = knobs.decode_interval_ms
        if (
            self.engine.decode_interval_max_ms <= 0
            or self._policy.objective == Objective.MIN_LATENCY
        ):
            return None
        if now_s - self._last_pace_s < p.pace_period_s or self._exploring is not None:
            return None
        if self._step_model(level).samples < p.descend_evidence_steps:
            return None  # a young model: its paced predictions rest on batches not seen
        if self._waiting_now > 0 or now_s - self._last_guard_s < p.guard_hold_s:
            return None
        self._last_pace_s = now_s
        clock = knobs.sm_clock_mhz or self.device.sm_clock_max_mhz

        def at(interval: float) -> Prediction:
            return self._predict(
                level,
                clock,
                knobs.max_num_seqs,
                knobs.max_num_batched_tokens,
                workload,
                temp,
                interval,
            )

        now_pred = at(current)
        if not self._feasible(now_pred, budget_w):
            return None
        longer = {i: at(i) for i in self._pace_candidates() if i > current}
        ok = [i for i, pr in longer.items() if self._feasible(pr, budget_w, p.descend_margin)]
        if not ok:
            return None
        best = min(ok, key=lambda i: (self._score(longer[i]), i))
        cur_j, best_j = now_pred.j_per_token, longer[best].j_per_token
        if not (math.isfinite(cur_j) and math.isfinite(best_j) and cur_j > 0):
            return None
        gain = 100.0 * (1.0 - best_j / cur_j)
        if gain < p.clock_gain_min_pct:
            return None
        if not self._batch_trusted(longer[best]):
            # Beyond the decode batches the model has seen: one candidate at a time, so
            # the steps of each teach it before the next.
            best = min(ok)
        return best, longer[best], f"{gain:.1f}% less J/token"

    def _choose_caps(
        self,
        level: str,
        clock: int,
        workload: Workload,
        knobs: Knobs,
        now_s: float,
        budget_w: float,
    ) -> tuple[int, int]:
        """max_num_seqs: the most sequences whose decode step still meets the TPOT SLO by
        the model's mean at the top clock (so a burst queues instead of slowing everyone
        past it), never below a decode batch recent steps ran within the SLO, nor below
        twice the batch the load needs. max_num_batched_tokens: the chunk cap at the clock
        in force (_chunk_cap; a step once started runs at the clock it started at, and no
        decision comes while it runs). Neither shrinks while a queue
        is served or a guard holds, nor the batch cap when no candidate meets the targets;
        the chunk does not grow where only the clock holds the budget (a bigger chunk draws
        more power at the same clock)."""
        p = self.params
        e = self.engine
        # At the top clock: a guard can raise the clock to serve a burst, so the caps must
        # not shrink just because the optimizer (or the budget) holds a low clock now.
        ctx = workload.mean_context_tokens
        co = self._step_model(level).coefficients(self.device.sm_clock_max_mhz, ctx)
        slo_s = self._policy.tpot_slo_ms / 1000.0
        seqs = 1
        for n in range(1, e.max_num_seqs_max + 1):
            if co.step_s(0, n, n * ctx) > slo_s:
                break
            seqs = n
        # Measured steps overrule the model: a decode batch this level has run within the
        # TPOT SLO (at the clock it ran, so no faster than at the top clock) is within it.
        ran = [
            st.decode_tokens
            for st in self._recent_steps
            if st.quant_level == level and st.duration_s <= slo_s
        ]
        seqs = max(seqs, max(ran, default=1))
        # Never below twice the batch the load needs at the clock in force (a cap under it
        # queues requests for nothing).
        here = self._predict(
            level, clock, e.max_num_seqs_max, knobs.max_num_batched_tokens, workload, None
        )
        batch = here.decode_batch if here.stable else e.max_num_seqs_max
        seqs = min(e.max_num_seqs_max, max(seqs, math.ceil(2 * batch), 1))
        if abs(seqs - knobs.max_num_seqs) < max(2, 0.25 * knobs.max_num_seqs):
            seqs = knobs.max_num_seqs  # small changes are not worth a knob change
        # No candidate meets the targets: the engine needs all the capacity it has, and a
        # smaller batch cap only moves the wait into the queue. (The chunk still follows the
        # clock: at a low clock held for the budget a full chunk is a multi-second step.)
        infeasible = self._infeasible_since_s is not None
        if seqs < knobs.max_num_seqs and (
            self._waiting_now > 0 or now_s - self._last_guard_s < p.guard_hold_s or infeasible
        ):
            seqs = knobs.max_num_seqs  # no smaller batch while a queue is being served
        tokens = self._chunk_cap(
            level, clock, min(seqs, max(1, math.ceil(batch))), ctx, knobs.max_num_batched_tokens
        )
        tokens = self._chunk_for_ttft(
            level, clock, seqs, tokens, knobs.max_num_batched_tokens, workload
        )
        if seqs < knobs.max_num_seqs and not self._feasible(
            self._predict(level, clock, seqs, tokens, workload, None), budget_w
        ):
            seqs = knobs.max_num_seqs  # a smaller batch cap must be predicted to meet targets
        if tokens < knobs.max_num_batched_tokens:
            if now_s - self._last_guard_s < p.guard_hold_s or not self._ttft_seen():
                tokens = knobs.max_num_batched_tokens  # not while a guard holds, nor unproven
            else:
                # One halving at a time: the model's prefill costs rest on the chunks it has
                # seen (at the start, 512-token ones only; it called 64 safe at 1.35 s TTFT on
                # the real engine, and the next prompt took 2.7 s).
                tokens = max(tokens, knobs.max_num_batched_tokens // 2)
        if tokens > knobs.max_num_batched_tokens and not self._hw_limit_enforces(budget_w):
            tokens = knobs.max_num_batched_tokens
        if self._probe_chunk_from is not None:
            tokens = knobs.max_num_batched_tokens  # a trial's probe holds its small chunk
        if tokens != knobs.max_num_batched_tokens:
            # The bound moves with the estimated decode batch, whose noise must not flip
            # the chunk every period: one change per chunk_period_s (a clock raise or a
            # guard takes the bigger chunk at once, elsewhere).
            if now_s - self._last_chunk_change_s < p.chunk_period_s:
                tokens = knobs.max_num_batched_tokens
            else:
                self._last_chunk_change_s = now_s
        return seqs, tokens

    def _chunk_cap(
        self, level: str, clock: int, batch: int, ctx: float, current: int | None = None
    ) -> int:
        """The largest power-of-two fraction of the configured chunk whose step (beside a
        decode batch of `batch`) stays within chunk_step_slo_factor x the TPOT SLO at this
        clock: a prefill chunk stalls every decode for a step, and at a low clock a full
        chunk takes seconds (prefill is compute-bound); and within chunk_step_ttft_factor
        x the TTFT SLO: a prompt arriving as a full chunk starts waits for it, then for
        its own. A chunk above the `current` one must fit within chunk_grow_margin x that
        (the bound moves with the estimated decode batch: its noise must not flip the
        chunk)."""
        p, e = self.params, self.engine
        co = self._step_model(level).coefficients(clock, ctx)
        step_max_s = min(
            p.chunk_step_slo_factor * self._policy.tpot_slo_ms / 1000.0,
            p.chunk_step_ttft_factor * self._policy.ttft_slo_ms / 1000.0,
        )
        tokens = e.max_num_batched_tokens_max
        while tokens > e.max_num_batched_tokens_min:
            tighten = p.chunk_grow_margin if current is not None and tokens > current else 1.0
            if co.step_s(tokens, batch, batch * ctx) <= step_max_s * tighten:
                break
            tokens = max(e.max_num_batched_tokens_min, tokens // 2)
        return tokens

    def _ttft_seen(self) -> bool:
        """A request that arrived since the clock or the chunk cap last changed has seen its
        first token within slo_margin x the TTFT SLO: evidence that the configuration in
        force works before the next step down."""
        return (
            self._ttft_since_change_ms is not None
            and self._ttft_since_change_ms <= self.params.slo_margin * self._policy.ttft_slo_ms
        )

    def _chunk_for_ttft(
        self, level: str, clock: int, seqs: int, tokens: int, current: int, workload: Workload
    ) -> int:
        """A smaller chunk shortens the stall a prefill step puts on every decode, but each
        chunk also pays a step's fixed and decode costs, and a prompt takes more of them:
        where the step-bounded chunk `tokens` is predicted to miss slo_margin x the TTFT
        SLO, the smallest larger power-of-two chunk predicted to meet it, else the one
        predicted fastest (on a CPU, whose steps carry a large fixed cost, a 128-token
        chunk took a 300-token prompt past the SLO that 512 met). A chunk below the
        `current` one must meet it by descend_margin more (noise near the edge must not
        flip the chunk)."""
        p = self.params
        limit_ms = p.slo_margin * self._policy.ttft_slo_ms
        top = self.engine.max_num_batched_tokens_max
        best_ms, best = math.inf, tokens
        t = tokens
        while True:
            ttft_ms = self._predict(level, clock, seqs, t, workload, None).ttft_ms
            if ttft_ms <= limit_ms * (p.descend_margin if t < current else 1.0):
                return t
            if ttft_ms < best_ms:
                best_ms, best = ttft_ms, t
            if t >= top:
                return best
            t = min(top, t * 2)

    # ---- constraints and bookkeeping ----------------------------------------

    def _snap(self, mhz: float) -> int:
        """The highest candidate clock at or below mhz (the lowest candidate at least)."""
        i = bisect.bisect_right(self._clocks, mhz) - 1
        return self._clocks[max(i, 0)]

    def _move(self, mhz: int, steps: int) -> int:
        i = bisect.bisect_left(self._clocks, mhz)
        i = min(max(i + steps, 0), len(self._clocks) - 1)
        return self._clocks[i]

    def _clamp_power(self, watts: float) -> float:
        d = self.device
        if d.power_limit_min_w is not None:
            watts = max(watts, d.power_limit_min_w)
        if d.power_limit_max_w is not None:
            watts = min(watts, d.power_limit_max_w)
        return round(watts, 1)

    def _clamp(self, knobs: Knobs) -> Knobs:
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
            limit = self._clamp_power(limit) if d.can_set_power_limit else None
        interval = min(max(knobs.decode_interval_ms, 0.0), e.decode_interval_max_ms)
        return Knobs(seqs, tokens, level, clock, limit, interval)

    def _finish(
        self, choice: Choice, now_s: float, budget_w: float, telemetry: Telemetry | None
    ) -> Decision:
        if self._probe_chunk_from is not None and self._exploring is None:
            # However the trial ended, the chunk its probe cut comes back.
            chunk = max(choice.knobs.max_num_batched_tokens, self._probe_chunk_from)
            choice.knobs = choice.knobs.with_changes(max_num_batched_tokens=chunk)
            self._probe_chunk_from = None
        self._hold_clock_under_hw_slowdown(choice, telemetry)
        knobs = self._clamp(choice.knobs)
        if not self.device.can_lock_clocks and self.device.can_set_power_limit:
            knobs = self._clock_as_power_limit(choice.knobs, knobs, budget_w, telemetry)
        previous = self._last.knobs if self._last is not None else None
        changed = knobs.changed_fields(previous) if previous is not None else ()
        if previous is not None and knobs.quant_level != previous.quant_level:
            # Another level: its latencies are not this one's; start the calibration afresh.
            self._ttft_ratio.clear()
            self._tpot_ratio.clear()
            self._pred_ttft_ms.value = self._pred_tpot_ms.value = None
            self._pred_step_ms.value = None
        if previous is not None and knobs.sm_clock_mhz != previous.sm_clock_mhz:
            self._last_clock_change_s = now_s
            if (knobs.sm_clock_mhz or 0) > (previous.sm_clock_mhz or 0):
                self._last_clock_up_s = now_s
        if "sm_clock_mhz" in changed or "max_num_batched_tokens" in changed:
            self._last_shape_change_s = now_s
            self._ttft_since_change_ms = None
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

    def _clock_as_power_limit(
        self, wanted: Knobs, clamped: Knobs, budget_w: float, telemetry: Telemetry | None
    ) -> Knobs:
        """Where clocks cannot be locked, the chosen clock becomes a power limit: the
        predicted peak power at that clock, never above the budget's limit."""
        model = self._power
        limit = self._power_limit_for(budget_w)
        if wanted.sm_clock_mhz is not None and model.samples > 0:
            temp = telemetry.gpu_temp_c if telemetry is not None else None
            peak = model.predict_w(wanted.sm_clock_mhz, 0.0, 1.0, temp) * 1.05
            limit = self._clamp_power(min(peak, limit if limit is not None else peak))
        return clamped.with_changes(power_limit_w=limit)
