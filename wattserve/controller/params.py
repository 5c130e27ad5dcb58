"""The controller's tuning: one small frozen group per part that reads it, each validated
where it is built, and ControllerParams holding one of each. Defaults suit a GPU with a
100 ms telemetry period. Plain data: this module imports nothing of the controller and must
not import torch or the daemon, read a clock, or touch a device or an engine.

A setting's name is the same in its group, in ControllerParams.of (flat names, as the
[controller] keys and the tests give them) and in the config file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _positive(group: object, *names: str) -> None:
    for name in names:
        if not getattr(group, name) > 0:
            raise ValueError(f"ControllerParams.{name} must be > 0")


@dataclass(frozen=True)
class TargetParams:
    """The margins every prediction and guard measures against (read by the outlook, the
    guards and the limits): predictions must meet slo_margin x SLO and power_margin x budget;
    the board power limit is set to power_limit_margin x budget."""

    slo_margin: float = 0.85
    power_margin: float = 0.95
    power_limit_margin: float = 0.98

    def __post_init__(self) -> None:
        _positive(self, "slo_margin", "power_margin", "power_limit_margin")
        for name in ("slo_margin", "power_margin", "power_limit_margin"):
            if getattr(self, name) > 1:
                raise ValueError(f"ControllerParams.{name} must be <= 1")


@dataclass(frozen=True)
class LearningParams:
    """How much the models must have seen before they are used (read by the learner, the
    outlook and the core). learning_min_steps steps (the first level's second half at
    learning_low_clock_fraction x the top clock) and learning_min_power_samples readings
    before the models are used; a clock counts as seen after trust_min_samples steps, and
    trust reaches trust_clock_steps candidates beyond; a level's model is trusted up to
    batch_trust_factor x the largest decode batch it has been fitted around (at least
    batch_trust_min). Re-learning: while the level's latest steps took more than surprise_max
    x what its step model predicted for them (the median of three), the model no longer
    describes the engine (a sudden slowdown) and its fit swings as it learns the new one; the
    caps, clock and decode interval are held (the guards and the quantization timescale still
    act). Steps faster than predicted hold nothing: a model that over-predicts errs towards
    the SLOs."""

    learning_min_steps: int = 30
    learning_min_power_samples: int = 8
    learning_low_clock_fraction: float = 0.5
    surprise_max: float = 3.0
    trust_clock_steps: int = 2
    trust_min_samples: int = 10
    batch_trust_factor: float = 1.5
    batch_trust_min: int = 4

    def __post_init__(self) -> None:
        _positive(self, "batch_trust_factor")
        if not 0 < self.learning_low_clock_fraction <= 1:
            raise ValueError("ControllerParams.learning_low_clock_fraction must be in (0, 1]")
        if not self.surprise_max > 1:
            raise ValueError("ControllerParams.surprise_max must be > 1")


@dataclass(frozen=True)
class WorkloadParams:
    """The load estimate (read by the learner's workload estimator): the rates, prompt and
    output sizes are averaged over workload_tau_s; the arrivals surge when the requests of the
    last surge_window_s are at least surge_min_ratio x, and with Poisson probability under
    surge_alpha, what the request rate estimated before them gives."""

    workload_tau_s: float = 8.0
    surge_window_s: float = 2.0
    surge_alpha: float = 1e-5
    surge_min_ratio: float = 2.0

    def __post_init__(self) -> None:
        _positive(self, "workload_tau_s", "surge_window_s")
        if not 0 < self.surge_alpha < 1 or self.surge_min_ratio < 1:
            raise ValueError("ControllerParams: 0 < surge_alpha < 1, surge_min_ratio >= 1")


@dataclass(frozen=True)
class AdaptiveMarginParams:
    """The adaptive margin (read by the learner): each measured TTFT and TPOT over the model's
    percentile prediction in force is kept per level and clock; the split-conformal
    (1 - margin_alpha) quantile of those ratios (the clock's own where it has enough, else
    pooled; at most margin_max, never below 1) multiplies a prediction before it is compared
    with the SLO (too few ratios: 1, the fixed margin alone); a TTFT counts if its request
    arrived under the configuration predicted, a TPOT once that configuration has held
    margin_settle_s, neither while requests queue nor before the level's model has
    descend_evidence_steps steps."""

    margin_alpha: float = 0.1
    margin_max: float = 4.0
    margin_settle_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.margin_alpha < 1 or self.margin_max < 1:
            raise ValueError("ControllerParams: margin_alpha in (0, 1), margin_max >= 1")


@dataclass(frozen=True)
class ClockParams:
    """The clock timescale (read by the clock step, the pacing step and the limits): the
    clock may change every clock_min_interval_s among clock_candidates clocks; down only
    descend_hold_s after a move up, for a clock_gain_min_pct gain, with the lower clock's
    prediction meeting descend_margin x the margin at the load descend_load_z standard errors
    of the estimated request rate above it (arrivals at random make the estimate swing), and,
    while the level's model has fewer than descend_evidence_steps steps, below the clocks it
    has seen only after a first token at the clock in force."""

    clock_gain_min_pct: float = 3.0
    clock_min_interval_s: float = 1.0
    clock_candidates: int = 12
    descend_margin: float = 0.9
    descend_load_z: float = 1.0
    descend_hold_s: float = 5.0
    descend_evidence_steps: int = 300

    def __post_init__(self) -> None:
        _positive(self, "clock_min_interval_s")
        if self.clock_candidates < 2:
            raise ValueError("ControllerParams: clock_candidates >= 2, guard_clock_steps >= 1")
        if self.descend_load_z < 0:
            raise ValueError("ControllerParams: pace_backoff_s >= 0, descend_load_z >= 0")


@dataclass(frozen=True)
class BatchCapParams:
    """The batch caps (read by the batch-cap step and the outlook's chunk rules): they move
    every batch_period_s, the chunk at most every chunk_period_s, growing only within
    chunk_grow_margin of its bound. A prefill chunk's step at the clock in force stays within
    chunk_step_slo_factor x the TPOT SLO and chunk_step_ttft_factor x the TTFT SLO; below that
    bound a smaller chunk is taken where it is predicted to save chunk_gain_min_pct, and the
    chunk in force is left only for that gain."""

    batch_period_s: float = 2.0
    chunk_step_slo_factor: float = 2.5
    chunk_step_ttft_factor: float = 0.3
    chunk_grow_margin: float = 0.75
    chunk_period_s: float = 10.0
    chunk_gain_min_pct: float = 0.5

    def __post_init__(self) -> None:
        _positive(self, "batch_period_s", "chunk_step_ttft_factor")
        if not 0 < self.chunk_grow_margin <= 1:
            raise ValueError("ControllerParams.chunk_grow_margin must be in (0, 1]")


@dataclass(frozen=True)
class QuantParams:
    """The quantization timescale (read by the quantization step and the learner's batch
    peaks): the level changes after quant_dwell_s for a predicted gain of quant_gain_min_pct;
    a never-run level is tried for quant_explore_dwell_s; a level that cannot cope for
    quant_stuck_s is left sooner. With quant_start_by_table, before any level is trained the
    controller moves to the allowed level bench quant's table ranks fastest (the level left is
    then tried like any never-run one). A switch needs the model's trust at the largest batch
    of the last quant_peak_window_s; nothing switches while a queue is served or a guard
    holds, unless the level has not coped for quant_stuck_busy_s. A trial is judged on its
    measured steps as they come: once quant_trial_min_steps steps and quant_trial_evidence_s
    of them have run, a level whose steps took more than quant_trial_slowdown_max x what the
    level before would have taken is left at once, and not tried again for
    quant_slow_retry_s; a trial still learning after quant_trial_max_s ends too. A calm
    trial's first steps run with 1/quant_trial_probe_fraction of the chunk; a never-run level
    the table ranks slower than the level in force is not tried calmly once batches of
    quant_table_batch_min run (the table's speed is a batch-16 figure), and a level in force
    that the table ranks slower than one already run here is left for that one there."""

    quant_dwell_s: float = 30.0
    quant_explore_dwell_s: float = 10.0
    quant_start_by_table: bool = True
    quant_gain_min_pct: float = 10.0
    quant_stuck_s: float = 3.0
    quant_peak_window_s: float = 120.0
    quant_stuck_busy_s: float = 20.0
    quant_trial_slowdown_max: float = 1.25
    quant_trial_evidence_s: float = 1.0
    quant_trial_min_steps: int = 2
    quant_trial_max_s: float = 30.0
    quant_trial_probe_fraction: int = 8
    quant_slow_retry_s: float = 600.0
    quant_table_batch_min: int = 8

    def __post_init__(self) -> None:
        _positive(self, "quant_dwell_s", "quant_explore_dwell_s", "quant_peak_window_s")
        if self.quant_trial_probe_fraction < 1 or self.quant_trial_slowdown_max < 1:
            raise ValueError(
                "ControllerParams: quant_trial_probe_fraction >= 1, quant_trial_slowdown_max >= 1"
            )


@dataclass(frozen=True)
class PacingParams:
    """Decode pacing (read by the pacing step and the clock step's shorter intervals): the
    interval is 0 or one of pace_fractions x the TPOT SLO (within the engine's longest); a
    shorter one is weighed with the clocks every observation, a longer one at most every
    pace_period_s (pace_backoff_s more after the clock search shortened it because the
    targets were predicted missed), once the level's model has descend_evidence_steps steps,
    and never through a trial; it is off once no request has arrived for pace_lull_gaps mean
    gaps (at least pace_period_s, and not within pace_period_s of a longer interval chosen)
    and while the running batch fills guard_cap_share of the engine's cap."""

    pace_period_s: float = 5.0
    pace_backoff_s: float = 30.0
    pace_lull_gaps: float = 5.0
    pace_fractions: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)

    def __post_init__(self) -> None:
        if self.pace_backoff_s < 0:
            raise ValueError("ControllerParams: pace_backoff_s >= 0, descend_load_z >= 0")
        if not self.pace_period_s > 0 or not all(0 < f <= 1 for f in self.pace_fractions):
            raise ValueError("ControllerParams: pace_period_s > 0, pace_fractions each in (0, 1]")


@dataclass(frozen=True)
class LatencyGuardParams:
    """The latency guard (read by it, by the quantization step and the core): it raises the
    clock by guard_clock_steps candidates, or to the lowest clock predicted to prefill the
    waiting queue (growing over queue_growth_ticks observations) within slo_margin x the TTFT
    SLO (at most every guard_cooldown_s), and holds that floor for guard_hold_s (a floor a
    queue put up, not a miss or a long wait, lets go guard_release_s after the step up or
    later, once the queue has stayed empty for the waiting history and the running batch is
    off the engine's cap; quantization trials still wait guard_hold_s); a running batch of at
    least guard_cap_share x the engine's largest max_num_seqs that grew guard_rise_factor x
    over the last guard_rise_ticks observations (a burst filling the engine) takes the top
    clock the budget allows and no pacing at once, where the board limit holds the budget,
    and so does a queue guard while the arrivals surge; a surge with no queue steps up
    guard_clock_steps, pacing off, on a queue's floor. Descents earn their way: for
    descent_watch_s after the optimizer lowers the clock or lengthens the decode interval,
    the descent_watch_percentile of the TTFT and TPOT measured since is watched; at
    descent_guard_fraction x its SLO the descent is reverted at once and the clock below (and
    a longer interval) barred for descent_bar_s."""

    guard_clock_steps: int = 3
    guard_cap_share: float = 0.75
    guard_rise_ticks: int = 8
    guard_rise_factor: float = 1.3
    guard_cooldown_s: float = 1.0
    guard_hold_s: float = 10.0
    guard_release_s: float = 2.0
    queue_growth_ticks: int = 3
    descent_watch_s: float = 30.0
    descent_watch_percentile: float = 90.0
    descent_guard_fraction: float = 0.85
    descent_bar_s: float = 60.0

    def __post_init__(self) -> None:
        if self.guard_clock_steps < 1:
            raise ValueError("ControllerParams: clock_candidates >= 2, guard_clock_steps >= 1")
        if not 0 < self.descent_guard_fraction <= 1 or not 0 < self.descent_watch_percentile <= 100:
            raise ValueError(
                "ControllerParams: descent_guard_fraction in (0, 1], "
                "descent_watch_percentile in (0, 100]"
            )


@dataclass(frozen=True)
class PowerGuardParams:
    """The power guard and thermal derating (read by the power guard and the outlook): a
    reading within power_noise_tolerance over the budget is noise; over it the guard lowers
    the clock at once and holds that ceiling for power_hold_s (anti-windup; doubled up to
    power_hold_max_s when it fires again soon, and for power_hold_max_s after it fires on
    power read wholly under the board limit set for the budget, that limit is not trusted to
    hold it; a reading still averaging power from before a cut is not held against it),
    released once power is under power_release_margin x budget. The budget is derated
    linearly from 1 at thermal_derate_start_c of margin to thermal_derate_min at
    thermal_derate_full_c."""

    power_hold_s: float = 5.0
    power_hold_max_s: float = 60.0
    power_release_margin: float = 0.9
    power_noise_tolerance: float = 0.02
    thermal_derate_start_c: float = 6.0
    thermal_derate_full_c: float = 0.0
    thermal_derate_min: float = 0.6

    def __post_init__(self) -> None:
        _positive(self, "power_release_margin")
        if self.power_release_margin > 1:
            raise ValueError("ControllerParams.power_release_margin must be <= 1")
        if not 0 < self.thermal_derate_min <= 1:
            raise ValueError("ControllerParams.thermal_derate_min must be in (0, 1]")
        if self.thermal_derate_full_c >= self.thermal_derate_start_c:
            raise ValueError("ControllerParams: thermal_derate_full_c must be < _start_c")
        if self.power_hold_max_s < self.power_hold_s:
            raise ValueError("ControllerParams.power_hold_max_s must be >= power_hold_s")


@dataclass(frozen=True)
class FallbackParams:
    """The core's own states (read by the controller): stale telemetry holds the last safe
    knobs for stale_hold_s, then the fallback knobs (fallback_sm_clock_mhz, default the
    ladder's middle; fallback_max_num_seqs, default half the engine's largest); nothing
    running or waiting for idle_after_s is idle."""

    stale_hold_s: float = 2.0
    fallback_sm_clock_mhz: int | None = None
    fallback_max_num_seqs: int | None = None
    idle_after_s: float = 0.5

    def __post_init__(self) -> None:
        _positive(self, "stale_hold_s")


@dataclass(frozen=True)
class ReferenceParams:
    """The reference check (read by it): epochs of reference_epoch_s (an epoch with fewer
    than reference_epoch_min_tokens output tokens is dropped); the reference runs until it
    has reference_min_epochs epochs; a verdict needs reference_verdict_epochs of the
    controller's since it took over (its first one, the move away from the reference, not
    counted); the last reference_epochs_kept of each kind are compared; the controller must
    be ahead by reference_z standard errors, or the reference holds for reference_hold_s,
    doubled each time in a row up to reference_hold_max_s. Behind on energy alone holds
    only once the run's energy above the reference's exceeds reference_allowance x the
    reference's (counted over reference_allowance_horizon_s at least; the controller's room
    to explore; banked savings count up to as much)."""

    reference_epoch_s: float = 2.0
    reference_epoch_min_tokens: int = 32
    reference_min_epochs: int = 1
    reference_verdict_epochs: int = 4
    reference_epochs_kept: int = 8
    reference_z: float = 1.0
    reference_allowance: float = 0.01
    reference_allowance_horizon_s: float = 300.0
    reference_hold_s: float = 10.0
    reference_hold_max_s: float = 160.0

    def __post_init__(self) -> None:
        _positive(self, "reference_epoch_s", "reference_hold_s", "reference_z")
        if self.reference_allowance < 0 or self.reference_allowance_horizon_s < 0:
            raise ValueError("ControllerParams: reference_allowance and _horizon_s must be >= 0")
        least, most = self.reference_min_epochs, self.reference_epochs_kept
        if least < 1 or not max(least, 2) <= self.reference_verdict_epochs <= most:
            raise ValueError(
                "ControllerParams: 1 <= reference_min_epochs, 2 <= reference_verdict_epochs, "
                "both <= reference_epochs_kept"
            )
        if self.reference_hold_max_s < self.reference_hold_s:
            raise ValueError("ControllerParams.reference_hold_max_s must be >= reference_hold_s")


@dataclass(frozen=True)
class ControllerParams:
    """The controller's tuning, one group per part that reads it (each group's docstring
    says what its settings do). Build it from flat setting names with `of`."""

    targets: TargetParams = field(default_factory=TargetParams)
    learning: LearningParams = field(default_factory=LearningParams)
    workload: WorkloadParams = field(default_factory=WorkloadParams)
    adaptive_margin: AdaptiveMarginParams = field(default_factory=AdaptiveMarginParams)
    clock: ClockParams = field(default_factory=ClockParams)
    batch_caps: BatchCapParams = field(default_factory=BatchCapParams)
    quant: QuantParams = field(default_factory=QuantParams)
    pacing: PacingParams = field(default_factory=PacingParams)
    latency_guard: LatencyGuardParams = field(default_factory=LatencyGuardParams)
    power_guard: PowerGuardParams = field(default_factory=PowerGuardParams)
    fallback: FallbackParams = field(default_factory=FallbackParams)
    reference: ReferenceParams = field(default_factory=ReferenceParams)

    @classmethod
    def of(cls, **settings: Any) -> ControllerParams:
        """From flat setting names (each routed to its group); an unknown name is refused."""
        by_group: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            group = _GROUP_OF.get(name)
            if group is None:
                raise TypeError(f"ControllerParams has no setting {name!r}")
            by_group.setdefault(group, {})[name] = value
        return cls(**{g: _GROUP_TYPES[g](**kw) for g, kw in by_group.items()})

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        return {
            f.name: getattr(getattr(self, group), f.name)
            for group, kind in _GROUP_TYPES.items()
            for f in fields(kind)
        }


_GROUP_TYPES: dict[str, type] = {f.name: f.default_factory for f in fields(ControllerParams)}  # type: ignore[misc]
_GROUP_OF: dict[str, str] = {
    f.name: group for group, kind in _GROUP_TYPES.items() for f in fields(kind)
}
