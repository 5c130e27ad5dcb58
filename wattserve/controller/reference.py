"""The reference check: the controller's own measured J/token and SLO misses against the
reference configuration's, and the reference whenever the controller is not measured ahead.

The reference is what the daemon runs uncontrolled, within the budget: the top clock under
the power guard's ceiling with the board power limit at the budget, the engine's largest
batch caps, no decode pacing, at the level in force (the quantization timescale judges
levels on their own measured steps). Below the board limit's range the check stands aside
(the top clock would break the budget, and only the clock holds it).
Each observation is booked to an epoch of one kind, reference or controlled (an epoch ends
after reference_epoch_s or when the kind, the level or the reference's clock changes): the
energy measured (power x time), the output tokens, and the TTFTs and TPOTs measured with
how many missed their SLO. Loads differ between epochs, so an epoch's energy is divided by
what the learned models predict the reference would have spent on its tokens at its own
output rate: that ratio, q, compares epochs at different loads.

A verdict each time a controlled epoch ends: the controller is ahead on energy when the
mean log q of its epochs since it took over (the first, its move away, not counted), plus
reference_z standard errors (one spread pooled over both kinds), is below the reference
epochs' mean; ahead on latency when its share of misses is at most the reference's plus
reference_z standard errors. Not ahead on latency holds the reference at once; not ahead
on energy holds it once the run's energy above the reference's exceeds
reference_allowance of the reference's (counted over reference_allowance_horizon_s at
least): the room a cold start and a trial need. A hold lasts reference_hold_s, doubled
each time in a row up to reference_hold_max_s. Until the reference has an epoch it runs
(after learning, whose top-clock steps count).

It must not import torch or the daemon, read a clock, or touch a device or an engine.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits
from wattserve.controller.models import Workload
from wattserve.controller.outlook import Outlook
from wattserve.controller.part import Part
from wattserve.controller.policy import Knobs, Policy
from wattserve.controller.signals import EngineStats, Telemetry


@dataclass
class Epoch:
    """What one kind of configuration did over a span: energy, work, latency verdicts."""

    reference: bool
    start_s: float
    end_s: float
    level: str
    reference_clock_mhz: int  # the reference's clock while it ran
    energy_j: float = 0.0
    output_tokens: int = 0
    latencies: int = 0  # TTFTs and TPOTs measured
    misses: int = 0  # of them, over their SLO

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def load(self, means: Workload) -> Workload:
        """The load at the epoch's own measured output rate: the estimator's rates scaled
        together to it (an epoch's few arrivals would make its own request rate noise)."""
        rate = self.output_tokens / max(self.duration_s, 1e-9)
        factor = rate / means.output_tokens_per_s if means.output_tokens_per_s > 0 else 1.0
        return replace(
            means,
            request_rate_per_s=means.request_rate_per_s * factor,
            prompt_tokens_per_s=means.prompt_tokens_per_s * factor,
            output_tokens_per_s=rate,
        )


@dataclass
class Verdict:
    """One comparison: the controller's J/token over the reference's (the ratio of their
    epochs' geometric mean q), the standard error of its log, the miss shares, and whether
    the controller is ahead on both."""

    j_ratio: float
    log_se: float
    miss_controlled: float
    miss_reference: float
    miss_se: float
    energy_ahead: bool
    latency_ahead: bool

    @property
    def ahead(self) -> bool:
        return self.energy_ahead and self.latency_ahead

    def describe(self) -> str:
        return (
            f"measured J/token {self.j_ratio:.3f} x the reference's "
            f"(log +- {self.log_se:.3f}), misses {100 * self.miss_controlled:.1f}% "
            f"against {100 * self.miss_reference:.1f}% (+- {100 * self.miss_se:.1f})"
        )


@dataclass
class ReferenceState:
    open: Epoch | None = None
    reference_epochs: deque[Epoch] = field(default_factory=deque)
    controlled_epochs: list[Epoch] = field(default_factory=list)  # since the last hold
    settled: bool = False  # the controller's first epoch since it took over has passed
    hold_until_s: float = -math.inf
    next_hold_s: float = 0.0  # 0: reference_hold_s
    last_s: float | None = None
    output_tokens: int | None = None  # the engine's cumulative count
    reference_clock_mhz: int | None = None  # the reference's clock at the latest decision
    applies: bool = True  # the board limit holds the budget (else the check stands aside)
    verdict: Verdict | None = None
    holds: int = 0
    # The run so far: the reference's energy for all the tokens booked (measured where it
    # ran, estimated where the controller did) and what the controller spent above it.
    reference_j: float = 0.0
    excess_j: float = 0.0


class ReferenceCheck(Part):
    """Books each observation to a reference or a controlled epoch, and says when the
    reference is to run."""

    def __init__(self, limits: Limits, learner: Learner) -> None:
        super().__init__(limits, learner)
        self.state = ReferenceState(
            reference_epochs=deque(maxlen=self.params.reference.reference_epochs_kept)
        )

    # ---- what the reference is ----------------------------------------

    def knobs(self, base: Knobs, ceiling: int | None, outlook: Outlook, budget_w: float) -> Knobs:
        """The reference configuration now: the top clock under the power guard's ceiling.
        Where the board limit cannot hold the budget (below its range) the check stands
        aside: the top clock would break the budget, and only the clock holds it."""
        e = self.limits.engine
        s = self.state
        s.applies = outlook.board_limit_holds(budget_w)
        clock = self.limits.top_mhz if ceiling is None else min(ceiling, self.limits.top_mhz)
        s.reference_clock_mhz = clock
        return base.with_changes(
            max_num_seqs=e.max_num_seqs_max,
            max_num_batched_tokens=e.max_num_batched_tokens_max,
            sm_clock_mhz=clock,
            decode_interval_ms=0.0,
        )

    def is_reference(self, knobs: Knobs) -> bool:
        e = self.limits.engine
        clock = knobs.sm_clock_mhz or self.limits.top_mhz
        return (
            knobs.max_num_seqs == e.max_num_seqs_max
            and knobs.max_num_batched_tokens == e.max_num_batched_tokens_max
            and knobs.decode_interval_ms == 0.0
            and clock >= (self.state.reference_clock_mhz or self.limits.top_mhz)
        )

    # ---- booking ----------------------------------------

    def note(
        self,
        telemetry: Telemetry | None,
        stats: EngineStats,
        in_force: Knobs,
        policy: Policy,
        outlook: Outlook,
        now_s: float,
    ) -> None:
        """Book the span since the previous observation (run with `in_force`) to its
        epoch; a controlled epoch that ends is judged."""
        s = self.state
        last_s, last_tokens = s.last_s, s.output_tokens
        s.last_s, s.output_tokens = now_s, stats.generation_tokens_total
        if last_s is None or last_tokens is None or now_s <= last_s:
            return
        power = None
        if telemetry is not None and telemetry.usable:
            power = telemetry.power_avg_w
            if power is None:
                power = telemetry.power_w
        if power is None or not s.applies:
            self._close(outlook, now_s)  # a span without a measurement ends the epoch unbooked
            return
        kind = self.is_reference(in_force)
        level = in_force.quant_level or self.limits.engine.full_precision_level
        clock = s.reference_clock_mhz or self.limits.top_mhz
        ep = s.open
        p = self.params.reference
        if ep is not None and (
            (ep.reference, ep.level, ep.reference_clock_mhz) != (kind, level, clock)
            or now_s - ep.start_s > p.reference_epoch_s
        ):
            self._close(outlook, now_s)
            ep = None
        if ep is None:
            ep = s.open = Epoch(kind, last_s, last_s, level, clock)
        ep.end_s = now_s
        ep.energy_j += power * (now_s - last_s)
        ep.output_tokens += max(0, stats.generation_tokens_total - last_tokens)
        ttft_slo_s, tpot_slo_s = policy.ttft_slo_ms / 1000.0, policy.tpot_slo_ms / 1000.0
        ep.latencies += len(stats.ttft_s) + len(stats.tpot_s)
        ep.misses += sum(x > ttft_slo_s for x in stats.ttft_s)
        ep.misses += sum(x > tpot_slo_s for x in stats.tpot_s)

    def _close(self, outlook: Outlook, now_s: float) -> None:
        s, p = self.state, self.params.reference
        ep, s.open = s.open, None
        if ep is None or ep.output_tokens < p.reference_epoch_min_tokens:
            return  # an idle span says nothing of J/token
        if ep.reference:
            s.reference_epochs.append(ep)
            s.reference_j += ep.energy_j
            s.settled = False
            return
        self._book_excess(ep, outlook)
        if not s.settled:  # the move away from the reference, not what the controller runs
            s.settled = True
            return
        s.controlled_epochs.append(ep)
        del s.controlled_epochs[: -p.reference_epochs_kept]
        verdict = self.judge(outlook)
        if verdict is None:
            return
        s.verdict = verdict
        if verdict.ahead:
            s.next_hold_s = 0.0
        elif verdict.latency_ahead and self.allowance_left_j() >= 0:
            return  # behind on energy, within the run's allowance: no hold yet
        else:
            hold = s.next_hold_s or p.reference_hold_s
            s.hold_until_s = now_s + hold
            s.next_hold_s = min(2 * hold, p.reference_hold_max_s)
            s.controlled_epochs.clear()
            s.holds += 1

    def _book_excess(self, ep: Epoch, outlook: Outlook) -> None:
        """A controlled epoch into the run's ledger: the reference's energy for its tokens
        (the models' prediction at its load times the reference epochs' measured q) and
        what the controller spent above that. Banked savings count up to the allowance."""
        s, p = self.state, self.params.reference
        means = self.learner.workload.current()
        lr = _logs(self.q(e, outlook, means) for e in s.reference_epochs)
        q = self.q(ep, outlook, means)
        if not lr or q is None or q <= 0:
            return
        estimate_j = ep.energy_j / q * math.exp(sum(lr) / len(lr))
        s.reference_j += estimate_j
        s.excess_j = max(
            s.excess_j + ep.energy_j - estimate_j, -p.reference_allowance * s.reference_j
        )

    def allowance_left_j(self) -> float:
        """What the controller may still spend above the reference this run (below 0: it
        has spent more than reference_allowance x the reference's energy above it, that
        energy counted over reference_allowance_horizon_s at least: a cold start's first
        seconds are not judged on a few seconds' allowance)."""
        s, p = self.state, self.params.reference
        ran_s = sum(e.duration_s for e in s.reference_epochs)
        power_w = sum(e.energy_j for e in s.reference_epochs) / ran_s if ran_s > 0 else 0.0
        horizon_j = max(s.reference_j, power_w * p.reference_allowance_horizon_s)
        return p.reference_allowance * horizon_j - s.excess_j

    # ---- the verdict ----------------------------------------

    def q(self, ep: Epoch, outlook: Outlook, means: Workload) -> float | None:
        """The epoch's energy over what the models predict the reference would have
        spent on its tokens at its own load (None: no finite prediction)."""
        lim = self.limits
        pr = outlook.predict(
            ep.level,
            ep.reference_clock_mhz,
            lim.engine.max_num_seqs_max,
            lim.engine.max_num_batched_tokens_max,
            ep.load(means),
            None,
            0.0,
        )
        predicted_j = pr.j_per_token * ep.output_tokens
        if not math.isfinite(predicted_j) or predicted_j <= 0:
            return None
        return ep.energy_j / predicted_j

    def judge(self, outlook: Outlook) -> Verdict | None:
        """The controller's epochs since the last hold against the reference's (None:
        too few of either, or no finite prediction)."""
        s, p = self.state, self.params.reference
        if (
            len(s.reference_epochs) < p.reference_min_epochs
            or len(s.controlled_epochs) < p.reference_verdict_epochs
        ):
            return None
        means = self.learner.workload.current()
        qc = [self.q(ep, outlook, means) for ep in s.controlled_epochs]
        qr = [self.q(ep, outlook, means) for ep in s.reference_epochs]
        if None in qc or None in qr:
            return None
        # In logs, with one spread pooled over both kinds (an epoch's relative noise is
        # the load's, whoever runs): a few reference epochs then do not make the
        # uncertainty whatever their own two or three values happen to spread.
        lc, lr = _logs(qc), _logs(qr)
        if len(lc) < 2 or not lr:
            return None
        mc, mr = sum(lc) / len(lc), sum(lr) / len(lr)
        dof = len(lc) + len(lr) - 2
        var = (sum((x - mc) ** 2 for x in lc) + sum((x - mr) ** 2 for x in lr)) / dof
        q_se = math.sqrt(var * (1 / len(lc) + 1 / len(lr)))
        nc = sum(ep.latencies for ep in s.controlled_epochs)
        nr = sum(ep.latencies for ep in s.reference_epochs)
        fc = sum(ep.misses for ep in s.controlled_epochs) / nc if nc else 0.0
        fr = sum(ep.misses for ep in s.reference_epochs) / nr if nr else 0.0
        miss_se = 0.0
        if nc and nr:
            # Pooled, with at least half a miss in all: no misses seen is not a zero rate.
            pooled = max(fc * nc + fr * nr, 0.5) / (nc + nr)
            miss_se = math.sqrt(pooled * (1 - pooled) * (1 / nc + 1 / nr))
        z = p.reference_z
        energy_ahead = mc + z * q_se < mr
        latency_ahead = fc <= fr + z * miss_se
        return Verdict(math.exp(mc - mr), q_se, fc, fr, miss_se, energy_ahead, latency_ahead)

    # ---- what the core asks ----------------------------------------

    def holding(self, now_s: float) -> str | None:
        """Why the reference is to run now (None: the controller may act)."""
        s, p = self.state, self.params.reference
        if not s.applies:
            return None
        if len(s.reference_epochs) < p.reference_min_epochs:
            return (
                f"measuring the reference ({len(s.reference_epochs)}/{p.reference_min_epochs} "
                "epochs)"
            )
        if now_s < s.hold_until_s:
            why = s.verdict.describe() if s.verdict is not None else "no verdict"
            return f"not measured ahead of the reference: {why}; held until {s.hold_until_s:.0f} s"
        return None

    def status(self) -> dict:
        s = self.state
        v = s.verdict
        return {
            "reference_epochs": len(s.reference_epochs),
            "controlled_epochs": len(s.controlled_epochs),
            "holds": s.holds,
            "excess_j": round(s.excess_j, 1),
            "allowance_left_j": round(self.allowance_left_j(), 1),
            "hold_until_s": s.hold_until_s if math.isfinite(s.hold_until_s) else None,
            "last_verdict": None
            if v is None
            else {
                "ahead": v.ahead,
                "j_per_token_ratio": round(v.j_ratio, 4),
                "j_per_token_log_se": round(v.log_se, 4),
                "miss_share": round(v.miss_controlled, 4),
                "reference_miss_share": round(v.miss_reference, 4),
            },
        }


def _logs(qs: Iterable[float | None]) -> list[float]:
    """The log of each q there is and that is above 0 (the others left out)."""
    return [math.log(x) for x in qs if x is not None and x > 0]
