"""The learned models' view at one observation: what a configuration (level, clock, caps,
decode interval) is predicted to cost and how fast, whether that meets the SLOs and the
budget, which clocks are trusted, how big a prefill chunk fits, when the waiting queue
would be served. The guards and the timescales ask it; it changes nothing (beyond creating
a level's step model on first use) and must not import torch or the daemon, read a clock,
or touch a device or an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wattserve.controller.guard_state import LatencyGuardState, PowerGuardState
from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits
from wattserve.controller.models import Prediction, StepCoefficients, Workload, predict
from wattserve.controller.params import ControllerParams
from wattserve.controller.policy import Knobs, Objective, Policy
from wattserve.controller.signals import EngineStats


@dataclass(frozen=True)
class Outlook:
    """Built by the controller for each observation: the policy, the time and the decode
    interval in force are fixed; the models and the guards' holds are read as they are."""

    params: ControllerParams
    limits: Limits
    learner: Learner
    power_hold: PowerGuardState  # the guards' holds, read live (the guards write them)
    latency_hold: LatencyGuardState
    policy: Policy
    now_s: float
    interval_ms: float  # the decode pacing interval in force

    def guard_holds(self) -> bool:
        """A latency guard's hold is in force (nothing shrinks or switches): guard_hold_s
        after it fired, or until a queue's floor let go."""
        return self.latency_hold.holding(self.now_s)

    def ttft_ratio(self) -> float:
        return self.learner.ttft_ratio.ratio(self.now_s, self.policy.slo_percentile)

    def tpot_ratio(self) -> float:
        return self.learner.tpot_ratio.ratio(self.now_s, self.policy.slo_percentile)

    def predict(
        self,
        level: str,
        clock: int,
        seqs: int,
        tokens: int,
        workload: Workload,
        temp_c: float | None,
        interval_ms: float | None = None,
        step_scale: float = 1.0,
    ) -> Prediction:
        """interval_ms: the decode pacing interval (None: the one in force); step_scale:
        every step that many times the level's model (a trial's worst tolerated case)."""
        if interval_ms is None:
            interval_ms = self.interval_ms
        return predict(
            level=level,
            clock_mhz=clock,
            step_model=self.learner.step_model(level),
            max_num_seqs=seqs,
            max_num_batched_tokens=tokens,
            workload=workload,
            power_model=self.learner.power,
            temp_c=temp_c,
            ttft_ratio=self.ttft_ratio(),
            tpot_ratio=self.tpot_ratio(),
            decode_interval_s=interval_ms / 1000.0,
            step_scale=step_scale,
        )

    def feasible(self, pr: Prediction, budget_w: float, tighten: float = 1.0) -> bool:
        """Predicted to meet both SLOs (x slo_margin x tighten), each percentile prediction
        times the adaptive margin measured at its level and clock, and the budget."""
        policy = self.policy
        if not pr.stable:
            return False
        margin = self.params.targets.slo_margin * tighten
        ttft_ms = pr.ttft_ms * self.error_factor("ttft", pr)
        tpot_ms = pr.tpot_ms * self.error_factor("tpot", pr)
        if ttft_ms > policy.ttft_slo_ms * margin or tpot_ms > policy.tpot_slo_ms * margin:
            return False
        return self.within_budget(pr, budget_w)

    def error_factor(self, kind: str, pr: Prediction) -> float:
        """The adaptive margin at the prediction's level and clock (Learner.error_factor):
        1 where the model's percentiles have held, more where it under-predicts."""
        return self.learner.error_factor(kind, pr.quant_level, pr.sm_clock_mhz, self.now_s)

    def board_limit_holds(self, budget_w: float) -> bool:
        """The board power limit, set at the budget, is trusted to hold it (at 100 ms): it
        is within the device's range and power has not been measured over the budget under
        it within power_hold_max_s (then the limit did not hold, or not in time, and a
        clock predicted over the budget would only be knocked down again). Every budget check
        of a clock asks this one question: the search's and a guard's step up must agree
        on it, or one takes the clock up where the other takes it down."""
        return self.limits.hw_limit_enforces(budget_w) and not self.power_hold.limit_failed_within(
            self.now_s, self.params.power_guard.power_hold_max_s
        )

    def within_budget(self, pr: Prediction, budget_w: float) -> bool:
        """Where the board power limit holds the budget, always; elsewhere the predicted
        1 s mean and the hungriest phase (a prefill step, 100 ms windows, scaled by the
        measured peak ratio) must fit power_margin x budget."""
        if self.board_limit_holds(budget_w):
            return True
        limit = budget_w * self.params.targets.power_margin
        if pr.power_w > limit:
            return False
        return pr.peak_power_w * self.learner.peak_ratio_at(self.now_s) <= limit

    def score(self, pr: Prediction) -> float:
        """What the objective minimises."""
        if self.policy.objective == Objective.MIN_LATENCY:
            return pr.tpot_ms / self.policy.tpot_slo_ms + pr.ttft_ms / self.policy.ttft_slo_ms
        return pr.j_per_token

    def latency_load(self, pr: Prediction) -> float:
        """The larger of the predicted TTFT and TPOT over their SLOs (inf: unstable)."""
        if not pr.stable:
            return math.inf
        return max(pr.ttft_ms / self.policy.ttft_slo_ms, pr.tpot_ms / self.policy.tpot_slo_ms)

    def batch_trusted(self, pr: Prediction, batch: int | None = None) -> bool:
        """A level's prediction rests on steps of about that decode batch: no more than
        batch_trust_factor x the largest batch its model has been fitted around (levels
        tried briefly at a calm moment know little of a burst's batches). The batch is
        at least `batch` (default: the one running now): a model that underestimates a
        level's step also predicts it a small batch, and would vouch for itself."""
        need = max(pr.decode_batch, self.learner.running_now if batch is None else batch)
        return need <= self.trusted_batch(pr.quant_level)

    def trusted_batch(self, level: str) -> float:
        """The largest decode batch a level's model is trusted at (0 without a model)."""
        p = self.params
        model = self.learner.step_models.get(level)
        if model is None:
            return 0.0
        seen = model.batch_seen(p.learning.trust_min_samples)
        return max(p.learning.batch_trust_min, p.learning.batch_trust_factor * seen)

    def clock_range(self, level: str, ceiling: int | None) -> list[int]:
        """Candidate clocks: below the power ceiling, above the latency floor, and no more
        than trust_clock_steps candidates beyond the clocks this level has been seen at."""
        p, lim = self.params, self.limits
        top = ceiling if ceiling is not None else lim.top_mhz
        floor = self.latency_hold.floor(self.now_s)
        seen = self.learner.step_model(level).seen_clocks(p.learning.trust_min_samples)
        if seen:
            lo = lim.move(lim.snap(min(seen)), -p.learning.trust_clock_steps)
            hi = lim.move(lim.snap(max(seen)), +p.learning.trust_clock_steps)
        else:
            lo, hi = lim.top_mhz, lim.top_mhz
        out = [
            f for f in lim.clocks_mhz if lo <= f <= min(hi, top) and (floor is None or f >= floor)
        ]
        if not out:
            out = [min(max(floor or top, lim.device.sm_clock_min_mhz), top)]
        return out

    def safe_clock(self, budget_w: float, temp_c: float | None) -> int:
        """The highest candidate clock whose predicted power in the hungriest phase seen
        lately (x the measured peak ratio) fits the budget; the top clock where the board
        power limit holds the budget."""
        p, lim = self.params, self.limits
        model = self.learner.power
        if self.board_limit_holds(budget_w):
            return lim.top_mhz
        if model.samples < p.learning.learning_min_power_samples:
            return lim.device.sm_clock_min_mhz
        recent = list(self.learner.recent_steps)[-50:]
        prefill = any(s.has_prefill for s in recent)
        busy = 1.0 if recent else 0.0
        peak_ratio = self.learner.peak_ratio_at(self.now_s)
        for f in reversed(lim.clocks_mhz):
            watts = peak_ratio * model.predict_w(
                f, 0.0 if prefill else busy, busy if prefill else 0.0, temp_c
            )
            if watts <= budget_w * p.targets.power_margin:
                return f
        return lim.device.sm_clock_min_mhz

    def drain_s(
        self, level: str, clock: int, stats: EngineStats, knobs: Knobs, workload: Workload
    ) -> float | None:
        """When the newest waiting request would see its first token at this clock: the
        oldest's wait so far plus the prefill of every waiting prompt (the mean prompt
        each), in chunks of what the token cap leaves beside the running batch, stretched
        by the prompts still arriving meanwhile (1 / (1 - share of the time their prefill
        takes); inf when that share reaches 1). None without a queue or a trained model."""
        co = self._queue_coefficients(level, clock, stats, workload)
        if co is None:
            return None
        return self._drain_s(co, stats, workload, knobs.max_num_batched_tokens)

    def chunk_to_drain(
        self,
        level: str,
        clock: int,
        stats: EngineStats,
        current: int,
        workload: Workload,
        late_s: float,
    ) -> int:
        """The token cap for serving a queue at this clock: the smallest of the `current`
        one and its doublings predicted to drain the queue within late_s (drain_s), else
        the one predicted to drain it soonest; none whose step (beside the running batch)
        outlasts chunk_step_slo_factor x the TPOT SLO. The step bounds of chunk_cap weigh
        one arriving prompt's wait behind a chunk against every decode's stall; with a
        queue, prompts wait for each other, and a cap that leaves little room beside the
        running batch (the cap counts its decode tokens) serves them slowest."""
        co = self._queue_coefficients(level, clock, stats, workload)
        if co is None:
            return current
        best, best_s = current, self._drain_s(co, stats, workload, current)
        if best_s <= late_s:
            return current
        top = self.limits.engine.max_num_batched_tokens_max
        step_max_s = self.params.batch_caps.chunk_step_slo_factor * self.policy.tpot_slo_ms / 1000.0
        running, ctx = stats.num_running, workload.mean_context_tokens
        t = current
        while t < top:
            t = min(top, t * 2)
            if co.step_s(max(t - running, 0), running, running * ctx) > step_max_s:
                break
            d = self._drain_s(co, stats, workload, t)
            if d < best_s:
                best, best_s = t, d
            if d <= late_s:
                break
        return best

    def _queue_coefficients(
        self, level: str, clock: int, stats: EngineStats, workload: Workload
    ) -> StepCoefficients | None:
        """The level's step costs at this clock, where a queue waits and the level's model
        has learned enough to be used; None otherwise."""
        model = self.learner.step_models.get(level)
        if stats.num_waiting <= 0 or model is None:
            return None
        if model.samples < self.params.learning.learning_min_steps:
            return None
        return model.coefficients(clock, workload.mean_context_tokens)

    def _drain_s(
        self, co: StepCoefficients, stats: EngineStats, workload: Workload, cap: int
    ) -> float:
        """drain_s on these step costs with this token cap."""
        ctx = workload.mean_context_tokens
        running = stats.num_running
        room = max(cap - running, self.limits.engine.max_num_batched_tokens_min)
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

    def chunk_choice(
        self,
        level: str,
        clock: int,
        seqs: int,
        batch: int,
        ctx: float,
        current: int,
        workload: Workload,
        budget_w: float,
    ) -> int:
        """The prefill chunk at this clock, by the three rules in turn: the step-bounded
        cap (chunk_cap, beside a decode batch of `batch`), grown where a prompt would miss
        the TTFT SLO (chunk_for_ttft), then the cheapest of it and its halvings
        (chunk_for_energy); each with its hysteresis against the `current` chunk."""
        tokens = self.chunk_cap(level, clock, batch, ctx, current)
        tokens = self.chunk_for_ttft(level, clock, seqs, tokens, current, workload)
        return self.chunk_for_energy(level, clock, seqs, tokens, current, workload, budget_w)

    def chunk_cap(
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
        p, e = self.params, self.limits.engine
        co = self.learner.step_model(level).coefficients(clock, ctx)
        step_max_s = min(
            p.batch_caps.chunk_step_slo_factor * self.policy.tpot_slo_ms / 1000.0,
            p.batch_caps.chunk_step_ttft_factor * self.policy.ttft_slo_ms / 1000.0,
        )
        tokens = e.max_num_batched_tokens_max
        while tokens > e.max_num_batched_tokens_min:
            tighten = (
                p.batch_caps.chunk_grow_margin if current is not None and tokens > current else 1.0
            )
            if co.step_s(tokens, batch, batch * ctx) <= step_max_s * tighten:
                break
            tokens = max(e.max_num_batched_tokens_min, tokens // 2)
        return tokens

    def chunk_for_ttft(
        self, level: str, clock: int, seqs: int, tokens: int, current: int, workload: Workload
    ) -> int:
        """A smaller chunk shortens the stall a prefill step puts on every decode, but each
        chunk also pays a step's fixed and decode costs, and a prompt takes more of them:
        where the step-bounded chunk `tokens` is predicted to miss slo_margin x the TTFT
        SLO, the smallest larger power-of-two chunk predicted to meet it, else the one
        predicted fastest (where steps carry a large fixed cost, as on a CPU, a smaller
        chunk can make a prompt later, not sooner). A chunk below the
        `current` one must meet it by descend_margin more (noise near the edge must not
        flip the chunk)."""
        p = self.params
        limit_ms = p.targets.slo_margin * self.policy.ttft_slo_ms
        top = self.limits.engine.max_num_batched_tokens_max
        best_ms, best = math.inf, tokens
        t = tokens
        while True:
            ttft_ms = self.predict(level, clock, seqs, t, workload, None).ttft_ms
            if ttft_ms <= limit_ms * (p.clock.descend_margin if t < current else 1.0):
                return t
            if ttft_ms < best_ms:
                best_ms, best = ttft_ms, t
            if t >= top:
                return best
            t = min(top, t * 2)

    def chunk_for_energy(
        self,
        level: str,
        clock: int,
        seqs: int,
        tokens: int,
        current: int,
        workload: Workload,
        budget_w: float,
    ) -> int:
        """The chunk among `tokens` (the latency-bounded one) and its halvings predicted
        to cost the least J/token at this clock and the decode interval in force, among
        those predicted to meet the targets (a chunk below the `current` one with
        descend_margin more); a smaller one must save chunk_gain_min_pct over `tokens`,
        and any other over the `current` one where that is a candidate that meets them.
        A step's cost grows faster than its tokens (the step model's squared prefill term,
        the power model's chunk term), so splitting prompts can pay for the extra steps;
        with neither learned it never does."""
        p = self.params
        keep = 1.0 - p.batch_caps.chunk_gain_min_pct / 100.0
        base = self.predict(level, clock, seqs, tokens, workload, None)
        if not math.isfinite(base.j_per_token):
            return tokens
        best, best_j = tokens, base.j_per_token
        incumbent_j = math.inf
        if current == tokens:
            incumbent_j = base.j_per_token
        t = tokens // 2
        while t >= self.limits.engine.max_num_batched_tokens_min:
            pr = self.predict(level, clock, seqs, t, workload, None)
            tighten = p.clock.descend_margin if t < current else 1.0
            if self.feasible(pr, budget_w, tighten):
                if t == current:
                    incumbent_j = pr.j_per_token
                if pr.j_per_token < best_j:
                    best, best_j = t, pr.j_per_token
            t //= 2
        # Moving costs a change: away from the chunk in force, and below the bounded one,
        # only for chunk_gain_min_pct (model noise must not flip it every period).
        if math.isfinite(incumbent_j) and best_j > incumbent_j * keep:
            return current
        if best != tokens and best_j > base.j_per_token * keep:
            return tokens
        return best
