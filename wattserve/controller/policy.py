"""What the controller aims for (Policy) and what it turns (Knobs), as plain frozen values.

Policy: the power budget (a hard ceiling), the TTFT and TPOT SLOs at a percentile, the
objective, the quality limit on quantization and the mode (auto / manual / observe).
Knobs: the engine's batch caps and weight quantization level, the SM clock lock and the
board power limit. Both validate on construction and raise ValueError naming the field.
The pydantic models the HTTP API and MQTT share live in wattserve/controller/schema.py; this module
must not import pydantic, torch or anything that performs I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum


class ControlMode(StrEnum):
    """Who turns the knobs.

    AUTO: the controller drives every knob. MANUAL: knobs come from the operator
    (PUT /v1/control/knobs); the controller only guards the power budget and the
    temperature. OBSERVE: decisions are computed and published as advice, nothing applied.
    """

    AUTO = "auto"
    MANUAL = "manual"
    OBSERVE = "observe"


class Objective(StrEnum):
    """What to minimise among the configurations predicted to meet the SLOs.

    MIN_ENERGY_PER_TOKEN: least predicted J per output token (the default).
    MIN_LATENCY: most latency headroom (highest clock and largest batch the budget allows).
    """

    MIN_ENERGY_PER_TOKEN = "min_energy_per_token"
    MIN_LATENCY = "min_latency"


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class Policy:
    """The operator's goals. Units are in the names; percentile is in (0, 100]."""

    power_budget_w: float
    ttft_slo_ms: float
    tpot_slo_ms: float
    slo_percentile: float = 99.0
    objective: Objective = Objective.MIN_ENERGY_PER_TOKEN
    mode: ControlMode = ControlMode.OBSERVE
    # Quantization levels whose measured perplexity increase over full precision exceeds
    # this are never selected; None: no quality limit beyond engine.quantization_levels.
    max_ppl_increase_pct: float | None = None

    def __post_init__(self) -> None:
        _positive("power_budget_w", self.power_budget_w)
        _positive("ttft_slo_ms", self.ttft_slo_ms)
        _positive("tpot_slo_ms", self.tpot_slo_ms)
        _positive("slo_percentile", self.slo_percentile)
        if self.slo_percentile > 100:
            raise ValueError(f"slo_percentile must be <= 100, got {self.slo_percentile!r}")
        object.__setattr__(self, "objective", Objective(self.objective))
        object.__setattr__(self, "mode", ControlMode(self.mode))
        if self.max_ppl_increase_pct is not None:
            if not math.isfinite(self.max_ppl_increase_pct) or self.max_ppl_increase_pct < 0:
                raise ValueError(
                    f"max_ppl_increase_pct must be >= 0 or None, got {self.max_ppl_increase_pct!r}"
                )

    def with_changes(self, **changes: object) -> Policy:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Knobs:
    """One complete setting of every knob.

    max_num_seqs / max_num_batched_tokens: the engine's batch caps.
    quant_level: the engine's weight quantization level (None: leave as it is).
    sm_clock_mhz: upper bound of the SM clock lock (None: unlocked).
    power_limit_w: the board power limit (None: leave as it is).
    decode_interval_ms: decode pacing: a decode-only step starts no sooner than this after
    the step before while no request waits (0: off).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    quant_level: str | None = None
    sm_clock_mhz: int | None = None
    power_limit_w: float | None = None
    decode_interval_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.sm_clock_mhz is not None and (
            isinstance(self.sm_clock_mhz, bool)
            or not isinstance(self.sm_clock_mhz, int)
            or self.sm_clock_mhz < 1
        ):
            raise ValueError(
                f"sm_clock_mhz must be an integer >= 1 or None, got {self.sm_clock_mhz!r}"
            )
        if self.power_limit_w is not None:
            _positive("power_limit_w", self.power_limit_w)
        d = self.decode_interval_ms
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d < math.inf:
            raise ValueError(f"decode_interval_ms must be a number >= 0, got {d!r}")

    def changed_fields(self, other: Knobs | None) -> tuple[str, ...]:
        """Names of the knobs that differ from `other` (all of them when other is None)."""
        names = (
            "max_num_seqs",
            "max_num_batched_tokens",
            "quant_level",
            "sm_clock_mhz",
            "power_limit_w",
            "decode_interval_ms",
        )
        if other is None:
            return names
        return tuple(n for n in names if getattr(self, n) != getattr(other, n))

    def with_changes(self, **changes: object) -> Knobs:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class QuantOption:
    """A weight quantization level the engine can switch to, with its measured quality cost.

    ppl_increase_pct: perplexity increase over the full-precision level (bench quant's
    table); None when not measured. weight_bytes: the level's matmul weight bytes (0 when
    unknown). decode_tok_s: measured decode throughput at batch 16 (bench quant's
    decode_tok_s_bs16; None when unknown). prefill_tok_s: measured prefill throughput
    (bench quant's prefill_tok_s; None when unknown). The last three only order the levels
    the controller tries first, and keep it from trying one whose prefill the table
    measured much slower; what it keeps is decided from its own measurements.
    """

    level: str
    ppl_increase_pct: float | None = None
    weight_bytes: int = 0
    decode_tok_s: float | None = None
    prefill_tok_s: float | None = None


def allowed_quant_levels(
    options: tuple[QuantOption, ...], full_precision: str, max_ppl_increase_pct: float | None
) -> tuple[str, ...]:
    """The levels a quality limit allows: all when there is none (None); else those whose
    measured perplexity increase is within it. The full-precision level always qualifies;
    an unmeasured (or NaN) level does not (its quality cost is unknown)."""
    limit = max_ppl_increase_pct
    out = []
    for opt in options:
        if limit is None or opt.level == full_precision:
            out.append(opt.level)
        elif opt.ppl_increase_pct is not None and opt.ppl_increase_pct <= limit:
            out.append(opt.level)
    return tuple(out)
