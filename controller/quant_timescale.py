"""The controller's slowest timescale: which weight quantization level runs.

A known level replaces the current one for a predicted gain, compared on the levels' own
models; a level never run here is tried once at a calm moment (or when the current one
cannot cope), judged step by step against the level before's model, and kept only if then
predicted better; bench quant's speed table orders the trials and rules where the models
have not seen the batches running (QuantTimescale._quant_step has the rules and why).
This is a mixin of controller.controller.Controller: it reads and writes the
controller's state and calls its prediction helpers, and lives in its own module for
size, not for reuse. Like the controller it must not import torch or the daemon, read a
clock, or touch a device or an engine.
"""

from __future__ import annotations

import math

from controller.models import Prediction, Workload
from controller.policy import Knobs
from controller.signals import StepRecord
from controller.state import Choice, ControllerState, Reason


class QuantTimescale:
    """The quantization-level methods of Controller (see the module docstring)."""

    def _init_quant_state(self) -> None:
        """The timescale's own state (Controller.__init__ calls this)."""
        self._last_quant_switch_s: float | None = None
        self._explored: set[str] = set()
        self._retried_s: dict[str, float] = {}  # when a known level was last tried again
        self._quant_left_s: dict[str, float] = {}  # when each level was last switched away from
        self._exploring: tuple[str, str] | None = None  # (level tried, level before)
        self._exploring_stuck = False  # the trial began because the level before could not cope
        # The trial's steps: measured seconds, what the level before would have taken.
        self._trial_started_s = -math.inf
        self._trial_steps = 0
        self._trial_measured_s = 0.0
        self._trial_expected_s = 0.0
        self._probe_chunk_from: int | None = None  # the chunk before a trial's probe
        self._slow_here_s: dict[str, float] = {}  # levels whose trial measured them slower

    def _judge_trial_step(self, step: StepRecord, clock_mhz: int) -> None:
        """During a trial, add a step of the level tried and what the level before's model
        predicts for the same step at the same clock."""
        if self._exploring is None:
            return
        tried, before = self._exploring
        model = self.learner.step_models.get(before)
        if step.quant_level != tried or model is None:
            return
        if model.samples < self.params.learning_min_steps:
            return
        expected = model.coefficients(clock_mhz).step_s(
            step.prefill_tokens, step.decode_tokens, step.context_tokens
        )
        self._trial_steps += 1
        self._trial_measured_s += step.duration_s
        self._trial_expected_s += expected

    def _start_trial(self, tried: str, before: str, stuck: bool, now_s: float) -> None:
        self._exploring = (tried, before)
        self._exploring_stuck = stuck
        self._trial_started_s = now_s
        self._trial_steps = 0
        self._trial_measured_s = self._trial_expected_s = 0.0

    def _trial_evidence(self) -> tuple[bool, bool]:
        """(enough steps of the trial measured to judge it, those steps slower than
        quant_trial_slowdown_max x what the level before's model predicts for them)."""
        p = self.params
        enough = (
            self._trial_steps >= p.quant_trial_min_steps
            and self._trial_measured_s >= p.quant_trial_evidence_s
        ) or self._trial_measured_s >= 2 * p.quant_trial_evidence_s  # one long step will do
        slow = self._trial_measured_s > p.quant_trial_slowdown_max * self._trial_expected_s
        return enough, slow

    def _trial_vouched(self) -> bool:
        """The trial's steps so far ran within the slowdown bound, enough of them to judge."""
        enough, slow = self._trial_evidence()
        return enough and not slow

    def _trial_verdict(self, base: Knobs, now_s: float) -> Choice | None:
        """End a trial early on what its steps measured: much slower than the level before
        would have been, or still learning long after its dwell. Back to the level before."""
        if self._exploring is None:
            return None
        p = self.params
        tried, before = self._exploring
        why = None
        enough, slow = self._trial_evidence()
        if enough and not slow and self._probe_chunk_from is not None:
            # The probe's steps ran within the bound: the trial goes on at the full chunk.
            chunk, self._probe_chunk_from = self._probe_chunk_from, None
            return Choice(
                ControllerState.TRACKING,
                base.with_changes(max_num_batched_tokens=chunk),
                Reason.OPTIMIZE,
                f"trial of {tried}: its first {self._trial_steps} steps within "
                f"{p.quant_trial_slowdown_max:g}x {before}'s model; chunk "
                f"{base.max_num_batched_tokens} -> {chunk}",
            )
        if enough and slow:
            ratio = self._trial_measured_s / max(self._trial_expected_s, 1e-9)
            why = (
                f"its {self._trial_steps} steps took {ratio:.1f}x what {before}'s model "
                "predicts for them"
            )
            self._slow_here_s[tried] = now_s
        elif (
            now_s - self._trial_started_s >= p.quant_trial_max_s
            and self.learner.step_model(tried).samples < p.learning_min_steps
        ):
            why = (
                f"only {self.learner.step_model(tried).samples} steps in "
                f"{now_s - self._trial_started_s:.0f} s"
            )
        if why is None:
            return None
        self._exploring = None
        self._last_quant_switch_s = now_s
        self._quant_left_s[tried] = now_s
        return Choice(  # _finish restores a chunk the trial's probe cut
            ControllerState.TRACKING,
            base.with_changes(quant_level=before),
            Reason.QUANT_SWITCH,
            f"quantization {tried} -> {before}: trial of {tried} aborted, {why}",
        )

    def _best_allowed_level(self, allowed: tuple[str, ...], current: str) -> str:
        if self.engine.full_precision_level in allowed:
            return self.engine.full_precision_level
        return allowed[0] if allowed else current

    def _quant_step(
        self,
        base: Knobs,
        allowed: tuple[str, ...],
        workload: Workload,
        temp: float | None,
        now_s: float,
        budget_w: float,
        ceiling: int | None,
    ) -> Choice | None:
        """The slowest timescale. A known level replaces the current one after
        quant_dwell_s for a quant_gain_min_pct predicted gain, compared only at clocks each
        level was seen at (no extrapolation across levels) and only where its model has
        seen batches like the largest of the last quant_peak_window_s (a model fitted on
        small batches flatters a level at large ones). A level never run is tried for
        quant_explore_dwell_s when the load is calm, and kept only if then predicted
        better. When the current level cannot meet the targets at any trusted clock (and a
        queue or a latency guard within quant_stuck_busy_s says so too), both happen after
        quant_explore_dwell_s and without the gain threshold, and a level
        measured faster whose model has not seen the batches running now is tried again.
        Nothing switches while requests wait or a latency guard holds (unless the level
        has not coped for quant_stuck_busy_s); a switch keeps the clock in force when that
        is higher (the optimizer walks it down)."""
        p = self.params
        level = base.quant_level or self.engine.full_precision_level
        if self._last_quant_switch_s is None:
            self._last_quant_switch_s = now_s  # the dwell starts with the first tracking
            return None
        since = now_s - self._last_quant_switch_s

        def best_for(
            lv: str, compare: bool, other: str | None = None, batch: int | None = None
        ) -> Prediction | None:
            # Levels are compared over the clocks either has been trusted at: a level tried
            # only briefly (near the top clock) starts from the clock sensitivity learned
            # for the other one (StepTimeModel.as_prior), so it is judged where the other
            # already runs, not only where it was tried.
            clocks = self.outlook().clock_range(lv, ceiling)
            if compare:
                against = self.outlook().clock_range(other or level, ceiling)
                clocks = sorted(set(clocks) | set(against))
            preds = [
                self.outlook().predict(
                    lv, f, base.max_num_seqs, base.max_num_batched_tokens, workload, temp
                )
                for f in clocks
            ]
            ok = [
                pr
                for pr in preds
                if self.outlook().feasible(pr, budget_w)
                and (lv == level or self.outlook().batch_trusted(pr, batch))
            ]
            return min(ok, key=self.outlook().score) if ok else None

        def switch(to: Prediction, why: str) -> Choice:
            self._last_quant_switch_s = now_s
            self._quant_left_s[level] = now_s
            # A new level starts no lower than the clock in force: its model is the less
            # tried one, so the clock optimizer walks it down afterwards (slowly), rather
            # than the switch doing both at once.
            clock = to.sm_clock_mhz
            here = base.sm_clock_mhz or self.device.sm_clock_max_mhz
            if here > clock:
                at_here = self.outlook().predict(
                    to.quant_level,
                    here,
                    base.max_num_seqs,
                    base.max_num_batched_tokens,
                    workload,
                    temp,
                )
                if self.outlook().within_budget(at_here, budget_w):
                    clock = here
            return Choice(
                ControllerState.TRACKING,
                base.with_changes(quant_level=to.quant_level, sm_clock_mhz=clock),
                Reason.QUANT_SWITCH,
                f"quantization {level} -> {to.quant_level}: {why} [{to.describe()}]",
                to,
            )

        def headroom(lv: str) -> Prediction:
            # At the highest clock the budget allows.
            top = ceiling if ceiling is not None else self.device.sm_clock_max_mhz
            top = min(top, self.outlook().safe_clock(budget_w, temp))
            return self.outlook().predict(
                lv, top, base.max_num_seqs, base.max_num_batched_tokens, workload, temp
            )

        def load(pr: Prediction) -> float:
            if not pr.stable:
                return math.inf
            pol = self._policy
            return max(pr.ttft_ms / pol.ttft_slo_ms, pr.tpot_ms / pol.tpot_slo_ms)

        if self._exploring is not None:
            tried, before = self._exploring
            learned = self.learner.step_model(tried).samples >= p.learning_min_steps
            if since < p.quant_explore_dwell_s or not learned:
                return None
            # The trial is over: keep the level tried only if it is predicted better.
            self._exploring = None
            self._last_quant_switch_s = now_s
            # Both over the same clocks: the union of where either has been trusted.
            mine, theirs = best_for(tried, True, before), best_for(before, True, tried)
            if theirs is not None and (
                mine is None or self.outlook().score(theirs) <= self.outlook().score(mine)
            ):
                if self._trial_measured_s > self._trial_expected_s > 0.0:
                    # Slower than the level before, if not by enough to end the trial early:
                    # the table that ranked it faster is wrong here too.
                    self._slow_here_s[tried] = now_s
                return switch(theirs, f"the trial of {tried} predicts no gain")
            if mine is None and theirs is None:
                # Neither meets the targets: keep the one with more latency headroom at the
                # top clock the budget allows (the level tried only if clearly ahead).
                ours, back = headroom(tried), headroom(before)
                if not load(ours) < 0.9 * load(back):
                    return switch(
                        back,
                        f"neither meets the targets; {tried} has no more headroom than {before}",
                    )
            return None
        if workload.output_tokens_per_s <= 0 or len(allowed) < 2:
            return None
        current = best_for(level, False)
        if current is not None:
            self._stuck_since_s = None
        elif self._stuck_since_s is None:
            self._stuck_since_s = now_s
        # Stuck: no trusted clock of this level has met the targets for quant_stuck_s, and
        # the requests say so too (a queue, or a latency guard within quant_stuck_busy_s).
        # The model's word alone is not enough: on the real engine fp32 was predicted short
        # of the TTFT margin at the top clock while its requests met the SLO, and the
        # escape tried bf16 under load with the full chunk, at seconds per prefill step.
        troubled = (
            self.learner.waiting_now > 0
            or now_s - self.latency_guard.state.last_fired_s < p.quant_stuck_busy_s
        )
        stuck = (
            self._stuck_since_s is not None
            and now_s - self._stuck_since_s >= p.quant_stuck_s
            and troubled
        )
        busy = (
            self.learner.waiting_now > 0
            or now_s - self.latency_guard.state.last_fired_s < p.guard_hold_s
        )
        stuck_for = now_s - self._stuck_since_s if self._stuck_since_s is not None else 0.0
        stuck_long = stuck_for >= max(p.quant_stuck_s, p.quant_stuck_busy_s)
        if busy and not stuck_long:
            # Not while a queue is served: a switch costs, its gain rests on the less tried
            # level's model, and the percentile ratios start again; the clock serves a
            # queue faster. Unless the level has not coped for quant_stuck_busy_s.
            return None

        def hint(lv: str) -> tuple[float, int]:
            # Fastest measured first, then the lightest weights.
            opt = self._levels.get(lv)
            speed = opt.decode_tok_s if opt is not None and opt.decode_tok_s else 0.0
            return (-speed, opt.weight_bytes if opt is not None else 0)

        # A level the table ranks slower than a level already run here, adopted while the
        # batches were small (where lighter weights may be cheaper), is left for that level
        # once batches of quant_table_batch_min run: there the table's batch-16 speed says
        # more than a model fitted on small batches. (On a diurnal ramp, int8 tried in the
        # calm of the morning held the peak at the top clock for a minute.)
        mine = hint(level)[0]
        table_rules = mine < 0.0 and self.learner.running_peak >= p.quant_table_batch_min
        if table_rules:
            ahead = [
                lv
                for lv in allowed
                if lv != level
                and lv in self.learner.step_models
                and self.learner.step_models[lv].samples >= p.learning_min_steps
                and hint(lv)[0] < mine
                and now_s - self._slow_here_s.get(lv, -math.inf) >= p.quant_slow_retry_s
            ]
            if ahead and since >= p.quant_explore_dwell_s:
                lv = min(ahead, key=hint)
                to = best_for(lv, True) or headroom(lv)
                return switch(
                    to,
                    f"batches of {self.learner.running_peak} run, where the speed table ranks {lv} "
                    f"ahead of {level}",
                )
        if since >= (p.quant_explore_dwell_s if stuck else p.quant_dwell_s):
            # Only levels whose models have seen batches like the largest of the last
            # quant_peak_window_s: the level is the slow knob, and the load comes back.
            peak = self.learner.running_peak
            # Where the table rules (above), not to a level it ranks slower: no flip-flop.
            known = [
                best_for(lv, True, batch=peak)
                for lv in allowed
                if lv != level
                and lv in self.learner.step_models
                and self.learner.step_models[lv].samples >= p.learning_min_steps
                and not (table_rules and mine < hint(lv)[0] < 0.0)
            ]
            known = [pr for pr in known if pr is not None]
            if not known and stuck:
                # Nothing is predicted to meet the targets: the level with the most latency
                # headroom at the highest clock the budget allows, if clearly ahead.
                others = [
                    pr
                    for pr in (
                        headroom(lv)
                        for lv in allowed
                        if lv != level
                        and lv in self.learner.step_models
                        and self.learner.step_models[lv].samples >= p.learning_min_steps
                    )
                    if self.outlook().batch_trusted(pr, peak)
                ]
                if others:
                    ahead = min(others, key=load)
                    if load(ahead) < 0.9 * load(headroom(level)):
                        return switch(
                            ahead,
                            f"no level meets the targets; {ahead.quant_level} has the most "
                            "headroom at the top clock",
                        )
            if known:
                best = min(known, key=self.outlook().score)
                cur = self.outlook().score(current) if current is not None else math.inf
                if stuck:
                    return switch(best, f"{level} cannot meet the targets at any trusted clock")
                if current is None:
                    return None  # a transient miss is the guards' business, not a reason
                # Going back to a level left recently needs twice the gain (no flip-flop).
                left_s = now_s - self._quant_left_s.get(best.quant_level, -math.inf)
                need = p.quant_gain_min_pct * (2.0 if left_s < 3 * p.quant_dwell_s else 1.0)
                if self.outlook().score(best) < cur * (1.0 - need / 100.0):
                    gain = (1 - self.outlook().score(best) / cur) * 100
                    return switch(best, f"predicted {gain:.0f}% better after a {since:.0f} s dwell")

        # Levels never run have no model of their own: try each once. When the current level
        # cannot cope, a level measured faster (bench quant's decode speed) whose model has
        # not seen batches like those running now is tried again at this load (at most once
        # per quant_peak_window_s): its model, not trusted there, learns them.
        unexplored = [
            lv
            for lv in allowed
            if lv != level and lv not in self._explored and lv not in self.learner.step_models
        ]
        what = "never measured here"

        def faster(lv: str) -> bool:
            return hint(lv)[0] < hint(level)[0] or hint(lv)[0] == 0.0

        if stuck and not any(faster(lv) for lv in unexplored):
            # An escape wants a level the table calls faster: one tried at small batches
            # before this load comes ahead of a never-run level the table calls slower (a
            # burst escaped from fp32 to int8 while bf16, tried at a calm moment, waited).
            retry = [
                lv
                for lv in allowed
                if lv != level
                and lv in self.learner.step_models
                and self.learner.running_now > self.outlook().trusted_batch(lv)
                and now_s - self._retried_s.get(lv, -math.inf) >= p.quant_peak_window_s
                and now_s - self._slow_here_s.get(lv, -math.inf) >= p.quant_slow_retry_s
                and faster(lv)
            ]
            if retry or not unexplored:
                unexplored = retry
                what = f"not measured at batches of {self.learner.running_now} yet"
        # A level whose prefill the table measured slower than the level in force's beyond
        # the trial's slowdown bound is not tried: each of its prefill steps would hold the
        # requests behind it longer than a trial tolerates, before any verdict can come (on
        # a CPU without bf16 instructions, bf16 and int8 prefill ran about 6x slower than
        # fp32's, and a 32-token probe step of int8 took seconds).
        unexplored = [lv for lv in unexplored if not self._prefill_slower(lv, level)]
        # A level the table ranks no faster than one measured slower here is not tried: the
        # table's error is the machine's (on a CPU without bf16 or int8 instructions, their
        # trials measured them 1.5-4x slower than fp32), and each trial costs latency until
        # its verdict.
        slow_known = [
            hint(lv)[0]
            for lv, t in self._slow_here_s.items()
            if now_s - t < p.quant_slow_retry_s and hint(lv)[0] < 0.0
        ]
        if slow_known:
            unexplored = [lv for lv in unexplored if hint(lv)[0] < min(slow_known)]
        # The table's speed is a batch-16 figure: where batches like that run, a calm trial of
        # a level it ranks slower than the level in force is not made (int8 on steady load
        # here: 10 s of a level that could not keep up at the clock in force, and the clock
        # raised to the top for it). At smaller batches, where lighter weights may be
        # cheaper, it is.
        if not stuck and table_rules:
            unexplored = [lv for lv in unexplored if hint(lv)[0] < mine or hint(lv)[0] == 0.0]
        steady_s = now_s - self._feasible_since_s if self._feasible_since_s is not None else 0.0
        calm = now_s - self.latency_guard.state.last_fired_s >= p.guard_hold_s and steady_s >= 5.0
        # Once a trial has measured a level much slower than the table said, the table is
        # not trusted to pick an escape under load: later trials wait for a calm moment.
        table_wrong = any(now_s - t < p.quant_slow_retry_s for t in self._slow_here_s.values())
        if (
            unexplored
            and since >= p.quant_explore_dwell_s
            and (calm or (stuck and not table_wrong))
        ):
            order = sorted(unexplored, key=hint)
            target = order[0]
            if target in self._explored:
                self._retried_s[target] = now_s
            self._explored.add(target)
            self._start_trial(target, level, stuck, now_s)
            self._quant_left_s[level] = now_s
            self._last_quant_switch_s = now_s
            # A calm trial's first steps run with a small prefill chunk (a probe): a level
            # far slower than the table says shows it in short steps, not in one that
            # stalls every request for seconds (a 256-token bf16 step took 6 s on the real
            # engine here; a step once started runs to its end). The verdict restores the
            # chunk. Not an escape under load: there the queue needs the full chunk.
            probe = max(
                self.engine.max_num_batched_tokens_min,
                base.max_num_batched_tokens // p.quant_trial_probe_fraction,
            )
            # No decode pacing through a trial: its verdict compares the two levels' models,
            # and a young model's paced predictions rest on batches it has not seen.
            knobs = base.with_changes(quant_level=target, decode_interval_ms=0.0)
            note = ""
            if probe < base.max_num_batched_tokens and not stuck:
                self._probe_chunk_from = base.max_num_batched_tokens
                knobs = knobs.with_changes(max_num_batched_tokens=probe)
                note = f"; chunk {base.max_num_batched_tokens} -> {probe} until its first steps"
            return Choice(
                ControllerState.TRACKING,
                knobs,
                Reason.QUANT_EXPLORE,
                f"quantization {level} -> {target}: {what}; trying it for "
                f"{p.quant_explore_dwell_s:g} s (latency guards stay armed)"
                + ("; the current level cannot meet the targets" if stuck else "")
                + note,
            )
        return None

    def _prefill_slower(self, level: str, than: str) -> bool:
        """Whether the table's prefill speed of `level` is below `than`'s by more than
        quant_trial_slowdown_max (False where either is not in the table)."""
        mine, theirs = self._levels.get(level), self._levels.get(than)
        if mine is None or theirs is None or not mine.prefill_tok_s or not theirs.prefill_tok_s:
            return False
        return theirs.prefill_tok_s > self.params.quant_trial_slowdown_max * mine.prefill_tok_s
