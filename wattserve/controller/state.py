"""The controller's vocabulary: its named states, the reason codes of its decisions, its
tunable parameters (ControllerParams), the Decision it returns, the counters it keeps and
the Choice its timescales hand back. Plain data: this module must not import torch or the
daemon, read a clock, or touch a device or an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from wattserve.controller.models import Prediction
from wattserve.controller.policy import ControlMode, Knobs


class ControllerState(StrEnum):
    """Where the controller is. Transitions (checked in this order every observation):

    any      -- telemetry stale or missing ------------------------> HOLD
    HOLD     -- still stale after stale_hold_s ---------------------> FALLBACK
    HOLD/FALLBACK -- fresh telemetry --------------------------------> (re-evaluated below)
    any      -- mode manual ------------------------------------------> MANUAL
    any      -- measured power over the (derated) budget -------------> GUARD_POWER
    any      -- waiting queue grows / measured SLO miss (auto, observe) -> GUARD_LATENCY
    any      -- nothing running or waiting for idle_after_s ----------> IDLE
    any      -- too few samples for the models at this level ---------> LEARNING
    otherwise ---------------------------------------------------------> TRACKING
    """

    LEARNING = "learning"
    TRACKING = "tracking"
    IDLE = "idle"
    GUARD_LATENCY = "guard_latency"
    GUARD_POWER = "guard_power"
    HOLD = "hold"
    FALLBACK = "fallback"
    MANUAL = "manual"


class Reason(StrEnum):
    """Why a decision is what it is; each one is counted."""

    LEARNING = "learning"
    OPTIMIZE = "optimize"
    STEADY = "steady"
    INFEASIBLE = "infeasible"
    IDLE = "idle"
    QUEUE_GROWTH = "guard_queue_growth"
    SLO_MISS = "guard_slo_miss"
    OVER_BUDGET = "guard_over_budget"
    STALE_HOLD = "stale_hold"
    STALE_FALLBACK = "stale_fallback"
    MANUAL = "manual"
    QUANT_SWITCH = "quant_switch"
    QUANT_EXPLORE = "quant_explore"
    QUANT_FORBIDDEN = "quant_forbidden"
    # The hardware is slowing the GPU down (HwSlowdown, HwThermal, HwPowerBrake): the
    # decision's clock raise is held back until it clears.
    HW_SLOWDOWN_HOLD = "hw_slowdown_hold"
    # A descent (a lower clock or a longer decode interval) whose measured latencies came
    # near the SLO before it had earned its way: reverted, the lower setting barred.
    DESCENT_REVERTED = "guard_descent_reverted"


@dataclass(frozen=True)
class ControllerParams:
    """Tuning of the controller; defaults suit a GPU with a 100 ms telemetry period.

    Timescales: the clock may change every clock_min_interval_s (down: also only descend_hold_s
    after a move up, for a clock_gain_min_pct gain, and while the level's model has fewer than
    descend_evidence_steps steps, below the clocks it has seen only after a first token at the
    clock in force), the batch caps every batch_period_s (the chunk at most every
    chunk_period_s, growing only within chunk_grow_margin of its bound), the quantization level
    after quant_dwell_s for a predicted gain of quant_gain_min_pct (a never-run level is tried
    for quant_explore_dwell_s; a level that cannot cope for quant_stuck_s is left sooner); with
    quant_start_by_table, before any level is trained the controller moves to the allowed level
    bench quant's table ranks fastest (the level left is then tried like any never-run one); a
    level's model is trusted up to batch_trust_factor x the largest decode batch it has been
    fitted around (at least batch_trust_min), and a switch needs that trust at the largest batch
    of the last quant_peak_window_s; nothing switches while a queue is served or a guard holds,
    unless the level has not coped for quant_stuck_busy_s. A trial is judged on its measured
    steps as they come: once quant_trial_min_steps steps and quant_trial_evidence_s of them have
    run, a level whose steps took more than quant_trial_slowdown_max x what the level before
    would have taken (its model, at the clocks they ran) is left at once, and not tried again
    for quant_slow_retry_s; a trial still learning after quant_trial_max_s ends too (bench
    quant's speed table may come from another machine). A calm trial's first steps run with
    1/quant_trial_probe_fraction of the chunk; a never-run level the table ranks slower than the
    level in force is not tried calmly once batches of quant_table_batch_min run (the table's
    speed is a batch-16 figure), and a level in force that the table ranks slower than one
    already run here is left for that one there. Decode pacing: the interval is 0 or one of
    pace_fractions x the TPOT SLO (within the engine's longest); a shorter one is weighed with
    the clocks every observation, a longer one at most every pace_period_s (pace_backoff_s more
    after the clock search shortened it because the targets were predicted missed), once the
    level's model has descend_evidence_steps steps, and never through a trial; it is off once no
    request has arrived for pace_lull_gaps mean gaps (at least pace_period_s, and not within
    pace_period_s of a longer interval chosen) and while the running batch fills
    guard_cap_share of the engine's cap. A prefill chunk's step at the clock in force stays
    within chunk_step_slo_factor x the TPOT SLO and chunk_step_ttft_factor x the TTFT SLO; below
    that bound a smaller chunk is taken where it is predicted to save chunk_gain_min_pct, and
    the chunk in force is left only for that gain.
    Margins: predictions must meet slo_margin x SLO (x descend_margin for a lower clock, whose
    prediction is made at the load descend_load_z standard errors of the estimated request
    rate above it: arrivals at random make the estimate swing) and power_margin x budget;
    the load's rates, prompt and output sizes are averaged over workload_tau_s;
    the board power limit is set to power_limit_margin x budget; a reading within
    power_noise_tolerance over the budget is noise. Guards: a latency guard
    raises the clock by guard_clock_steps candidates, or to the
    lowest clock predicted to prefill the waiting queue within slo_margin x the TTFT SLO (at
    most every guard_cooldown_s), and holds that floor for guard_hold_s (a floor a queue put up,
    not a miss or a long wait, lets go guard_release_s after the step up or later, once the
    queue has stayed empty for the waiting history and the running batch is off the engine's
    cap; quantization trials still wait guard_hold_s); a running batch of at
    least guard_cap_share x the engine's largest max_num_seqs that grew guard_rise_factor x over
    the last guard_rise_ticks observations (a burst filling the engine) takes the top clock the
    budget allows and no pacing at once, where the board limit holds the budget, and so does a
    queue guard while the arrivals surge (the requests of the last surge_window_s are at least
    surge_min_ratio x, and with Poisson probability under surge_alpha, what the request rate
    estimated before them gives); a surge with no queue steps up guard_clock_steps, pacing
    off, on a queue's floor. Adaptive
    margin: each measured TTFT and TPOT over the model's percentile prediction in force is kept
    per level and clock; the split-conformal (1 - margin_alpha) quantile of those ratios (the
    clock's own where it has enough, else pooled; at most margin_max, never below 1) multiplies
    a prediction before it is compared with the SLO (too few ratios: 1, the fixed margin
    alone); a TTFT counts if its request arrived under the configuration predicted, a TPOT once
    that configuration has held margin_settle_s, neither while requests queue nor before the
    level's model has descend_evidence_steps steps. Descents earn their way: for
    descent_watch_s after the optimizer lowers the clock or lengthens the decode interval, the
    descent_watch_percentile of the TTFT and TPOT measured since is watched; at
    descent_guard_fraction x its SLO the descent is reverted at once and the clock below (and a
    longer interval) barred for descent_bar_s. A power guard lowers the clock at once and holds that
    ceiling for power_hold_s (anti-windup; doubled up to power_hold_max_s when it fires again soon,
    and for power_hold_max_s after it fires on power read wholly under the board limit set for the
    budget, that limit is not trusted to hold it; a reading still averaging power from before a cut
    is not held against it), released once power is under power_release_margin x budget. Thermal:
    the budget is derated linearly from 1 at thermal_derate_start_c of margin to thermal_derate_min
    at thermal_derate_full_c. Stale telemetry: hold for stale_hold_s, then the fallback knobs.
    Learning: learning_min_steps steps (the first level's second half at learning_low_clock_fraction
    x the top clock) and learning_min_power_samples readings before the models are used; a clock
    counts as seen after trust_min_samples steps, and trust reaches trust_clock_steps beyond.
    Re-learning: while the level's latest steps took more than surprise_max x what its step model
    predicted for them (the median of three), the model no longer describes the engine (a sudden
    slowdown) and its fit swings as it learns the new one; the caps, clock and decode interval are
    held (the guards and the quantization timescale still act). Steps faster than predicted hold
    nothing: a model that over-predicts errs towards the SLOs.
    """

    batch_period_s: float = 2.0
    quant_dwell_s: float = 30.0
    quant_explore_dwell_s: float = 10.0
    quant_start_by_table: bool = True
    quant_gain_min_pct: float = 10.0
    quant_stuck_s: float = 3.0
    clock_gain_min_pct: float = 3.0
    clock_min_interval_s: float = 1.0
    clock_candidates: int = 12
    descend_margin: float = 0.9
    descend_load_z: float = 1.0
    workload_tau_s: float = 8.0
    descend_hold_s: float = 5.0
    descend_evidence_steps: int = 300
    chunk_step_slo_factor: float = 2.5
    chunk_step_ttft_factor: float = 0.3
    chunk_grow_margin: float = 0.75
    chunk_period_s: float = 10.0
    chunk_gain_min_pct: float = 0.5
    slo_margin: float = 0.85
    power_margin: float = 0.95
    power_limit_margin: float = 0.98
    guard_clock_steps: int = 3
    guard_cap_share: float = 0.75
    guard_rise_ticks: int = 8
    guard_rise_factor: float = 1.3
    guard_cooldown_s: float = 1.0
    guard_hold_s: float = 10.0
    guard_release_s: float = 2.0
    surge_window_s: float = 2.0
    surge_alpha: float = 1e-5
    surge_min_ratio: float = 2.0
    margin_alpha: float = 0.1
    margin_max: float = 4.0
    margin_settle_s: float = 60.0
    descent_watch_s: float = 30.0
    descent_watch_percentile: float = 90.0
    descent_guard_fraction: float = 0.85
    descent_bar_s: float = 60.0
    power_hold_s: float = 5.0
    power_hold_max_s: float = 60.0
    power_release_margin: float = 0.9
    power_noise_tolerance: float = 0.02
    queue_growth_ticks: int = 3
    thermal_derate_start_c: float = 6.0
    thermal_derate_full_c: float = 0.0
    thermal_derate_min: float = 0.6
    stale_hold_s: float = 2.0
    fallback_sm_clock_mhz: int | None = None
    fallback_max_num_seqs: int | None = None
    idle_after_s: float = 0.5
    learning_min_steps: int = 30
    learning_min_power_samples: int = 8
    learning_low_clock_fraction: float = 0.5
    surprise_max: float = 3.0
    trust_clock_steps: int = 2
    trust_min_samples: int = 10
    batch_trust_factor: float = 1.5
    batch_trust_min: int = 4
    quant_peak_window_s: float = 120.0
    quant_stuck_busy_s: float = 20.0
    quant_trial_slowdown_max: float = 1.25
    quant_trial_evidence_s: float = 1.0
    quant_trial_min_steps: int = 2
    quant_trial_max_s: float = 30.0
    quant_trial_probe_fraction: int = 8
    quant_slow_retry_s: float = 600.0
    quant_table_batch_min: int = 8
    pace_period_s: float = 5.0
    pace_backoff_s: float = 30.0
    pace_lull_gaps: float = 5.0
    pace_fractions: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)

    def __post_init__(self) -> None:
        for name in (
            "batch_period_s",
            "quant_dwell_s",
            "quant_explore_dwell_s",
            "clock_min_interval_s",
            "slo_margin",
            "power_margin",
            "power_limit_margin",
            "stale_hold_s",
            "power_release_margin",
            "chunk_step_ttft_factor",
            "batch_trust_factor",
            "quant_peak_window_s",
            "workload_tau_s",
            "surge_window_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"ControllerParams.{name} must be > 0")
        for name in ("slo_margin", "power_margin", "power_limit_margin", "power_release_margin"):
            if getattr(self, name) > 1:
                raise ValueError(f"ControllerParams.{name} must be <= 1")
        if not 0 < self.thermal_derate_min <= 1:
            raise ValueError("ControllerParams.thermal_derate_min must be in (0, 1]")
        if self.thermal_derate_full_c >= self.thermal_derate_start_c:
            raise ValueError("ControllerParams: thermal_derate_full_c must be < _start_c")
        if self.clock_candidates < 2 or self.guard_clock_steps < 1:
            raise ValueError("ControllerParams: clock_candidates >= 2, guard_clock_steps >= 1")
        if self.pace_backoff_s < 0 or self.descend_load_z < 0:
            raise ValueError("ControllerParams: pace_backoff_s >= 0, descend_load_z >= 0")
        if not 0 < self.surge_alpha < 1 or self.surge_min_ratio < 1:
            raise ValueError("ControllerParams: 0 < surge_alpha < 1, surge_min_ratio >= 1")
        if not 0 < self.learning_low_clock_fraction <= 1:
            raise ValueError("ControllerParams.learning_low_clock_fraction must be in (0, 1]")
        if not self.surprise_max > 1:
            raise ValueError("ControllerParams.surprise_max must be > 1")
        if not 0 < self.chunk_grow_margin <= 1:
            raise ValueError("ControllerParams.chunk_grow_margin must be in (0, 1]")
        if self.quant_trial_probe_fraction < 1 or self.quant_trial_slowdown_max < 1:
            raise ValueError(
                "ControllerParams: quant_trial_probe_fraction >= 1, quant_trial_slowdown_max >= 1"
            )
        if not 0 < self.margin_alpha < 1 or self.margin_max < 1:
            raise ValueError("ControllerParams: margin_alpha in (0, 1), margin_max >= 1")
        if not 0 < self.descent_guard_fraction <= 1 or not 0 < self.descent_watch_percentile <= 100:
            raise ValueError(
                "ControllerParams: descent_guard_fraction in (0, 1], "
                "descent_watch_percentile in (0, 100]"
            )
        if self.power_hold_max_s < self.power_hold_s:
            raise ValueError("ControllerParams.power_hold_max_s must be >= power_hold_s")
        if not self.pace_period_s > 0 or not all(0 < f <= 1 for f in self.pace_fractions):
            raise ValueError("ControllerParams: pace_period_s > 0, pace_fractions each in (0, 1]")


@dataclass(frozen=True)
class Decision:
    """One observation's outcome: the complete knob setting and why.

    apply: False in observe mode (advice only: nothing may be applied). changed: knobs that
    differ from the previous decision. effective_budget_w: the budget after thermal
    derating. prediction: the model's view of the chosen configuration, when it has one.
    """

    at_s: float
    seq: int
    state: ControllerState
    mode: ControlMode
    knobs: Knobs
    changed: tuple[str, ...]
    apply: bool
    reason_code: Reason
    reason: str
    effective_budget_w: float
    prediction: Prediction | None = None

    def to_dict(self) -> dict:
        """JSON-ready form (events, /v1/status)."""
        k = self.knobs
        out = {
            "at_s": self.at_s,
            "seq": self.seq,
            "state": self.state.value,
            "mode": self.mode.value,
            "apply": self.apply,
            "reason_code": self.reason_code.value,
            "reason": self.reason,
            "changed": list(self.changed),
            "effective_budget_w": round(self.effective_budget_w, 2),
            "knobs": {
                "max_num_seqs": k.max_num_seqs,
                "max_num_batched_tokens": k.max_num_batched_tokens,
                "quant_level": k.quant_level,
                "sm_clock_mhz": k.sm_clock_mhz,
                "power_limit_w": k.power_limit_w,
                "decode_interval_ms": k.decode_interval_ms,
            },
            "prediction": None,
        }
        p = self.prediction
        if p is not None and math.isfinite(p.j_per_token):
            out["prediction"] = {
                "j_per_token": round(p.j_per_token, 5),
                "ttft_ms": round(p.ttft_ms, 1),
                "tpot_ms": round(p.tpot_ms, 1),
                "power_w": round(p.power_w, 1),
                "peak_power_w": round(p.peak_power_w, 1),
            }
        return out


@dataclass
class ControllerCounters:
    """Counts since start: decisions by reason code, knob changes by knob, state
    transitions as 'from->to'."""

    decisions: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in Reason})
    knob_changes: dict[str, int] = field(default_factory=dict)
    transitions: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> dict:
        return {
            "decisions": dict(self.decisions),
            "knob_changes": dict(self.knob_changes),
            "transitions": dict(self.transitions),
        }


@dataclass
class Choice:
    state: ControllerState
    knobs: Knobs
    code: Reason
    reason: str
    prediction: Prediction | None = None
