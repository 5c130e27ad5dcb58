"""The decode pacing timescale: how long the engine waits between decode steps (0: no
pacing) when the TPOT SLO leaves headroom to trade for energy. A longer interval is
weighed here, at most every pace_period_s; a shorter one is the clock search's (it weighs
them with the clocks each observation). It must not import torch or the daemon, read a
clock, or touch a device or an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits
from wattserve.controller.models import Prediction, Workload
from wattserve.controller.outlook import Outlook
from wattserve.controller.params import ControllerParams
from wattserve.controller.part import Part
from wattserve.controller.policy import Knobs, Objective, Policy
from wattserve.controller.signals import EngineConstraints


def pace_candidates(
    policy: Policy, engine: EngineConstraints, params: ControllerParams
) -> list[float]:
    """Decode intervals to consider (ms): off, and pace_fractions of the TPOT SLO within
    the engine's longest."""
    slo = policy.tpot_slo_ms
    top_ms = engine.decode_interval_max_ms
    return [
        0.0,
        *(float(round(f * slo)) for f in params.pacing.pace_fractions if f * slo <= top_ms),
    ]


@dataclass
class PacingState:
    # No longer interval is weighed before this: pace_period_s after it was last weighed
    # here or moved by the clock search, pace_backoff_s more after a shortening for the
    # targets.
    next_weigh_s: float = -math.inf
    last_longer_s: float = -math.inf  # the last time a longer interval was chosen here


class DecodePacing(Part):
    """A longer decode interval, on its period."""

    def __init__(self, limits: Limits, learner: Learner) -> None:
        super().__init__(limits, learner)
        self.state = PacingState()

    def lull(self, now_s: float) -> bool:
        """No request has arrived for pace_lull_gaps mean gaps (at least pace_period_s):
        pacing then only adds idle time to the requests still decoding, whose batch no
        arrival can grow (the steps are the same ones, with the waits between them). Not
        within pace_period_s of a longer interval chosen here: a lull that begins just
        after it (the arrivals' gaps are random) would undo it at once."""
        p = self.params
        if now_s - self.state.last_longer_s < p.pacing.pace_period_s:
            return False
        return self.learner.workload.lull(now_s, p.pacing.pace_lull_gaps, p.pacing.pace_period_s)

    def crowded(self) -> bool:
        """The running batch fills guard_cap_share of the engine's largest cap: an
        interval lengthens every request's life, so the slots fill and arrivals queue."""
        return self.near_engine_cap(self.learner.running_now)

    def note_interval_moved(self, now_s: float, shortened_for_targets: bool = False) -> None:
        """The clock search moved the interval: the next longer one waits pace_period_s,
        and pace_backoff_s more where it shortened it because the targets were predicted
        missed (a longer interval back at once, at the SLO's edge, flips to and fro)."""
        p = self.params
        wait_s = p.pacing.pace_period_s + (
            p.pacing.pace_backoff_s if shortened_for_targets else 0.0
        )
        self.state.next_weigh_s = max(self.state.next_weigh_s, now_s + wait_s)

    def step(
        self,
        level: str,
        knobs: Knobs,
        workload: Workload,
        temp: float | None,
        outlook: Outlook,
        budget_w: float,
        *,
        trial_running: bool,
    ) -> tuple[float, Prediction, str] | None:
        """A longer decode pacing interval, at most every pace_period_s (and not within a
        back-off, note_interval_moved), at the clock just chosen: the candidate (a fraction
        of the TPOT SLO) with the least predicted J/token that meets the targets with the
        descend margin, for the clock gain, with no queue and no recent guard; one
        candidate at a time beyond the decode batches the level's model is trusted at.
        Off for the min-latency objective and engines that do not pace, through a
        quantization trial and while the level's model is young.
        Returns (interval ms, its prediction, why), or None to keep the interval."""
        p, engine = self.params, self.limits.engine
        now_s = outlook.now_s
        current = knobs.decode_interval_ms
        if engine.decode_interval_max_ms <= 0 or outlook.policy.objective == Objective.MIN_LATENCY:
            return None
        if now_s < self.state.next_weigh_s or trial_running:
            return None
        if self.learner.step_model(level).samples < p.clock.descend_evidence_steps:
            return None  # a young model: its paced predictions rest on batches not seen
        if self.learner.waiting_now > 0 or outlook.guard_holds():
            return None
        # A longer interval reverted lately (it came near the SLOs) stays barred a while.
        barred_ms = outlook.latency_hold.pace_limit_ms(now_s)
        self.state.next_weigh_s = now_s + p.pacing.pace_period_s
        clock = knobs.sm_clock_mhz or self.limits.top_mhz

        def at(interval: float) -> Prediction:
            return outlook.predict(
                level,
                clock,
                knobs.max_num_seqs,
                knobs.max_num_batched_tokens,
                workload,
                temp,
                interval,
            )

        now_pred = at(current)
        if not outlook.feasible(now_pred, budget_w):
            return None
        candidates = pace_candidates(outlook.policy, engine, p)
        longer = {
            i: at(i) for i in candidates if i > current and (barred_ms is None or i <= barred_ms)
        }
        ok = [
            i for i, pr in longer.items() if outlook.feasible(pr, budget_w, p.clock.descend_margin)
        ]
        if not ok:
            return None
        best = min(ok, key=lambda i: (outlook.score(longer[i]), i))
        cur_j, best_j = now_pred.j_per_token, longer[best].j_per_token
        if not (math.isfinite(cur_j) and math.isfinite(best_j) and cur_j > 0):
            return None
        gain = 100.0 * (1.0 - best_j / cur_j)
        if gain < p.clock.clock_gain_min_pct:
            return None
        if not outlook.batch_trusted(longer[best]):
            # Beyond the decode batches the model has seen: one candidate at a time, so
            # the steps of each teach it before the next.
            best = min(ok)
        self.state.last_longer_s = now_s
        return best, longer[best], f"{gain:.1f}% less J/token"
