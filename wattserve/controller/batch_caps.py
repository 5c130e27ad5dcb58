"""The batch-cap timescale: every batch_period_s, max_num_seqs (the most sequences a decode
step may carry) and max_num_batched_tokens (the prefill chunk), sized for the SLOs at the
clock in force. A clock raise or a latency guard takes a bigger chunk at once elsewhere;
here the caps grow and shrink on the period, never shrinking while a guard holds (nor the
batch cap while a queue is served). It must not import torch or the daemon, read a clock,
or touch a device or an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wattserve.controller.clock import ClockTimescale
from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits
from wattserve.controller.models import Workload
from wattserve.controller.outlook import Outlook
from wattserve.controller.part import Part
from wattserve.controller.policy import Knobs


@dataclass
class BatchCapsState:
    last_update_s: float = -math.inf
    last_chunk_change_s: float = -math.inf


class BatchCaps(Part):
    """max_num_seqs and max_num_batched_tokens on their period."""

    def __init__(self, limits: Limits, learner: Learner, clock: ClockTimescale) -> None:
        super().__init__(limits, learner)
        self.clock = clock  # its evidence: the targets missed, a first token seen
        self.state = BatchCapsState()

    def step(
        self,
        level: str,
        clock_mhz: int,
        workload: Workload,
        knobs: Knobs,
        outlook: Outlook,
        budget_w: float,
        *,
        probing: bool,
    ) -> tuple[Knobs, str | None]:
        """The caps, every batch_period_s: the knobs with them, and a note if they changed.
        probing: a quantization trial's probe holds a small chunk (left as it is)."""
        now_s = outlook.now_s
        if now_s - self.state.last_update_s < self.params.batch_caps.batch_period_s:
            return knobs, None
        self.state.last_update_s = now_s
        seqs, tokens = self.choose(
            level, clock_mhz, workload, knobs, outlook, budget_w, probing=probing
        )
        if (seqs, tokens) == (knobs.max_num_seqs, knobs.max_num_batched_tokens):
            return knobs, None
        note = f"caps {knobs.max_num_seqs}/{knobs.max_num_batched_tokens} -> {seqs}/{tokens}"
        return knobs.with_changes(max_num_seqs=seqs, max_num_batched_tokens=tokens), note

    def choose(
        self,
        level: str,
        clock: int,
        workload: Workload,
        knobs: Knobs,
        outlook: Outlook,
        budget_w: float,
        *,
        probing: bool,
    ) -> tuple[int, int]:
        """max_num_seqs: the most sequences whose decode step still meets the TPOT SLO by
        the model's mean at the top clock (so a burst queues instead of slowing everyone
        past it), never below a decode batch recent steps ran within the SLO, nor below
        twice the batch the load needs. max_num_batched_tokens: the chunk at the clock in
        force (Outlook.chunk_choice: the step bound, the TTFT rule, the energy rule; a step
        once started runs at the clock it started at, and no decision comes while it
        runs). Neither shrinks while a guard holds; the
        batch cap not while a queue is served nor when no candidate meets the targets (the
        chunk may: holding it too measured no better, see the control log); the chunk does
        not grow where only the clock holds the budget (a bigger chunk draws more power at
        the same clock)."""
        e = self.limits.engine
        # At the top clock: a guard can raise the clock to serve a burst, so the caps must
        # not shrink just because the optimizer (or the budget) holds a low clock now.
        ctx = workload.mean_context_tokens
        seqs = self._seqs_within_tpot(level, ctx, outlook.policy.tpot_slo_ms / 1000.0)
        # Never below twice the batch the load needs at the clock in force (a cap under it
        # queues requests for nothing).
        here = outlook.predict(
            level, clock, e.max_num_seqs_max, knobs.max_num_batched_tokens, workload, None
        )
        batch = here.decode_batch if here.stable else e.max_num_seqs_max
        seqs = min(e.max_num_seqs_max, max(seqs, math.ceil(2 * batch), 1))
        if abs(seqs - knobs.max_num_seqs) < max(2, 0.25 * knobs.max_num_seqs):
            seqs = knobs.max_num_seqs  # small changes are not worth a knob change
        # No candidate meets the targets: the engine needs all the capacity it has, and a
        # smaller batch cap only moves the wait into the queue. (The chunk still follows the
        # clock: at a low clock held for the budget a full chunk is a multi-second step.)
        guard_holds = outlook.guard_holds()
        if seqs < knobs.max_num_seqs and (
            self.learner.waiting_now > 0 or guard_holds or self.clock.infeasible
        ):
            seqs = knobs.max_num_seqs  # no smaller batch while a queue is being served
        tokens = outlook.chunk_choice(
            level,
            clock,
            seqs,
            min(seqs, max(1, math.ceil(batch))),
            ctx,
            knobs.max_num_batched_tokens,
            workload,
            budget_w,
        )
        if seqs < knobs.max_num_seqs and not outlook.feasible(
            outlook.predict(level, clock, seqs, tokens, workload, None), budget_w
        ):
            seqs = knobs.max_num_seqs  # a smaller batch cap must be predicted to meet targets
        tokens = self._held_chunk(tokens, knobs, outlook, budget_w, guard_holds, probing=probing)
        return seqs, tokens

    def _seqs_within_tpot(self, level: str, ctx: float, slo_s: float) -> int:
        """The most sequences whose decode step meets the TPOT SLO by the model's mean at
        the top clock, or the largest decode batch this level has run within it."""
        e = self.limits.engine
        co = self.learner.step_model(level).coefficients(self.limits.top_mhz, ctx)
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
        return max(seqs, max(ran, default=1))

    def _held_chunk(
        self,
        tokens: int,
        knobs: Knobs,
        outlook: Outlook,
        budget_w: float,
        guard_holds: bool,
        *,
        probing: bool,
    ) -> int:
        """The chunk chosen, held where it may not move now: no shrinking while a guard
        holds or unproven (and one halving at a time), no growth where only the clock holds
        the budget, none during a probe, one change per chunk_period_s."""
        p = self.params
        now_s = outlook.now_s
        if tokens < knobs.max_num_batched_tokens:
            if guard_holds or not self.clock.ttft_seen(outlook.policy):
                tokens = knobs.max_num_batched_tokens  # not while a guard holds, nor unproven
            else:
                # One halving at a time: the model's prefill costs rest on the chunks it has
                # seen (at the start, full chunks only), and a chunk far below those is an
                # extrapolation that can miss the fixed cost each extra step pays.
                tokens = max(tokens, knobs.max_num_batched_tokens // 2)
        if tokens > knobs.max_num_batched_tokens and not self.limits.hw_limit_enforces(budget_w):
            tokens = knobs.max_num_batched_tokens
        if probing:
            tokens = knobs.max_num_batched_tokens  # a trial's probe holds its small chunk
        if tokens != knobs.max_num_batched_tokens:
            # The bound moves with the estimated decode batch, whose noise must not flip
            # the chunk every period: one change per chunk_period_s (a clock raise or a
            # guard takes the bigger chunk at once, elsewhere).
            if now_s - self.state.last_chunk_change_s < p.batch_caps.chunk_period_s:
                tokens = knobs.max_num_batched_tokens
            else:
                self.state.last_chunk_change_s = now_s
        return tokens
