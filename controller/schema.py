"""The pydantic models at the controller's edge, shared by the HTTP control API and MQTT.

PolicyModel: a complete policy (the body of PUT /v1/control/policy, the retained MQTT
`policy` payload and a full `policy/set`). PolicyPatch: some fields of a policy (a fleet
manager setting only the budget over MQTT, or a PATCH). Both reject unknown keys, NaN and
infinities, and convert to and from the controller's frozen Policy. This module must not
hold controller logic; it only validates and converts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from controller.policy import ControlMode, Objective, Policy

ModeName = Literal["auto", "manual", "observe"]
ObjectiveName = Literal["min_energy_per_token", "min_latency"]


class _Strict(BaseModel):
    # Unknown keys are rejected by name: a typo ("power_budget") must not pass silently.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class PolicyModel(_Strict):
    """A complete control policy. Units are in the names."""

    power_budget_w: float = Field(..., gt=0, le=100_000, description="Hard power ceiling, W.")
    ttft_slo_ms: float = Field(..., gt=0, le=3_600_000, description="Time-to-first-token SLO.")
    tpot_slo_ms: float = Field(..., gt=0, le=3_600_000, description="Time-per-output-token SLO.")
    slo_percentile: float = Field(99.0, gt=0, le=100, description="Percentile the SLOs hold at.")
    objective: ObjectiveName = Field(
        "min_energy_per_token", description="What to minimise among SLO-meeting settings."
    )
    mode: ModeName = Field(
        ...,
        description="auto: the controller drives; manual: knobs from the API, guarded; "
        "observe: decisions are advice only.",
    )
    max_ppl_increase_pct: float | None = Field(
        None,
        ge=0,
        le=1000,
        description="Quantization levels above this measured perplexity increase are never "
        "selected; null: no limit beyond engine.quantization_levels.",
    )

    def to_policy(self) -> Policy:
        return Policy(
            power_budget_w=self.power_budget_w,
            ttft_slo_ms=self.ttft_slo_ms,
            tpot_slo_ms=self.tpot_slo_ms,
            slo_percentile=self.slo_percentile,
            objective=Objective(self.objective),
            mode=ControlMode(self.mode),
            max_ppl_increase_pct=self.max_ppl_increase_pct,
        )

    @classmethod
    def from_policy(cls, policy: Policy) -> PolicyModel:
        return cls(
            power_budget_w=policy.power_budget_w,
            ttft_slo_ms=policy.ttft_slo_ms,
            tpot_slo_ms=policy.tpot_slo_ms,
            slo_percentile=policy.slo_percentile,
            objective=policy.objective.value,
            mode=policy.mode.value,
            max_ppl_increase_pct=policy.max_ppl_increase_pct,
        )


class PolicyPatch(_Strict):
    """Some fields of a policy; omitted fields keep their value."""

    power_budget_w: float | None = Field(None, gt=0, le=100_000)
    ttft_slo_ms: float | None = Field(None, gt=0, le=3_600_000)
    tpot_slo_ms: float | None = Field(None, gt=0, le=3_600_000)
    slo_percentile: float | None = Field(None, gt=0, le=100)
    objective: ObjectiveName | None = None
    mode: ModeName | None = None
    max_ppl_increase_pct: float | None = Field(None, ge=0, le=1000)

    def apply_to(self, policy: Policy) -> Policy:
        """The policy with this patch's fields replaced (an explicit null limit clears it)."""
        changes = self.model_dump(exclude_unset=True)
        for key in ("objective", "mode"):
            if changes.get(key) is not None:
                changes[key] = (Objective if key == "objective" else ControlMode)(changes[key])
        changes = {k: v for k, v in changes.items() if v is not None or k == "max_ppl_increase_pct"}
        return policy.with_changes(**changes)
