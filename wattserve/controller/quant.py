"""The controller's slowest timescale: which weight quantization level runs.

A known level replaces the current one for a predicted gain, compared on the levels' own
models; a level never run here is tried once at a calm moment (or when the current one
cannot cope), judged step by step against the level before's model, and kept only if then
predicted better; bench quant's speed table orders the trials and rules where the models
have not seen the batches running. It must not import torch or the daemon, read a clock,
or touch a device or an engine.

States: nothing learned -- the table ranks another allowed level first --> settled on
that level (the level left counts as never run). Settled (one level runs) -- a never-run
level tried --> trial (probing with a small chunk while not stuck, then at the full chunk
once its steps vouch) -- verdict: measured slower or still learning --> back to the level
before | dwell over --> kept if predicted better, else back. Settled -- predicted gain
after the dwell, the table ruling at large batches, or stuck --> another known level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits
from wattserve.controller.models import Prediction, Workload
from wattserve.controller.outlook import Outlook
from wattserve.controller.part import Part
from wattserve.controller.policy import Knobs
from wattserve.controller.signals import StepRecord
from wattserve.controller.speed_table import SpeedTable
from wattserve.controller.state import Choice, ControllerState, Reason


@dataclass
class Trial:
    """A never-run (or not-at-this-load) level being tried."""

    tried: str
    before: str
    stuck: bool  # begun because the level before could not cope
    started_s: float
    # The trial's steps: how many, measured seconds, what the level before would have taken.
    steps: int = 0
    measured_s: float = 0.0
    expected_s: float = 0.0
    batch_max: int = 0  # the largest decode batch among them


@dataclass
class QuantState:
    last_switch_s: float | None = None  # None until the first tracking observation
    explored: set[str] = field(default_factory=set)
    retried_s: dict[str, float] = field(default_factory=dict)  # a known level last retried
    left_s: dict[str, float] = field(default_factory=dict)  # each level last switched away
    trial: Trial | None = None
    probe_chunk_from: int | None = None  # the chunk before a trial's probe cut it
    slow_here_s: dict[str, float] = field(default_factory=dict)  # trials measured slower
    # Calm trials a latency guard ended before their steps judged them, and when: the
    # level is no worse for it, and is tried again (not before quant_peak_window_s).
    aborted_s: dict[str, float] = field(default_factory=dict)
    stuck_since_s: float | None = None  # since the level in force stopped coping


@dataclass(frozen=True)
class _Ask:
    """One quantization step's inputs."""

    base: Knobs
    level: str
    workload: Workload
    temp: float | None
    outlook: Outlook
    budget_w: float
    ceiling: int | None

    @property
    def now_s(self) -> float:
        return self.outlook.now_s


class QuantTimescale(Part):
    """The quantization level: switches, trials and their verdicts."""

    def __init__(self, limits: Limits, learner: Learner) -> None:
        super().__init__(limits, learner)
        self.table = SpeedTable(limits.engine.quant_options)
        self.state = QuantState()

    # ---- what the others ask ----------------------------------------

    @property
    def exploring(self) -> tuple[str, str] | None:
        """(level tried, level before) while a trial runs."""
        t = self.state.trial
        return (t.tried, t.before) if t is not None else None

    @property
    def probing(self) -> bool:
        """A trial's probe has cut the prefill chunk (the batch caps leave it alone)."""
        return self.state.probe_chunk_from is not None

    def trial_vouched(self) -> bool:
        """The trial's steps so far ran within the slowdown bound, enough of them to judge."""
        enough, slow = self._trial_evidence()
        return enough and not slow

    def start(self, base: Knobs, allowed: tuple[str, ...], current: str) -> Choice | None:
        """Before any level is trained: a move to the allowed level bench quant's table
        ranks first, where the table measured both it and the level in force, it decodes
        faster, and its prefill is not slower than a trial tolerates (None otherwise).
        Learning the level in force first would spend the cold start, and a trial, on a
        level the table already calls slower. The level left has a few steps and no
        trained model: it is tried at a calm moment like a never-run level, so a table
        from another machine that ranks the levels wrongly is found out by that trial."""
        if not self.params.quant.quant_start_by_table or not allowed:
            return None
        if any(self.learner.trained(lv) for lv in self.learner.step_models):
            return None
        first = min(allowed, key=self.table.order)
        if first == current or not self.table.measured_faster(first, current):
            return None
        if self.table.prefill_slower(first, current, self.params.quant.quant_trial_slowdown_max):
            return None
        return Choice(
            ControllerState.LEARNING,
            base.with_changes(quant_level=first),
            Reason.QUANT_SWITCH,
            f"quantization {current} -> {first}: nothing learned yet, and bench quant's "
            f"table ranks {first} first of the allowed levels",
        )

    def best_allowed_level(self, allowed: tuple[str, ...], current: str) -> str:
        full = self.limits.engine.full_precision_level
        if full in allowed:
            return full
        return allowed[0] if allowed else current

    # ---- transitions driven by the others ----------------------------------------

    def judge_trial_step(self, step: StepRecord, clock_mhz: int) -> None:
        """During a trial, add a step of the level tried and what the level before's model
        predicts for the same step at the same clock."""
        t = self.state.trial
        if t is None:
            return
        model = self.learner.step_models.get(t.before)
        if step.quant_level != t.tried or model is None:
            return
        if model.samples < self.params.learning.learning_min_steps:
            return
        # (Folding the context into the decode cost matters here: clipping each cost on its
        # own once judged a faster bf16, 65 ms steps against fp32's 95, 2.2x slower.)
        expected = model.predict_step_s(step, clock_mhz)
        t.steps += 1
        t.batch_max = max(t.batch_max, step.decode_tokens)
        t.measured_s += step.duration_s
        t.expected_s += expected

    def end_calm_trial(self, now_s: float) -> tuple[str, str] | None:
        """A latency guard fired: a calm trial whose steps have not vouched for it ends
        (returns (tried, before)); one begun because the level before could not cope goes
        on, as does one whose steps have vouched for it (None). Unless its steps measured
        it slow, the level is tried again later (the guard is no verdict on it)."""
        t = self.state.trial
        if t is None or t.stuck or self.trial_vouched():
            return None
        if not self._trial_evidence()[1]:
            self.state.aborted_s[t.tried] = now_s
        self.state.trial = None
        return t.tried, t.before

    def not_coping(self, now_s: float) -> bool:
        """A latency guard fired: the level in force is not coping. True once that has
        lasted quant_stuck_s (time for an escape)."""
        s = self.state
        if s.stuck_since_s is None:
            s.stuck_since_s = now_s
            return False
        return now_s - s.stuck_since_s >= self.params.quant.quant_stuck_s

    def restore_probe_chunk(self, knobs: Knobs) -> Knobs:
        """However a trial ended, the chunk its probe cut comes back."""
        s = self.state
        if s.probe_chunk_from is None or s.trial is not None:
            return knobs
        chunk = max(knobs.max_num_batched_tokens, s.probe_chunk_from)
        s.probe_chunk_from = None
        return knobs.with_changes(max_num_batched_tokens=chunk)

    # ---- the trial's verdict ----------------------------------------

    def _trial_evidence(self) -> tuple[bool, bool]:
        """(enough steps of the trial measured to judge it, those steps slower than
        quant_trial_slowdown_max x what the level before's model predicts for them)."""
        p, t = self.params, self.state.trial
        assert t is not None
        enough = (
            t.steps >= p.quant.quant_trial_min_steps
            and t.measured_s >= p.quant.quant_trial_evidence_s
        ) or t.measured_s >= 2 * p.quant.quant_trial_evidence_s  # one long step will do
        slow = t.measured_s > p.quant.quant_trial_slowdown_max * t.expected_s
        return enough, slow

    def verdict(self, base: Knobs, now_s: float) -> Choice | None:
        """End a trial early on what its steps measured: much slower than the level before
        would have been, or still learning long after its dwell. Back to the level before."""
        s, p = self.state, self.params
        t = s.trial
        if t is None:
            return None
        why = None
        enough, slow = self._trial_evidence()
        if enough and not slow and s.probe_chunk_from is not None:
            # The probe's steps ran within the bound: the trial goes on at the full chunk.
            chunk, s.probe_chunk_from = s.probe_chunk_from, None
            return Choice(
                ControllerState.TRACKING,
                base.with_changes(max_num_batched_tokens=chunk),
                Reason.OPTIMIZE,
                f"trial of {t.tried}: its first {t.steps} steps within "
                f"{p.quant.quant_trial_slowdown_max:g}x {t.before}'s model; chunk "
                f"{base.max_num_batched_tokens} -> {chunk}",
            )
        if enough and slow:
            ratio = t.measured_s / max(t.expected_s, 1e-9)
            why = f"its {t.steps} steps took {ratio:.1f}x what {t.before}'s model predicts for them"
            s.slow_here_s[t.tried] = now_s
        elif (
            now_s - t.started_s >= p.quant.quant_trial_max_s
            and self.learner.step_model(t.tried).samples < p.learning.learning_min_steps
        ):
            samples = self.learner.step_model(t.tried).samples
            why = f"only {samples} steps in {now_s - t.started_s:.0f} s"
        if why is None:
            return None
        s.trial = None
        s.last_switch_s = now_s
        s.left_s[t.tried] = now_s
        return Choice(  # restore_probe_chunk gives back a chunk the trial's probe cut
            ControllerState.TRACKING,
            base.with_changes(quant_level=t.before),
            Reason.QUANT_SWITCH,
            f"quantization {t.tried} -> {t.before}: trial of {t.tried} aborted, {why}",
        )

    # ---- the timescale's step ----------------------------------------

    def step(
        self,
        base: Knobs,
        allowed: tuple[str, ...],
        workload: Workload,
        temp: float | None,
        outlook: Outlook,
        budget_w: float,
        ceiling: int | None,
        steady_s: float,
    ) -> Choice | None:
        """The slowest timescale. A known level replaces the current one after
        quant_dwell_s for a quant_gain_min_pct predicted gain, compared only at clocks each
        level was seen at (no extrapolation across levels) and only where its model has
        seen batches like the largest of the last quant_peak_window_s (a model fitted on
        small batches flatters a level at large ones). A level never run is tried for
        quant_explore_dwell_s when the load is calm (no latency guard within guard_hold_s
        and steady_s, the time the targets have been met, at least 5 s), and kept only if
        then predicted better. When the current level cannot meet the targets at any
        trusted clock (and a queue or a latency guard within quant_stuck_busy_s says so
        too), both happen after quant_explore_dwell_s and without the gain threshold, and a
        level measured faster whose model has not seen the batches running now is tried
        again. Nothing switches while requests wait or a latency guard holds (unless the
        level has not coped for quant_stuck_busy_s); a switch keeps the clock in force when
        that is higher (the optimizer walks it down)."""
        s, p = self.state, self.params
        now_s = outlook.now_s
        level = base.quant_level or self.limits.engine.full_precision_level
        if s.last_switch_s is None:
            s.last_switch_s = now_s  # the dwell starts with the first tracking
            return None
        ask = _Ask(base, level, workload, temp, outlook, budget_w, ceiling)
        since = now_s - s.last_switch_s
        if s.trial is not None:
            return self._conclude_trial(ask, since)
        if workload.output_tokens_per_s <= 0 or len(allowed) < 2:
            return None
        current = self._best_for(ask, level, False)
        if current is not None:
            s.stuck_since_s = None
        elif s.stuck_since_s is None:
            s.stuck_since_s = now_s
        # Stuck: no trusted clock of this level has met the targets for quant_stuck_s, and
        # the requests say so too (a queue, or a latency guard within quant_stuck_busy_s).
        # The model's word alone is not enough: a model can call the level in force short
        # of the margin while its requests meet the SLO, and an escape under load runs a
        # level not measured here with the full chunk, where each slow step holds the queue.
        waiting = self.learner.waiting_now > 0
        troubled = waiting or outlook.latency_hold.fired_within(now_s, p.quant.quant_stuck_busy_s)
        stuck = (
            s.stuck_since_s is not None
            and now_s - s.stuck_since_s >= p.quant.quant_stuck_s
            and troubled
        )
        busy = waiting or outlook.latency_hold.fired_within(now_s, p.latency_guard.guard_hold_s)
        stuck_for = now_s - s.stuck_since_s if s.stuck_since_s is not None else 0.0
        stuck_long = stuck_for >= max(p.quant.quant_stuck_s, p.quant.quant_stuck_busy_s)
        if busy and not stuck_long:
            # Not while a queue is served: a switch costs, its gain rests on the less tried
            # level's model, and the percentile ratios start again; the clock serves a
            # queue faster. Unless the level has not coped for quant_stuck_busy_s.
            return None
        # A level the table ranks slower than a level already run here, adopted while the
        # batches were small (where lighter weights may be cheaper), is left for that level
        # once batches of quant_table_batch_min run: there the table's batch-16 speed says
        # more than a model fitted on small batches, which would hold the level through a
        # rising load at the top clock.
        mine = self.table.order(level)[0]
        table_rules = mine < 0.0 and self.learner.running_peak >= p.quant.quant_table_batch_min
        if table_rules:
            switched = self._switch_by_table(ask, allowed, mine, since)
            if switched is not None:
                return switched
        if since >= (p.quant.quant_explore_dwell_s if stuck else p.quant.quant_dwell_s):
            done, switched = self._after_dwell(
                ask, allowed, current, stuck, table_rules, mine, since
            )
            if done:
                return switched
        return self._explore(ask, allowed, stuck, table_rules, mine, since, steady_s)

    def _after_dwell(
        self,
        ask: _Ask,
        allowed: tuple[str, ...],
        current: Prediction | None,
        stuck: bool,
        table_rules: bool,
        mine: float,
        since: float,
    ) -> tuple[bool, Choice | None]:
        """After the dwell: a known level, or an escape by headroom when stuck. (True, its
        choice) where the step ends here (the choice None: nothing moves); (False, None)
        where a trial may still be begun."""
        known = self._known(ask, allowed, table_rules, mine)
        if not known and stuck:
            escaped = self._escape_by_headroom(ask, allowed)
            if escaped is not None:
                return True, escaped
        if known:
            if current is None and not stuck:
                return True, None  # a transient miss is the guards' business, not a reason
            switched = self._switch_known(ask, known, current, stuck, since)
            if switched is not None:
                return True, switched
        return False, None

    def _conclude_trial(self, ask: _Ask, since: float) -> Choice | None:
        """The trial is over after quant_explore_dwell_s once its model has learned: keep
        the level tried only if it is predicted better."""
        s, p = self.state, self.params
        t = s.trial
        assert t is not None
        learned = self.learner.step_model(t.tried).samples >= p.learning.learning_min_steps
        if since < p.quant.quant_explore_dwell_s or not learned:
            return None
        s.trial = None
        s.last_switch_s = ask.now_s
        # Both over the same clocks: the union of where either has been trusted.
        mine = self._best_for(ask, t.tried, True, t.before)
        theirs = self._best_for(ask, t.before, True, t.tried)
        score = ask.outlook.score
        if theirs is not None and (mine is None or score(theirs) <= score(mine)):
            if t.measured_s > t.expected_s > 0.0 and t.batch_max >= p.quant.quant_table_batch_min:
                # Slower than the level before, if not by enough to end the trial early,
                # at batches like the table's: the table that ranked it faster is wrong
                # here too. (At smaller batches a step's fixed cost decides, which the
                # table's batch-16 speed does not claim to rank.)
                s.slow_here_s[t.tried] = ask.now_s
            return self._switch(ask, theirs, f"the trial of {t.tried} predicts no gain")
        if mine is None and theirs is None:
            # Neither meets the targets: keep the one with more latency headroom at the
            # top clock the budget allows (the level tried only if clearly ahead).
            ours, back = self._headroom(ask, t.tried), self._headroom(ask, t.before)
            if not ask.outlook.latency_load(ours) < 0.9 * ask.outlook.latency_load(back):
                return self._switch(
                    ask,
                    back,
                    f"neither meets the targets; {t.tried} has no more headroom than {t.before}",
                )
        return None

    def _switch_by_table(
        self, ask: _Ask, allowed: tuple[str, ...], mine: float, since: float
    ) -> Choice | None:
        """Where the table rules: to a trained level it ranks faster than the one in force."""
        p, now_s = self.params, ask.now_s
        ahead = [
            lv
            for lv in allowed
            if lv != ask.level
            and self.learner.trained(lv)
            and self.table.order(lv)[0] < mine
            and now_s - self.state.slow_here_s.get(lv, -math.inf) >= p.quant.quant_slow_retry_s
        ]
        if not (ahead and since >= p.quant.quant_explore_dwell_s):
            return None
        lv = min(ahead, key=self.table.order)
        to = self._best_for(ask, lv, True) or self._headroom(ask, lv)
        return self._switch(
            ask,
            to,
            f"batches of {self.learner.running_peak} run, where the speed table ranks {lv} "
            f"ahead of {ask.level}",
        )

    def _known(
        self, ask: _Ask, allowed: tuple[str, ...], table_rules: bool, mine: float
    ) -> list[Prediction]:
        """The best prediction of each other trained level that meets the targets, its
        model trusted at the largest batch of the last quant_peak_window_s (the level is
        the slow knob, and the load comes back); where the table rules, none it ranks
        slower than the level in force (no flip-flop)."""
        peak = self.learner.running_peak
        known = [
            self._best_for(ask, lv, True, batch=peak)
            for lv in allowed
            if lv != ask.level
            and self.learner.trained(lv)
            and not (table_rules and mine < self.table.order(lv)[0] < 0.0)
        ]
        return [pr for pr in known if pr is not None]

    def _escape_by_headroom(self, ask: _Ask, allowed: tuple[str, ...]) -> Choice | None:
        """Stuck, and no level predicted to meet the targets: the level with the most
        latency headroom at the highest clock the budget allows, if clearly ahead."""
        peak = self.learner.running_peak
        others = [
            pr
            for pr in (
                self._headroom(ask, lv)
                for lv in allowed
                if lv != ask.level and self.learner.trained(lv)
            )
            if ask.outlook.batch_trusted(pr, peak)
        ]
        if not others:
            return None
        ahead = min(others, key=ask.outlook.latency_load)
        if not ask.outlook.latency_load(ahead) < 0.9 * ask.outlook.latency_load(
            self._headroom(ask, ask.level)
        ):
            return None
        return self._switch(
            ask,
            ahead,
            f"no level meets the targets; {ahead.quant_level} has the most "
            "headroom at the top clock",
        )

    def _switch_known(
        self,
        ask: _Ask,
        known: list[Prediction],
        current: Prediction | None,
        stuck: bool,
        since: float,
    ) -> Choice | None:
        """After the dwell: to the best known level, stuck; else for a quant_gain_min_pct
        predicted gain (twice that to go back to a level left recently: no flip-flop)."""
        p, score = self.params, ask.outlook.score
        best = min(known, key=score)
        cur = score(current) if current is not None else math.inf
        if stuck:
            return self._switch(
                ask, best, f"{ask.level} cannot meet the targets at any trusted clock"
            )
        left_s = ask.now_s - self.state.left_s.get(best.quant_level, -math.inf)
        need = p.quant.quant_gain_min_pct * (2.0 if left_s < 3 * p.quant.quant_dwell_s else 1.0)
        if score(best) < cur * (1.0 - need / 100.0):
            gain = (1 - score(best) / cur) * 100
            return self._switch(
                ask, best, f"predicted {gain:.0f}% better after a {since:.0f} s dwell"
            )
        return None

    def _explore(
        self,
        ask: _Ask,
        allowed: tuple[str, ...],
        stuck: bool,
        table_rules: bool,
        mine: float,
        since: float,
        steady_s: float,
    ) -> Choice | None:
        """Levels never run have no model of their own: try each once. When the current
        level cannot cope, a level measured faster (bench quant's decode speed) whose model
        has not seen batches like those running now is tried again at this load (at most
        once per quant_peak_window_s): its model, not trusted there, learns them."""
        s, p, now_s = self.state, self.params, ask.now_s
        unexplored, what = self._untried(ask, allowed, stuck, table_rules, mine)
        calm = (
            not ask.outlook.latency_hold.fired_within(now_s, p.latency_guard.guard_hold_s)
            and steady_s >= 5.0
        )
        # Once a trial has measured a level much slower than the table said, the table is
        # not trusted to pick an escape under load: later trials wait for a calm moment.
        table_wrong = any(now_s - t < p.quant.quant_slow_retry_s for t in s.slow_here_s.values())
        if not (
            unexplored
            and since >= p.quant.quant_explore_dwell_s
            and (calm or (stuck and not table_wrong))
        ):
            return None
        target = sorted(unexplored, key=self.table.order)[0]
        return self._begin_trial(ask, target, stuck, what)

    def _untried(
        self, ask: _Ask, allowed: tuple[str, ...], stuck: bool, table_rules: bool, mine: float
    ) -> tuple[list[str], str]:
        """The levels a trial may try now, and what makes them worth one."""
        s, p, now_s, level = self.state, self.params, ask.now_s, ask.level
        # Untrained, and never tried here or a calm trial of it aborted long enough ago
        # (a level left at the cold start has a few steps, no trained model).
        unexplored = [
            lv
            for lv in allowed
            if lv != level
            and not self.learner.trained(lv)
            and (
                lv not in s.explored
                or now_s - s.aborted_s.get(lv, math.inf) >= p.quant.quant_peak_window_s
            )
        ]
        what = "never measured here"
        if stuck and not any(self.table.faster(lv, level) for lv in unexplored):
            # An escape wants a level the table calls faster: one tried at small batches
            # before this load comes ahead of a never-run level the table calls slower,
            # which could not relieve a level that cannot cope.
            running = self.learner.running_now
            retry = [
                lv
                for lv in allowed
                if lv != level
                and lv in self.learner.step_models
                and running > ask.outlook.trusted_batch(lv)
                and now_s - s.retried_s.get(lv, -math.inf) >= p.quant.quant_peak_window_s
                and now_s - s.slow_here_s.get(lv, -math.inf) >= p.quant.quant_slow_retry_s
                and self.table.faster(lv, level)
            ]
            if retry or not unexplored:
                unexplored = retry
                what = f"not measured at batches of {running} yet"
        # A level whose prefill the table measured slower than the level in force's beyond
        # the trial's slowdown bound is not tried: each of its prefill steps would hold the
        # requests behind it longer than a trial tolerates, before any verdict can come.
        unexplored = [
            lv
            for lv in unexplored
            if not self.table.prefill_slower(lv, level, p.quant.quant_trial_slowdown_max)
        ]
        # A level the table ranks no faster than one measured slower here is not tried: the
        # table's error is the machine's (it holds for the levels ranked below too), and
        # each trial costs latency until its verdict.
        slow_known = [
            self.table.order(lv)[0]
            for lv, t in s.slow_here_s.items()
            if now_s - t < p.quant.quant_slow_retry_s and self.table.order(lv)[0] < 0.0
        ]
        if slow_known:
            unexplored = [lv for lv in unexplored if self.table.order(lv)[0] < min(slow_known)]
        # The table's speed is a batch-16 figure: where batches like that run, a calm trial of
        # a level it ranks slower than the level in force is not made (it could not keep up
        # at the clock in force, and the guards would raise the clock for it). At smaller
        # batches, where lighter weights may be cheaper, it is.
        if not stuck and table_rules:
            unexplored = [
                lv
                for lv in unexplored
                if self.table.order(lv)[0] < mine or self.table.order(lv)[0] == 0.0
            ]
        return unexplored, what

    def _begin_trial(self, ask: _Ask, target: str, stuck: bool, what: str) -> Choice:
        """Transition: a trial of `target` begins."""
        s, p, now_s, level, base = self.state, self.params, ask.now_s, ask.level, ask.base
        s.aborted_s.pop(target, None)
        if target in s.explored:
            s.retried_s[target] = now_s
        s.explored.add(target)
        s.trial = Trial(target, level, stuck, now_s)
        s.left_s[level] = now_s
        s.last_switch_s = now_s
        # A calm trial's first steps run with a small prefill chunk (a probe): a level
        # far slower than the table says shows it in short steps, not in one that
        # stalls every request for seconds (a step once started runs to its end, however
        # slow the level). The verdict restores the chunk. Not an escape under load: there
        # the queue needs the full chunk.
        probe = max(
            self.limits.engine.max_num_batched_tokens_min,
            base.max_num_batched_tokens // p.quant.quant_trial_probe_fraction,
        )
        # A calm trial runs at the decode interval in force: pacing is not the level's to
        # decide, and the tried level's model then learns the paced batches it would be
        # judged at (the verdict compares the two levels at the knobs in force). Unpaced,
        # a trial of a never-run level cost the cold start most of its paced savings for
        # 10 s. An escape runs unpaced: the level it leaves cannot cope.
        interval_ms = 0.0 if stuck else base.decode_interval_ms
        knobs = base.with_changes(quant_level=target, decode_interval_ms=interval_ms)
        note = ""
        if probe < base.max_num_batched_tokens and not stuck:
            s.probe_chunk_from = base.max_num_batched_tokens
            knobs = knobs.with_changes(max_num_batched_tokens=probe)
            note = f"; chunk {base.max_num_batched_tokens} -> {probe} until its first steps"
        if not stuck:
            clock = self._trial_clock(ask, knobs.max_num_batched_tokens)
            if clock != base.sm_clock_mhz:
                knobs = knobs.with_changes(sm_clock_mhz=clock)
                note += f"; clock {base.sm_clock_mhz} -> {clock} MHz while it is judged"
        return Choice(
            ControllerState.TRACKING,
            knobs,
            Reason.QUANT_EXPLORE,
            f"quantization {level} -> {target}: {what}; trying it for "
            f"{p.quant.quant_explore_dwell_s:g} s (latency guards stay armed)"
            + ("; the current level cannot meet the targets" if stuck else "")
            + note,
        )

    def _trial_clock(self, ask: _Ask, chunk: int) -> int | None:
        """The clock a calm trial runs at: the lowest, from the one in force up, at which
        the level before would still meet the targets if its steps took
        quant_trial_slowdown_max x its model (the most a trial's verdict lets pass, at the
        trial's first chunk); else the highest the budget allows. A never-run level may be
        that much slower before its verdict, and at a clock chosen for the level before
        with no room to spare the requests of those seconds would pay for it."""
        o, base, here = ask.outlook, ask.base, ask.base.sm_clock_mhz
        slow = self.params.quant.quant_trial_slowdown_max
        start = here or self.limits.top_mhz
        clocks = [f for f in o.clock_range(ask.level, ask.ceiling) if f >= start]
        for f in clocks:
            pr = o.predict(
                ask.level, f, base.max_num_seqs, chunk, ask.workload, ask.temp, step_scale=slow
            )
            if o.feasible(pr, ask.budget_w):
                return here if f == start else f
        top = min(clocks[-1] if clocks else start, o.safe_clock(ask.budget_w, ask.temp))
        return top if top > start else here

    # ---- comparisons ----------------------------------------

    def _best_for(
        self, ask: _Ask, lv: str, compare: bool, other: str | None = None, batch: int | None = None
    ) -> Prediction | None:
        """The best-scoring prediction of `lv` that meets the targets (and, for another
        level than the one in force, whose batch its model is trusted at)."""
        o, base = ask.outlook, ask.base
        # Levels are compared over the clocks either has been trusted at: a level tried
        # only briefly (near the top clock) starts from the clock sensitivity learned
        # for the other one (StepTimeModel.as_prior), so it is judged where the other
        # already runs, not only where it was tried.
        clocks = o.clock_range(lv, ask.ceiling)
        if compare:
            against = o.clock_range(other or ask.level, ask.ceiling)
            clocks = sorted(set(clocks) | set(against))
        preds = [
            o.predict(lv, f, base.max_num_seqs, base.max_num_batched_tokens, ask.workload, ask.temp)
            for f in clocks
        ]
        ok = [
            pr
            for pr in preds
            if o.feasible(pr, ask.budget_w) and (lv == ask.level or o.batch_trusted(pr, batch))
        ]
        return min(ok, key=o.score) if ok else None

    def _switch(self, ask: _Ask, to: Prediction, why: str) -> Choice:
        """Transition: to another known level."""
        s, base = self.state, ask.base
        s.last_switch_s = ask.now_s
        s.left_s[ask.level] = ask.now_s
        # A new level starts no lower than the clock in force: its model is the less
        # tried one, so the clock optimizer walks it down afterwards (slowly), rather
        # than the switch doing both at once.
        clock = to.sm_clock_mhz
        here = base.sm_clock_mhz or self.limits.top_mhz
        if here > clock:
            at_here = ask.outlook.predict(
                to.quant_level,
                here,
                base.max_num_seqs,
                base.max_num_batched_tokens,
                ask.workload,
                ask.temp,
            )
            if ask.outlook.within_budget(at_here, ask.budget_w):
                clock = here
        return Choice(
            ControllerState.TRACKING,
            base.with_changes(quant_level=to.quant_level, sm_clock_mhz=clock),
            Reason.QUANT_SWITCH,
            f"quantization {ask.level} -> {to.quant_level}: {why} [{to.describe()}]",
            to,
        )

    def _headroom(self, ask: _Ask, lv: str) -> Prediction:
        """`lv` at the highest clock the budget allows."""
        o = ask.outlook
        top = ask.ceiling if ask.ceiling is not None else self.limits.top_mhz
        top = min(top, o.safe_clock(ask.budget_w, ask.temp))
        return o.predict(
            lv, top, ask.base.max_num_seqs, ask.base.max_num_batched_tokens, ask.workload, ask.temp
        )
