"""The clock timescale, the fastest: each observation, the least predicted J/token clock
(with the decode interval in force or a shorter one) whose percentile TTFT and TPOT meet
slo_margin x SLO and whose power fits the budget. Fast up, slow down: a lower clock needs
a tighter margin at a load a standard error above the estimate, a gain of
clock_gain_min_pct, descend_hold_s since the last move up, no queue, and (while the
level's model is young) a first token seen at the clock in force.
It must not import torch or the daemon, read a clock, or touch a device or an engine.

States: feasible (the clock in force predicted to meet the targets) / infeasible since a
time (a move once that has held clock_min_interval_s) / nothing feasible (towards the
most headroom within the budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits
from wattserve.controller.models import Prediction, StepTimeModel, Workload, idle_ttft_ms
from wattserve.controller.outlook import Outlook
from wattserve.controller.pacing import pace_candidates
from wattserve.controller.part import Part
from wattserve.controller.policy import Knobs, Policy
from wattserve.controller.state import Choice, ControllerState, Reason


@dataclass
class ClockState:
    last_change_s: float = -math.inf
    last_up_s: float = -math.inf
    last_shape_change_s: float = -math.inf  # the clock or the chunk cap
    # The longest TTFT of the requests that arrived since the clock or the chunk cap
    # last changed (None until one has its first token): a step down of either waits
    # for one within slo_margin.
    ttft_since_change_ms: float | None = None
    feasible_since_s: float | None = None  # the targets predicted met since then
    infeasible_since_s: float | None = None  # the clock in force predicted to miss since


@dataclass
class ClockMove:
    """What the clock step chose: the knobs, the reason code so far, its notes, the
    prediction in force after it, whether it moved the decode interval, and whether that
    move shortened it because the targets were predicted missed (not for energy)."""

    knobs: Knobs
    code: Reason
    chosen: Prediction
    interval_moved: bool
    notes: list[str] = field(default_factory=list)
    interval_shortened_for_targets: bool = False


class ClockTimescale(Part):
    """The clock each observation, and the evidence a lower one needs."""

    def __init__(self, limits: Limits, learner: Learner) -> None:
        super().__init__(limits, learner)
        self.state = ClockState()

    # ---- what the others ask ----------------------------------------

    @property
    def infeasible(self) -> bool:
        """The clock in force is predicted to miss the targets (not yet moved from)."""
        return self.state.infeasible_since_s is not None

    def since_change_s(self, now_s: float) -> float:
        return now_s - self.state.last_change_s

    def steady_s(self, now_s: float) -> float:
        """How long the targets have been predicted met (0: not now)."""
        since = self.state.feasible_since_s
        return now_s - since if since is not None else 0.0

    def ttft_seen(self, policy: Policy) -> bool:
        """A request that arrived since the clock or the chunk cap last changed has seen its
        first token within slo_margin x the TTFT SLO: evidence that the configuration in
        force works before the next step down."""
        seen = self.state.ttft_since_change_ms
        return seen is not None and seen <= self.params.targets.slo_margin * policy.ttft_slo_ms

    # ---- transitions driven by the others ----------------------------------------

    def note_first_tokens(self, ttft_s: tuple[float, ...], now_s: float) -> None:
        """Requests that saw their first token now, after ttft_s each."""
        s = self.state
        for x in ttft_s:
            if now_s - x >= s.last_shape_change_s:
                s.ttft_since_change_ms = max(s.ttft_since_change_ms or 0.0, x * 1000.0)

    def record_applied(
        self, previous: Knobs | None, knobs: Knobs, changed: tuple[str, ...], now_s: float
    ) -> None:
        """The knobs decided now (after `previous`): a clock change, and a change of the
        clock or the chunk (the evidence of a first token starts afresh)."""
        s = self.state
        if previous is not None and knobs.sm_clock_mhz != previous.sm_clock_mhz:
            s.last_change_s = now_s
            if (knobs.sm_clock_mhz or 0) > (previous.sm_clock_mhz or 0):
                s.last_up_s = now_s
        if "sm_clock_mhz" in changed or "max_num_batched_tokens" in changed:
            s.last_shape_change_s = now_s
            s.ttft_since_change_ms = None

    # ---- the timescale's step ----------------------------------------

    def step(
        self,
        knobs: Knobs,
        code: Reason,
        level: str,
        workload: Workload,
        temp: float | None,
        outlook: Outlook,
        budget_w: float,
        ceiling: int | None,
    ) -> ClockMove:
        """The clock (and a shorter decode interval) for the knobs after the batch caps."""
        lim = self.limits
        clock_now = knobs.sm_clock_mhz or lim.top_mhz
        notes: list[str] = []
        clocks = outlook.clock_range(level, ceiling)
        interval_now = knobs.decode_interval_ms
        found = self._search(knobs, level, workload, temp, outlook, budget_w, ceiling, clocks)
        feasible, target_interval, best, now_pred = found
        if not feasible:
            code = Reason.INFEASIBLE
            notes.append("no candidate predicted to meet every target: most headroom within budget")
        target = best.sm_clock_mhz
        now_ok = clock_now in clocks and outlook.feasible(now_pred, budget_w)
        move, why = self._whether_to_move(
            level, clock_now, best, now_pred, feasible, now_ok, outlook, budget_w
        )
        # Pacing goes off at once when nothing meets the targets (no TPOT headroom to trade).
        interval_move = target_interval != interval_now and (move or not feasible)
        chosen = now_pred
        if interval_move:
            notes.append(f"decode interval {interval_now:g} -> {target_interval:g} ms ({why})")
            knobs = knobs.with_changes(decode_interval_ms=target_interval)
            if code is Reason.STEADY:
                code = Reason.OPTIMIZE
            chosen = best
        if target != clock_now and move:
            notes.append(f"clock {clock_now} -> {target} MHz ({why})")
            knobs = knobs.with_changes(sm_clock_mhz=target)
            if target > clock_now and lim.hw_limit_enforces(budget_w):
                knobs = self._bigger_chunk(knobs, level, best, workload, outlook, budget_w, notes)
            if code is Reason.STEADY:
                code = Reason.OPTIMIZE
            chosen = best
        shortened = interval_move and target_interval < interval_now and not (feasible and now_ok)
        return ClockMove(
            knobs, code, chosen, interval_move, notes, interval_shortened_for_targets=shortened
        )

    def _search(
        self,
        knobs: Knobs,
        level: str,
        workload: Workload,
        temp: float | None,
        outlook: Outlook,
        budget_w: float,
        ceiling: int | None,
        clocks: list[int],
    ) -> tuple[bool, float, Prediction, Prediction]:
        """The best (decode interval, prediction) over the candidate clocks: whether one
        meets every target, its interval, its prediction, and the prediction in force."""
        p, lim = self.params, self.limits
        now_s = outlook.now_s
        clock_now = knobs.sm_clock_mhz or lim.top_mhz
        interval_now = knobs.decode_interval_ms

        def at(f: int, interval: float, load: Workload = workload) -> Prediction:
            return outlook.predict(
                level,
                f,
                knobs.max_num_seqs,
                knobs.max_num_batched_tokens,
                load,
                temp,
                interval,
            )

        # With the decode pacing interval in force or a shorter one (a longer one is the
        # pacing step's): the two trade TPOT against each other, and a clock-only search
        # would go to the top clock to keep a long interval's TPOT. (interval, prediction)
        shorter = [i for i in pace_candidates(outlook.policy, lim.engine, p) if i < interval_now]
        intervals = [interval_now] + shorter
        cands = [(i, at(f, i)) for i in intervals for f in clocks]
        now_pred = at(clock_now, interval_now)
        self.learner.note_prediction(now_pred, now_s, interval_now)
        # Hysteresis band: a lower clock must meet the SLOs with a tighter margin than the
        # one that keeps the current clock, so noise near the edge cannot flip between them,
        # and at a load descend_load_z standard errors above the estimate: a lull of random
        # arrivals must not take the clock down for the next rush to bring it back up.
        upper = workload.upper(p.clock.descend_load_z)

        def ok(i: float, pr: Prediction) -> bool:
            if pr.sm_clock_mhz >= clock_now:
                return outlook.feasible(pr, budget_w)
            if upper is not workload:
                pr = at(pr.sm_clock_mhz, i, upper)
            return outlook.feasible(pr, budget_w, p.clock.descend_margin)

        feasible = [(i, pr) for i, pr in cands if ok(i, pr)]
        if feasible:
            target_interval, best = min(
                feasible, key=lambda c: (outlook.score(c[1]), -c[1].sm_clock_mhz, -c[0])
            )
            return True, target_interval, best, now_pred
        # Nothing meets everything: no pacing (no TPOT headroom to trade), inside the
        # power budget, then the most headroom.
        unpaced = [c for c in cands if c[0] == 0.0]
        in_budget = [c for c in unpaced if outlook.within_budget(c[1], budget_w)]
        if not in_budget:
            # The budget wins over model trust: look below the trusted clocks too; not
            # below a latency guard's floor, which it set within what the budget allows
            # (Outlook.safe_clock): a prediction over the budget there is the power
            # guard's to settle on measured power (it drops the floor), or the guard's
            # step up and this search take turns undoing each other.
            floor = outlook.latency_hold.floor(now_s)
            lower = [
                (interval_now, at(f, interval_now))
                for f in lim.clocks_mhz
                if f < clocks[0]
                and (ceiling is None or f <= ceiling)
                and (floor is None or f >= floor)
            ]
            in_budget = [c for c in lower if outlook.within_budget(c[1], budget_w)]
            in_budget = in_budget or (lower[:1] if lower else unpaced[:1])
        target_interval, best = max(in_budget, key=lambda c: c[1].sm_clock_mhz)
        return False, target_interval, best, now_pred

    def _whether_to_move(
        self,
        level: str,
        clock_now: int,
        best: Prediction,
        now_pred: Prediction,
        feasible: bool,
        now_ok: bool,
        outlook: Outlook,
        budget_w: float,
    ) -> tuple[bool, str]:
        """Whether to move to the search's best now, and why (fast up, slow down)."""
        p, s, lim = self.params, self.state, self.limits
        now_s = outlook.now_s
        target = best.sm_clock_mhz
        gain = 0.0
        if (
            math.isfinite(now_pred.j_per_token)
            and math.isfinite(best.j_per_token)
            and now_pred.j_per_token > 0
        ):
            gain = 100.0 * (1.0 - best.j_per_token / now_pred.j_per_token)
        may_change = now_s - s.last_change_s >= p.clock.clock_min_interval_s
        # Fast up, slow down: after any move up, no move down for descend_hold_s, and none
        # while requests queue (the model's steady state is not what they see). While the
        # level's model is young (under descend_evidence_steps steps), a step below every
        # clock it has been seen at waits for a request that arrived at the clock in force
        # to see its first token within slo_margin x the TTFT SLO: there the clock
        # sensitivity is extrapolated from a few prefill steps, and a young model can call
        # a clock far below the seen ones safe when its requests would miss the SLO.
        model = self.learner.step_model(level)
        young = model.samples < p.clock.descend_evidence_steps
        unseen_below = target < min(
            model.seen_clocks(p.learning.trust_min_samples), default=lim.top_mhz
        )
        may_descend = (
            may_change
            and now_s - s.last_up_s >= p.clock.descend_hold_s
            and self.learner.waiting_now == 0
            and (self.ttft_seen(outlook.policy) or not (young and unseen_below))
        )
        if now_ok:
            s.infeasible_since_s = None
        if feasible and now_ok:
            move = (may_descend if target < clock_now else may_change) and (
                gain >= p.clock.clock_gain_min_pct
            )
            why = f"{gain:.1f}% less J/token"
        elif feasible:
            # The current clock is predicted to miss: move once that prediction has held
            # for clock_min_interval_s (one noisy estimate is not a miss; a real one is
            # the guards' to catch at once), or at once when it is over the budget.
            if s.infeasible_since_s is None:
                s.infeasible_since_s = now_s
            held = now_s - s.infeasible_since_s >= p.clock.clock_min_interval_s
            move = held or not outlook.within_budget(now_pred, budget_w)
            why = "restore feasibility"
        else:
            # Nothing is predicted to meet everything: move towards the most headroom at
            # once when that is up, otherwise no faster than the clock timescale.
            # ... but at once, down too, when the current clock is predicted over budget.
            over = not outlook.within_budget(now_pred, budget_w)
            move = target > clock_now or may_descend or (over and target < clock_now)
            why = "most headroom within the budget"
        s.feasible_since_s = (
            (s.feasible_since_s or now_s) if feasible and (now_ok or move) else None
        )
        return move, why

    def _bigger_chunk(
        self,
        knobs: Knobs,
        level: str,
        best: Prediction,
        workload: Workload,
        outlook: Outlook,
        budget_w: float,
        notes: list[str],
    ) -> Knobs:
        """A faster clock takes at once the bigger prefill chunk the batch caps would choose
        at it (a smaller one waits for the batch-cap timescale; and not where only the clock
        holds the budget: a bigger chunk draws more power). Appends its note."""
        bigger = outlook.chunk_choice(
            level,
            best.sm_clock_mhz,
            knobs.max_num_seqs,
            max(1, min(knobs.max_num_seqs, math.ceil(best.decode_batch))),
            workload.mean_context_tokens,
            knobs.max_num_batched_tokens,
            workload,
            budget_w,
        )
        if bigger > knobs.max_num_batched_tokens:
            notes.append(f"max_num_batched_tokens {knobs.max_num_batched_tokens} -> {bigger}")
            knobs = knobs.with_changes(max_num_batched_tokens=bigger)
        return knobs

    def idle(
        self,
        knobs: Knobs,
        model: StepTimeModel,
        workload: Workload,
        outlook: Outlook,
        ceiling: int | None,
    ) -> Choice:
        """Nothing runs or waits: the lowest trusted clock whose predicted TTFT for the next
        arrival (the mean prompt) meets slo_margin x the SLO; the clock in force while the
        level's model is untrained."""
        p = self.params
        slo = outlook.policy.ttft_slo_ms * p.targets.slo_margin
        ratio = outlook.ttft_ratio()
        top = ceiling if ceiling is not None else self.limits.top_mhz
        chosen = None
        if model.samples >= p.learning.learning_min_steps:
            level = knobs.quant_level or self.limits.engine.full_precision_level
            for f in outlook.clock_range(level, ceiling):
                if f > top:
                    break
                ttft = idle_ttft_ms(
                    model, f, workload.mean_prompt_tokens, knobs.max_num_batched_tokens
                )
                if ttft * ratio <= slo:
                    chosen = (f, ttft * ratio)
                    break
        if chosen is None:
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
