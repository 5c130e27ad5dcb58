"""The feedback controller: observe(telemetry, engine stats, now) -> Decision (+ reason).

Pure decision logic over plain values: it learns step-latency and power models from what
it observes, predicts each candidate configuration, picks the cheapest one predicted to
meet the SLOs inside the power budget, and lets feedback guards override the models. It
keeps its own state (named states, explicit transitions, counters) and nothing else: it
must not import torch or the daemon, read a clock, sleep, or touch a device or an engine.
The daemon's control loop (daemon/control_loop.py) feeds it and applies its decisions.
"""

from __future__ import annotations

import math

from controller.latency_guard import LatencyGuard
from controller.learner import Learner
from controller.limits import Limits, candidate_clocks
from controller.models import (
    Prediction,
    StepTimeModel,
    Workload,
    idle_ttft_ms,
)
from controller.outlook import Outlook
from controller.policy import ControlMode, Knobs, Objective, Policy, allowed_quant_levels
from controller.power_guard import PowerGuard
from controller.quant import QuantTimescale
from controller.signals import (
    DeviceConstraints,
    EngineConstraints,
    EngineStats,
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


class Controller:
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
        self.limits = Limits(device, engine, self.params)
        reference_w = device.power_limit_max_w or policy.power_budget_w
        self.learner = Learner(self.params, device.sm_clock_max_mhz, reference_w)
        self.power_guard = PowerGuard(self.params, self.limits, self.learner)
        self.latency_guard = LatencyGuard(self.params, self.limits, self.learner)
        self.quant = QuantTimescale(self.params, self.limits, self.learner, self.latency_guard)
        self.counters = ControllerCounters()
        self.state = ControllerState.LEARNING
        self._knobs = self.limits.clamp(initial_knobs)
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
        self._stale_since_s: float | None = None
        self._idle_since_s: float | None = None
        self._now_s = 0.0
        self._feasible_since_s: float | None = None
        self._infeasible_since_s: float | None = None

    def outlook(self, now_s: float | None = None) -> Outlook:
        """The models' view at now_s (default: the latest observation)."""
        return Outlook(
            self.params,
            self.limits,
            self.learner,
            self.power_guard,
            self.latency_guard,
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
                    "seen_clocks_mhz": m.seen_clocks(self.params.trust_min_samples),
                }
                for level, m in self.learner.step_models.items()
            },
            "power_samples": self.learner.power.samples,
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
            since_clock_change_s=now_s - self._last_clock_change_s,
            before_step=self.quant.judge_trial_step,
        )
        for x in stats.ttft_s:
            if now_s - x >= self._last_shape_change_s:
                self._ttft_since_change_ms = max(self._ttft_since_change_ms or 0.0, x * 1000.0)
        self.latency_guard.note_queue(stats.num_waiting)

    def _clock_now(self, telemetry: Telemetry | None) -> int | None:
        if telemetry is not None and telemetry.sm_clock_mhz:
            return telemetry.sm_clock_mhz
        return self._knobs.sm_clock_mhz or self.device.sm_clock_max_mhz

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
        outlook = self.outlook()
        power_w = telemetry.power_w or 0.0
        power_limit = self.limits.power_limit_for(budget_w)

        # 2. Manual: the operator's knobs, with only the power and thermal guards.
        if policy.mode == ControlMode.MANUAL:
            manual = (self._manual_knobs or current).with_changes(power_limit_w=power_limit)
            guarded = self.power_guard.check(telemetry, manual, now_s, budget_w, power_w)
            if guarded is not None:
                self.latency_guard.release_floor()  # power wins over latency
                return guarded
            ceiling = self.power_guard.active_ceiling(
                outlook, power_w, budget_w, telemetry.gpu_temp_c
            )
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
        guarded = self.power_guard.check(telemetry, base, now_s, budget_w, power_w)
        if guarded is not None:
            self.latency_guard.release_floor()  # power wins over latency
            return guarded
        ceiling = self.power_guard.active_ceiling(outlook, power_w, budget_w, telemetry.gpu_temp_c)

        allowed = self._allowed_levels()
        level = base.quant_level or self.engine.full_precision_level
        if level not in allowed:
            target = self.quant.best_allowed_level(allowed, level)
            return Choice(
                self.state if self.state != ControllerState.IDLE else ControllerState.TRACKING,
                base.with_changes(quant_level=target),
                Reason.QUANT_FORBIDDEN,
                f"quantization level {level} is not allowed by the policy "
                f"(max_ppl_increase_pct {policy.max_ppl_increase_pct}): switching to {target}",
            )

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
            # A calm trial that hurts latency ends at once; a trial begun because the
            # previous level could not cope is not its fault, and goes on, as does one
            # whose steps have vouched for it (then the clock is what the guard raises:
            # steady60's bf16 trial, as fast as fp32's model, ended on a queue at
            # 645 MHz, and fp32 ran 18 s more).
            ended = self.quant.end_calm_trial()
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
                    self._steady_s(now_s),
                )
                if escape is not None:
                    return escape
            return latency

        step_model = self.learner.step_model(level)
        power_model = self.learner.power

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
                for lv, m in self.learner.step_models.items()
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

    def _steady_s(self, now_s: float) -> float:
        """How long the targets have been predicted met (0: not now)."""
        return now_s - self._feasible_since_s if self._feasible_since_s is not None else 0.0

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

    def _idle_choice(
        self, knobs: Knobs, model: StepTimeModel, workload: Workload, ceiling: int | None
    ) -> Choice:
        p = self.params
        slo = self._policy.ttft_slo_ms * p.slo_margin
        ratio = self.learner.ttft_ratio.ratio(self._now_s, self._policy.slo_percentile)
        top = ceiling if ceiling is not None else self.device.sm_clock_max_mhz
        chosen = None
        if model.samples >= p.learning_min_steps:
            level = knobs.quant_level or self.engine.full_precision_level
            for f in self.outlook().clock_range(level, ceiling):
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
        switched = self.quant.step(
            base, allowed, workload, temp, self.outlook(), budget_w, ceiling, self._steady_s(now_s)
        )
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
        clocks = self.outlook().clock_range(level, ceiling)

        interval_now = knobs.decode_interval_ms

        def at(f: int, interval: float) -> Prediction:
            return self.outlook().predict(
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
        self.learner.note_prediction(now_pred, now_s)
        # Hysteresis band: a lower clock must meet the SLOs with a tighter margin than the
        # one that keeps the current clock, so noise near the edge cannot flip between them.
        feasible = [
            (i, pr)
            for i, pr in cands
            if self.outlook().feasible(
                pr, budget_w, p.descend_margin if pr.sm_clock_mhz < clock_now else 1.0
            )
        ]
        if feasible:
            target_interval, best = min(
                feasible, key=lambda c: (self.outlook().score(c[1]), -c[1].sm_clock_mhz, -c[0])
            )
            state = ControllerState.TRACKING
        else:
            # Nothing meets everything: no pacing (no TPOT headroom to trade), inside the
            # power budget, then the most headroom.
            unpaced = [c for c in cands if c[0] == 0.0]
            in_budget = [c for c in unpaced if self.outlook().within_budget(c[1], budget_w)]
            if not in_budget:
                # The budget wins over model trust: look below the trusted clocks too.
                lower = [
                    (interval_now, at(f, interval_now))
                    for f in self.limits.clocks_mhz
                    if f < clocks[0] and (ceiling is None or f <= ceiling)
                ]
                in_budget = [c for c in lower if self.outlook().within_budget(c[1], budget_w)]
                in_budget = in_budget or (lower[:1] if lower else unpaced[:1])
            target_interval, best = max(in_budget, key=lambda c: c[1].sm_clock_mhz)
            state = ControllerState.TRACKING
            code = Reason.INFEASIBLE
            notes.append("no candidate predicted to meet every target: most headroom within budget")
        target = best.sm_clock_mhz
        now_ok = clock_now in clocks and self.outlook().feasible(now_pred, budget_w)
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
        model = self.learner.step_model(level)
        young = model.samples < p.descend_evidence_steps
        unseen_below = target < min(
            model.seen_clocks(p.trust_min_samples), default=self.device.sm_clock_max_mhz
        )
        may_descend = (
            may_change
            and now_s - self._last_clock_up_s >= p.descend_hold_s
            and self.learner.waiting_now == 0
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
            move = held or not self.outlook().within_budget(now_pred, budget_w)
            why = "restore feasibility"
        else:
            # Nothing is predicted to meet everything: move towards the most headroom at
            # once when that is up, otherwise no faster than the clock timescale.
            # ... but at once, down too, when the current clock is predicted over budget.
            over = not self.outlook().within_budget(now_pred, budget_w)
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
            if target > clock_now and self.limits.hw_limit_enforces(budget_w):
                # A faster clock takes a bigger prefill chunk at once (a smaller one waits
                # for the batch-cap timescale; and not where only the clock holds the
                # budget: a bigger chunk draws more power).
                bigger = self.outlook().chunk_cap(
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
        if now_s - self._last_pace_s < p.pace_period_s or self.quant.exploring is not None:
            return None
        if self.learner.step_model(level).samples < p.descend_evidence_steps:
            return None  # a young model: its paced predictions rest on batches not seen
        if (
            self.learner.waiting_now > 0
            or now_s - self.latency_guard.state.last_fired_s < p.guard_hold_s
        ):
            return None
        self._last_pace_s = now_s
        clock = knobs.sm_clock_mhz or self.device.sm_clock_max_mhz

        def at(interval: float) -> Prediction:
            return self.outlook().predict(
                level,
                clock,
                knobs.max_num_seqs,
                knobs.max_num_batched_tokens,
                workload,
                temp,
                interval,
            )

        now_pred = at(current)
        if not self.outlook().feasible(now_pred, budget_w):
            return None
        longer = {i: at(i) for i in self._pace_candidates() if i > current}
        ok = [
            i for i, pr in longer.items() if self.outlook().feasible(pr, budget_w, p.descend_margin)
        ]
        if not ok:
            return None
        best = min(ok, key=lambda i: (self.outlook().score(longer[i]), i))
        cur_j, best_j = now_pred.j_per_token, longer[best].j_per_token
        if not (math.isfinite(cur_j) and math.isfinite(best_j) and cur_j > 0):
            return None
        gain = 100.0 * (1.0 - best_j / cur_j)
        if gain < p.clock_gain_min_pct:
            return None
        if not self.outlook().batch_trusted(longer[best]):
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
        co = self.learner.step_model(level).coefficients(self.device.sm_clock_max_mhz, ctx)
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
            for st in self.learner.recent_steps
            if st.quant_level == level and st.duration_s <= slo_s
        ]
        seqs = max(seqs, max(ran, default=1))
        # Never below twice the batch the load needs at the clock in force (a cap under it
        # queues requests for nothing).
        here = self.outlook().predict(
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
            self.learner.waiting_now > 0
            or now_s - self.latency_guard.state.last_fired_s < p.guard_hold_s
            or infeasible
        ):
            seqs = knobs.max_num_seqs  # no smaller batch while a queue is being served
        tokens = self.outlook().chunk_cap(
            level, clock, min(seqs, max(1, math.ceil(batch))), ctx, knobs.max_num_batched_tokens
        )
        tokens = self.outlook().chunk_for_ttft(
            level, clock, seqs, tokens, knobs.max_num_batched_tokens, workload
        )
        if seqs < knobs.max_num_seqs and not self.outlook().feasible(
            self.outlook().predict(level, clock, seqs, tokens, workload, None), budget_w
        ):
            seqs = knobs.max_num_seqs  # a smaller batch cap must be predicted to meet targets
        if tokens < knobs.max_num_batched_tokens:
            if (
                now_s - self.latency_guard.state.last_fired_s < p.guard_hold_s
                or not self._ttft_seen()
            ):
                tokens = knobs.max_num_batched_tokens  # not while a guard holds, nor unproven
            else:
                # One halving at a time: the model's prefill costs rest on the chunks it has
                # seen (at the start, 512-token ones only; it called 64 safe at 1.35 s TTFT on
                # the real engine, and the next prompt took 2.7 s).
                tokens = max(tokens, knobs.max_num_batched_tokens // 2)
        if tokens > knobs.max_num_batched_tokens and not self.limits.hw_limit_enforces(budget_w):
            tokens = knobs.max_num_batched_tokens
        if self.quant.probing:
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

    def _ttft_seen(self) -> bool:
        """A request that arrived since the clock or the chunk cap last changed has seen its
        first token within slo_margin x the TTFT SLO: evidence that the configuration in
        force works before the next step down."""
        return (
            self._ttft_since_change_ms is not None
            and self._ttft_since_change_ms <= self.params.slo_margin * self._policy.ttft_slo_ms
        )

    # ---- constraints and bookkeeping ----------------------------------------

    def _finish(
        self, choice: Choice, now_s: float, budget_w: float, telemetry: Telemetry | None
    ) -> Decision:
        choice.knobs = self.quant.restore_probe_chunk(choice.knobs)
        self._hold_clock_under_hw_slowdown(choice, telemetry)
        knobs = self.limits.clamp(choice.knobs)
        if not self.device.can_lock_clocks and self.device.can_set_power_limit:
            knobs = self._clock_as_power_limit(choice.knobs, knobs, budget_w, telemetry)
        previous = self._last.knobs if self._last is not None else None
        changed = knobs.changed_fields(previous) if previous is not None else ()
        if previous is not None and knobs.quant_level != previous.quant_level:
            # Another level: its latencies are not this one's; start the calibration afresh.
            self.learner.forget_latency_calibration()
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
        model = self.learner.power
        limit = self.limits.power_limit_for(budget_w)
        if wanted.sm_clock_mhz is not None and model.samples > 0:
            temp = telemetry.gpu_temp_c if telemetry is not None else None
            peak = model.predict_w(wanted.sm_clock_mhz, 0.0, 1.0, temp) * 1.05
            limit = self.limits.clamp_power(min(peak, limit if limit is not None else peak))
        return clamped.with_changes(power_limit_w=limit)
