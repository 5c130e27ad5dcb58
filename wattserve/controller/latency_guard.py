"""The latency guard: a growing waiting queue, a request waiting half its TTFT SLO, a queue
predicted to get its first tokens late at this clock (feed-forward), a running batch rising
fast towards the engine's largest batch cap (a burst: once the cap is full every arrival
queues for a slot, and only a shorter TPOT frees slots sooner), or a measured TTFT or
TPOT miss raises the clock at once (and the batch caps where the batch is full; a queue
takes the prefill chunk that serves it soonest, at the top clock too), never above what
the budget allows, turns decode pacing off where there is no TPOT headroom to trade, and
holds that clock as a floor. It overrides the models; it must not import torch or the
daemon, read a clock, or touch a device or an engine.

Descents earn their way: after the optimizer lowers the clock or lengthens the decode
interval, the latencies measured over the next descent_watch_s are watched; once their
descent_watch_percentile comes within descent_guard_fraction of an SLO (before a miss,
where the model under-predicts at the lower setting) the descent is reverted at once and
the lower clock (or the longer interval) barred for descent_bar_s. The adaptive margin the
optimizer's predictions carry (Learner.error_factor) then keeps such a clock out of reach
for as long as its measured ratios stay in the window.

States: no floor -- fired --> floor held for guard_hold_s (no new step for
guard_cooldown_s) --> no floor; a power guard firing drops the floor and any bar (power
wins). Descent watch: none -- optimizer descends --> watching (since the latest descent of a
chain, reverting to the setting before its first) -- descent_watch_s without measured
latencies near the SLOs --> none (earned); -- near --> reverted, bar held descent_bar_s.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from wattserve.controller.guard_state import DescentWatch, LatencyGuardState
from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits
from wattserve.controller.models import Surge, Workload, percentile_of
from wattserve.controller.outlook import Outlook
from wattserve.controller.part import Part
from wattserve.controller.policy import Knobs, Policy
from wattserve.controller.signals import EngineStats, Telemetry
from wattserve.controller.state import Choice, ControllerState, Reason


@dataclass(frozen=True)
class Pressure:
    """What presses on latency at one observation (LatencyGuard._pressure)."""

    ttft_miss: list[float]  # measured TTFTs over the SLO (s)
    tpot_miss: list[float]  # measured TPOTs over the SLO (s)
    hist: list[int]  # the waiting queue's lengths, latest last
    growing: bool  # the waiting queue grew queue_growth_ticks observations in a row
    long_wait: bool  # a request has waited half its TTFT SLO
    clock: int  # the clock in force (MHz)
    level: str  # the quantization level in force
    late_s: float  # a first token later than this misses slo_margin x the TTFT SLO
    drain_s: float | None  # when the queue's newest would get its first token
    queue_late: bool  # drain_s past late_s
    cap_bound: bool  # a burst filling the engine's largest batch cap
    surge: Surge | None  # arrivals surging

    @property
    def fires(self) -> bool:
        return bool(
            self.growing
            or self.long_wait
            or self.cap_bound
            or self.queue_late
            or self.ttft_miss
            or self.tpot_miss
            or self.surge
        )


class LatencyGuard(Part):
    """Queues and measured latency against the SLOs; the clock floor it holds."""

    def __init__(self, limits: Limits, learner: Learner) -> None:
        super().__init__(limits, learner)
        self.state = LatencyGuardState(
            waiting_hist=deque(maxlen=max(2, limits.params.latency_guard.queue_growth_ticks + 1)),
            running_hist=deque(maxlen=max(2, limits.params.latency_guard.guard_rise_ticks + 1)),
        )

    def note_queue(self, num_waiting: int, num_running: int, now_s: float) -> None:
        """The queue now. A floor a queue put up lets go once guard_release_s have passed
        and the queue has stayed empty for the waiting history, with the running batch
        off the engine's cap: it was there to drain the queue, not to run the load."""
        s = self.state
        s.waiting_hist.append(num_waiting)
        s.running_hist.append(num_running)
        if (
            s.queue_floor
            and now_s < s.floor_until_s
            and now_s - s.last_fired_s >= self.params.latency_guard.guard_release_s
            and len(s.waiting_hist) == s.waiting_hist.maxlen
            and not any(s.waiting_hist)
            and not self.near_engine_cap(num_running)
        ):
            s.floor_until_s = s.hold_until_s = now_s

    def note_latencies(
        self, ttft_s: tuple[float, ...], tpot_s: tuple[float, ...], now_s: float
    ) -> None:
        """Latencies measured now: evidence for or against a descent on probation (every
        first token and every finished request after it: descents come only with no
        queue, so their prefill or last tokens ran at the lower setting)."""
        w = self.state.watch
        if w is not None:
            w.ttft_ms.extend(1000.0 * x for x in ttft_s)
            w.tpot_ms.extend(1000.0 * x for x in tpot_s)

    def note_applied(
        self, previous: Knobs | None, knobs: Knobs, state: ControllerState, now_s: float
    ) -> None:
        """The knobs decided now, after `previous`: a descent by the optimizer (a lower
        clock or a longer decode interval) starts a watch; a return to where the watch
        began ends it."""
        if previous is None:
            return
        top = self.limits.top_mhz
        clock_before = previous.sm_clock_mhz or top
        clock_now = knobs.sm_clock_mhz or top
        s = self.state
        w = s.watch
        if w is not None and (
            now_s - w.since_s > self.params.latency_guard.descent_watch_s
            or (clock_now >= w.from_mhz and knobs.decode_interval_ms <= w.from_interval_ms)
        ):
            s.watch = w = None  # earned, or back where it began
        descended = state is ControllerState.TRACKING and (
            clock_now < clock_before or knobs.decode_interval_ms > previous.decode_interval_ms
        )
        if not descended:
            return
        if w is None:
            s.watch = DescentWatch(clock_before, previous.decode_interval_ms, now_s)
        else:
            # Another step of a chain not yet earned: watched afresh, reverted to its start.
            s.watch = DescentWatch(w.from_mhz, w.from_interval_ms, now_s)

    def floor(self, now_s: float) -> int | None:
        """See LatencyGuardState.floor."""
        return self.state.floor(now_s)

    def fired_within(self, now_s: float, seconds: float) -> bool:
        return self.state.fired_within(now_s, seconds)

    def holding(self, now_s: float) -> bool:
        """See LatencyGuardState.holding."""
        return self.state.holding(now_s)

    def release_floor(self) -> None:
        """Transition: the power guard fired; power wins over latency."""
        s = self.state
        s.floor_mhz = s.bar_mhz = s.pace_bar_ms = None
        s.watch = None

    def check(
        self,
        telemetry: Telemetry,
        stats: EngineStats,
        knobs: Knobs,
        outlook: Outlook,
        ceiling: int | None,
        budget_w: float,
        workload: Workload,
    ) -> Choice | None:
        """The guard's step up (clock, caps, pacing off), or None: nothing to raise."""
        p = self.params
        policy = outlook.policy
        now_s = outlook.now_s
        ttft_miss = [x for x in stats.ttft_s if x * 1000.0 > policy.ttft_slo_ms]
        tpot_miss = [x for x in stats.tpot_s if x * 1000.0 > policy.tpot_slo_ms]
        if not (ttft_miss or tpot_miss):
            # (A measured miss is the steps below's to answer, harder; a descent on
            # probation is then reverted at the next observation, within their cooldown.)
            reverted = self._revert_descent(telemetry, knobs, outlook, ceiling, budget_w)
            if reverted is not None:
                return reverted
        q = self._pressure(stats, knobs, outlook, budget_w, workload, ttft_miss, tpot_miss)
        if not q.fires:
            return None
        if self.fired_within(now_s, p.latency_guard.guard_cooldown_s):
            # Still within the cooldown of the last step up: keep its floor, no new step.
            return None
        target = self._target_clock(
            q, telemetry, stats, knobs, outlook, ceiling, budget_w, workload
        )
        seqs, tokens = self._caps(q, target, stats, knobs, outlook, budget_w, workload)
        # Decode pacing trades TPOT headroom for energy: a TPOT miss or a long wait leaves
        # none to trade, at the top clock too, and a surge none to keep (a paced request
        # holds its slot longer while the arrivals fill the others). (A queue alone leaves
        # it: the engine does not pace while requests wait.)
        pace_off = knobs.decode_interval_ms > 0 and bool(
            q.tpot_miss or q.long_wait or q.cap_bound or q.surge
        )
        unchanged = (target, seqs, tokens) == (
            q.clock,
            knobs.max_num_seqs,
            knobs.max_num_batched_tokens,
        )
        if unchanged and not pace_off:
            return None  # nothing left to raise: let the optimizer keep its choice
        self._hold_floor(target, now_s, queue=not (q.ttft_miss or q.tpot_miss or q.long_wait))
        code, what = self._what(q, stats, policy)
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
            + (f"clock {q.clock} -> {target} MHz" if target != q.clock else f"clock {q.clock} MHz")
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
            + f"; floor held {p.latency_guard.guard_hold_s:g} s"
            + ("; decode pacing off" if pace_off else ""),
        )

    def _pressure(
        self,
        stats: EngineStats,
        knobs: Knobs,
        outlook: Outlook,
        budget_w: float,
        workload: Workload,
        ttft_miss: list[float],
        tpot_miss: list[float],
    ) -> Pressure:
        """What presses on latency now: the queue, the misses, a burst, a surge."""
        p, lim = self.params, self.limits
        policy = outlook.policy
        hist = list(self.state.waiting_hist)
        k = p.latency_guard.queue_growth_ticks
        growing = (
            stats.num_waiting > 0
            and len(hist) > p.latency_guard.queue_growth_ticks
            and all(b > a for a, b in zip(hist[-k - 1 : -1], hist[-k:], strict=True))
        )
        long_wait = (
            stats.oldest_waiting_s is not None
            and stats.oldest_waiting_s * 1000.0 > 0.5 * policy.ttft_slo_ms
        )
        clock = knobs.sm_clock_mhz or lim.top_mhz
        # Feed-forward on the queue: the prompts waiting now, prefilled in chunks beside
        # the running batch at this clock, would bring the newest past slo_margin x its
        # TTFT SLO (the oldest has already waited): step up before anyone misses.
        level = knobs.quant_level or lim.engine.full_precision_level
        late_s = p.targets.slo_margin * policy.ttft_slo_ms / 1000.0
        drain_s = outlook.drain_s(level, clock, stats, knobs, workload)
        queue_late = drain_s is not None and drain_s > late_s
        # A burst filling the engine: the running batch rose guard_rise_factor x over the
        # last guard_rise_ticks observations to guard_cap_share of the engine's largest cap.
        # Once the cap is full every arrival queues for a slot, and only a shorter TPOT
        # (the top clock, no pacing) frees slots sooner: act before anyone waits. Only
        # where the board limit holds the budget: below its range the clock alone holds
        # it, and a jump on a forecast risks a peak the power model has not seen.
        runs = self.state.running_hist
        cap_bound = (
            lim.hw_limit_enforces(budget_w)
            and self.near_engine_cap(stats.num_running)
            and knobs.max_num_seqs >= lim.engine.max_num_seqs_max
            and len(runs) == runs.maxlen
            and stats.num_running >= p.latency_guard.guard_rise_factor * max(runs[0], 1)
        )
        # Arrivals surging (Surge: the last surge_window_s brought far more requests than
        # the rate estimated before them gives): a burst's prompts are admitted into the
        # running batch in chunks, so on an engine with room a queue shows only once the
        # batch is full, seconds in. Step up now, pacing off, and the floor goes with the
        # surge (a queue's floor).
        surge = self.learner.workload.surge
        return Pressure(
            ttft_miss=ttft_miss,
            tpot_miss=tpot_miss,
            hist=hist,
            growing=growing,
            long_wait=long_wait,
            clock=clock,
            level=level,
            late_s=late_s,
            drain_s=drain_s,
            queue_late=queue_late,
            cap_bound=cap_bound,
            surge=surge,
        )

    def _target_clock(
        self,
        q: Pressure,
        telemetry: Telemetry,
        stats: EngineStats,
        knobs: Knobs,
        outlook: Outlook,
        ceiling: int | None,
        budget_w: float,
        workload: Workload,
    ) -> int:
        """The clock the guard steps up to, never above what the budget allows."""
        p, lim = self.params, self.limits
        clock, level, late_s = q.clock, q.level, q.late_s
        top = ceiling if ceiling is not None else lim.top_mhz
        # The budget wins over latency: never above what the power model says fits it.
        top = min(top, max(outlook.safe_clock(budget_w, telemetry.gpu_temp_c), lim.snap(clock)))
        # A request already waiting half its TTFT SLO cannot wait for a staircase, nor can
        # a queue while the arrivals surge (the models, fitted on the calm before, call the
        # staircase's clocks enough: the rate they read still trails, and the output rate,
        # the one served, trails most): jump to the top; otherwise step up by
        # guard_clock_steps candidates, or (a late queue) to the lowest clock predicted to
        # drain it in time.
        jump = q.long_wait or q.cap_bound or (q.surge is not None and (q.growing or q.queue_late))
        step = len(lim.clocks_mhz) if jump else p.latency_guard.guard_clock_steps
        target = min(lim.move(lim.snap(clock), step), top)
        if q.queue_late and not jump:
            drain_at = top
            for f in lim.clocks_mhz:
                if f <= clock or f > top:
                    continue
                d = outlook.drain_s(level, f, stats, knobs, workload)
                if d is not None and d <= late_s:
                    drain_at = f
                    break
            if not (q.growing or q.ttft_miss or q.tpot_miss):
                target = min(lim.move(lim.snap(clock), 1), top)
            target = max(target, drain_at)
        return target

    def _caps(
        self,
        q: Pressure,
        target: int,
        stats: EngineStats,
        knobs: Knobs,
        outlook: Outlook,
        budget_w: float,
        workload: Workload,
    ) -> tuple[int, int]:
        """The batch caps that go with the step up: max_num_seqs, max_num_batched_tokens."""
        p, lim = self.params, self.limits
        clock, level, late_s = q.clock, q.level, q.late_s
        seqs = knobs.max_num_seqs
        if (
            (q.growing or q.long_wait)
            and stats.num_running >= knobs.max_num_seqs
            and not q.tpot_miss
        ):
            seqs = min(lim.engine.max_num_seqs_max, max(seqs + 1, math.ceil(seqs * 1.5)))
        tokens = knobs.max_num_batched_tokens
        trained = self.learner.step_model(level).samples >= p.learning.learning_min_steps
        if trained and lim.hw_limit_enforces(budget_w):
            # Never a smaller chunk here (the next batch-cap update may shrink it once the
            # guard has let go), and none bigger where only the clock holds the budget: a
            # bigger chunk draws more. A faster clock takes a bigger chunk within the same
            # step time; a queue (not a TPOT miss) takes the chunk that serves it soonest,
            # at the top clock too, where the clock has nothing left to give.
            if target > clock:
                bigger = outlook.chunk_cap(
                    level, target, max(1, stats.num_running), workload.mean_context_tokens
                )
                tokens = max(tokens, bigger)
            if (q.growing or q.long_wait or q.cap_bound or q.queue_late) and not q.tpot_miss:
                drain = outlook.chunk_to_drain(level, target, stats, tokens, workload, late_s)
                tokens = max(tokens, drain)
        return seqs, tokens

    def _what(self, q: Pressure, stats: EngineStats, policy: Policy) -> tuple[Reason, str]:
        """The reason code and what the guard answers, in words."""
        lim = self.limits
        k = self.params.latency_guard.queue_growth_ticks
        queued = q.growing or q.long_wait or q.cap_bound or q.queue_late
        if queued or not (q.ttft_miss or q.tpot_miss):  # a queue, or a surge alone
            code = Reason.QUEUE_GROWTH
            if q.cap_bound and not q.long_wait:
                what = (
                    f"{stats.num_running} running at the engine's cap of "
                    f"{lim.engine.max_num_seqs_max}: arrivals queue for a slot"
                )
            elif q.growing:
                what = f"waiting queue growing ({'→'.join(map(str, q.hist[-k - 1 :]))})"
            elif q.long_wait:
                what = f"oldest request waiting {stats.oldest_waiting_s:.2f} s"
            elif q.queue_late:
                what = (
                    f"{stats.num_waiting} waiting would see their first token in "
                    f"{1000.0 * (q.drain_s or 0.0):.0f} ms at {q.clock} MHz"
                )
            else:
                what = ""
            if q.surge is not None and not (q.cap_bound or q.long_wait):
                what = f"{what}, {q.surge.describe()}" if what else q.surge.describe()
        else:
            code = Reason.SLO_MISS
            parts = []
            if q.ttft_miss:
                parts.append(f"TTFT {max(q.ttft_miss) * 1000:.0f} ms > {policy.ttft_slo_ms:g} ms")
            if q.tpot_miss:
                parts.append(f"TPOT {max(q.tpot_miss) * 1000:.0f} ms > {policy.tpot_slo_ms:g} ms")
            what = "measured " + ", ".join(parts)
        return code, what

    def _revert_descent(
        self,
        telemetry: Telemetry,
        knobs: Knobs,
        outlook: Outlook,
        ceiling: int | None,
        budget_w: float,
    ) -> Choice | None:
        """A descent on probation whose measured latencies came within
        descent_guard_fraction of an SLO: back to the setting before it, at once, and that
        setting's clock (and interval) held as a bar for descent_bar_s; None otherwise."""
        p, lim, s = self.params, self.limits, self.state
        w = s.watch
        now_s = outlook.now_s
        if w is None:
            return None
        if now_s - w.since_s > p.latency_guard.descent_watch_s:
            s.watch = None  # the descent has earned its way
            return None
        policy = outlook.policy
        pct = p.latency_guard.descent_watch_percentile
        ttft_ms = percentile_of(w.ttft_ms, pct) if w.ttft_ms else 0.0
        tpot_ms = percentile_of(w.tpot_ms, pct) if w.tpot_ms else 0.0
        near_ttft = ttft_ms >= p.latency_guard.descent_guard_fraction * policy.ttft_slo_ms
        near_tpot = tpot_ms >= p.latency_guard.descent_guard_fraction * policy.tpot_slo_ms
        if not (near_ttft or near_tpot):
            return None
        s.watch = None
        clock = knobs.sm_clock_mhz or lim.top_mhz
        top = ceiling if ceiling is not None else lim.top_mhz
        top = min(top, max(outlook.safe_clock(budget_w, telemetry.gpu_temp_c), lim.snap(clock)))
        target = max(clock, min(w.from_mhz, top))
        interval = min(knobs.decode_interval_ms, w.from_interval_ms)
        s.last_fired_s = now_s
        s.hold_until_s = now_s + p.latency_guard.guard_hold_s
        s.bar_mhz = target
        s.pace_bar_ms = interval
        s.bar_until_s = now_s + p.latency_guard.descent_bar_s
        parts = []
        if near_ttft:
            parts.append(f"TTFT p{pct:g} {ttft_ms:.0f} ms")
        if near_tpot:
            parts.append(f"TPOT p{pct:g} {tpot_ms:.0f} ms")
        return Choice(
            ControllerState.GUARD_LATENCY,
            knobs.with_changes(sm_clock_mhz=target, decode_interval_ms=interval),
            Reason.DESCENT_REVERTED,
            f"measured {', '.join(parts)} since the descent, within "
            f"{p.latency_guard.descent_guard_fraction:g} x the SLO: clock {clock} -> {target} MHz, "
            f"decode interval {knobs.decode_interval_ms:g} -> {interval:g} ms; "
            f"lower settings barred {p.latency_guard.descent_bar_s:g} s",
        )

    def _hold_floor(self, target_mhz: int, now_s: float, queue: bool) -> None:
        """Transition: fired; the clock stepped up to is the floor for guard_hold_s."""
        s = self.state
        s.last_fired_s = now_s
        s.floor_mhz = target_mhz
        s.floor_until_s = s.hold_until_s = now_s + self.params.latency_guard.guard_hold_s
        s.queue_floor = queue
