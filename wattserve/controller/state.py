"""The controller's vocabulary: its named states, the reason codes of its decisions, the
Decision it returns, the counters it keeps and the Choice its timescales hand back. Plain
data: this module must not import torch or the daemon, read a clock, or touch a device or an
engine.
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
    any      -- not measured ahead of the reference (ReferenceCheck) --> REFERENCE
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
    REFERENCE = "reference"


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
    # Not measured ahead of the reference configuration (or not yet measured against it):
    # the reference runs.
    REFERENCE = "reference"


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
