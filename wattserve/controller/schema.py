"""The pydantic edge of the policy, and the one translator each way to the frozen Policy.

PolicyModel: the policy an operator sets at run time, exactly the wire of PUT and GET
/v1/control/policy, the `policy` field of /v1/status, MQTT `policy/set` and the retained
`policy` payload (budget, both SLOs, mode; all required). PolicyPatch: some policy fields,
omitted ones kept (a budget-only change, a fleet grant). The [controller] config section
carries every policy field under the same names and goes through the same translator.

to_policy(edge, base) is the only way into a Policy; to_model(policy) the only way out.
Both edge models reject unknown keys, NaN and infinities. This module must not hold
controller logic; it only validates and converts.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from wattserve.controller.policy import Policy

ModeName = Literal["auto", "manual", "observe"]
ObjectiveName = Literal["min_energy_per_token", "min_latency"]

POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(Policy))


class _Strict(BaseModel):
    # Unknown keys are rejected by name: a typo ("power_budget") must not pass silently.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class PolicyModel(_Strict):
    """What the controller aims for, as set over HTTP and MQTT. Units are in the names;
    the fields not carried here (percentile, objective, quality limit) keep their value."""

    power_budget_w: float = Field(..., gt=0, le=100_000)
    ttft_slo_ms: float = Field(..., gt=0, le=3_600_000)
    tpot_slo_ms: float = Field(..., gt=0, le=3_600_000)
    mode: ModeName


class PolicyPatch(_Strict):
    """Some fields of a policy; omitted (or null) fields keep their value, except that an
    explicit null max_ppl_increase_pct clears the quality limit."""

    power_budget_w: float | None = Field(None, gt=0, le=100_000)
    ttft_slo_ms: float | None = Field(None, gt=0, le=3_600_000)
    tpot_slo_ms: float | None = Field(None, gt=0, le=3_600_000)
    slo_percentile: float | None = Field(None, gt=0, le=100)
    objective: ObjectiveName | None = None
    mode: ModeName | None = None
    max_ppl_increase_pct: float | None = Field(None, ge=0, le=1000)


def to_policy(edge: BaseModel, base: Policy | None = None) -> Policy:
    """The policy `edge` describes: a PolicyModel, a PolicyPatch or the [controller] config
    section (its policy fields, by name). Fields `edge` does not carry come from `base`
    (the policy in force), or from Policy's defaults without one. Raises ValueError (from
    Policy's checks) where the fields do not make a policy."""
    if isinstance(edge, PolicyPatch):
        fields = {
            k: v
            for k, v in edge.model_dump(exclude_unset=True).items()
            if v is not None or k == "max_ppl_increase_pct"
        }
    else:
        fields = edge.model_dump(include=set(POLICY_FIELDS))
    return Policy(**fields) if base is None else dataclasses.replace(base, **fields)


def to_model(policy: Policy) -> PolicyModel:
    """The policy in force as HTTP and MQTT show it."""
    return PolicyModel(
        power_budget_w=policy.power_budget_w,
        ttft_slo_ms=policy.ttft_slo_ms,
        tpot_slo_ms=policy.tpot_slo_ms,
        mode=policy.mode.value,
    )
