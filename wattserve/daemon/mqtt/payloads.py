"""MQTT payloads and topics: versioned pydantic models, the JSON on the wire (docs/mqtt.md).

Every message the daemon publishes is one of these models serialised with `"schema": 1`
and units in field names; Home Assistant discovery configs are HA's own format. This
module also parses what arrives on `policy/set` into a plain dict (or a rejection reason)
without knowing the policy model: validating it is the policy handler's job.
It must not do I/O, hold connection state or import the engine, torch or the API.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from wattserve.daemon.config import MqttConfig
    from wattserve.daemon.device.protocol import Capabilities, Telemetry

SCHEMA_VERSION = 1
# A policy is a handful of numbers; anything much larger is not one.
MAX_POLICY_SET_BYTES = 16 * 1024


class _Payload(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class _Versioned(_Payload):
    # "schema" would shadow BaseModel.schema(); the wire name is the alias.
    schema_version: Literal[1] = Field(SCHEMA_VERSION, alias="schema")


# ---- status ----------------------------------------------------------------------------


class DeviceSummary(_Payload):
    """Which GPU this node drives, as `status` shows it."""

    backend: str
    name: str
    mode: str  # "control" | "observe"
    is_virtual: bool

    @classmethod
    def from_capabilities(cls, caps: Capabilities) -> DeviceSummary:
        return cls(backend=caps.backend, name=caps.name, mode=caps.mode, is_virtual=caps.is_virtual)


class StatusPayload(_Versioned):
    """`status` (retained): `online` while connected; `offline` from a clean stop
    (offline_reason "shutdown") or from the broker's Last Will ("connection_lost")."""

    state: Literal["online", "offline"]
    offline_reason: Literal["shutdown", "connection_lost"] | None = None
    node_id: str
    version: str
    started_unix_s: float
    phase: str | None = None  # while online, the serving phase: loading, warming, ready, ...
    model: str | None = None
    device: DeviceSummary | None = None


# ---- telemetry --------------------------------------------------------------------------


class DeviceFigures(_Payload):
    """The latest device reading; None where the device cannot measure it."""

    power_w: float | None = None
    power_avg_w: float | None = None
    energy_j: float | None = None  # the device's cumulative energy counter
    gpu_temp_c: float | None = None
    memory_temp_c: float | None = None
    thermal_margin_c: float | None = None
    slowdown_temp_c: float | None = None  # where the GPU starts slowing itself down
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    gpu_util_pct: float | None = None
    power_limit_w: float | None = None
    sm_clock_lock_mhz: tuple[int, int] | None = None
    clock_event_reasons: tuple[str, ...] = ()
    stale: bool = False

    @classmethod
    def from_telemetry(cls, t: Telemetry) -> DeviceFigures:
        return cls(
            power_w=_finite(t.power_w),
            power_avg_w=_finite(t.power_avg_w),
            energy_j=_finite(t.energy_j),
            gpu_temp_c=_finite(t.gpu_temp_c),
            memory_temp_c=_finite(t.memory_temp_c),
            thermal_margin_c=_finite(t.thermal_margin_c),
            slowdown_temp_c=_finite(t.slowdown_temp_c),
            sm_clock_mhz=t.sm_clock_mhz,
            mem_clock_mhz=t.mem_clock_mhz,
            gpu_util_pct=_finite(t.gpu_util_pct),
            power_limit_w=_finite(t.power_limit_w),
            sm_clock_lock_mhz=t.sm_clock_lock_mhz,
            clock_event_reasons=tuple(t.clock_event_reasons),
            stale=t.stale or t.device_lost,
        )


class ServingFigures(_Payload):
    """Engine load and throughput over the telemetry window."""

    requests_running: int | None = None
    requests_waiting: int | None = None
    requests_in_flight: int | None = None
    requests_finished: int | None = None  # within the window
    generation_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    energy_window_j: float | None = None
    energy_per_token_j: float | None = None  # window energy / generated tokens in the window
    kv_cache_usage_ratio: float | None = None


class LatencyFigures(_Payload):
    """Percentiles over requests finished within the window; None when there were none."""

    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    slo_attainment_ratio: float | None = None  # share meeting both TTFT and TPOT SLOs


class KnobFigures(_Payload):
    """The knobs in force."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    quant_level: str | None = None
    sm_clock_lock_mhz: tuple[int, int] | None = None
    power_limit_w: float | None = None
    decode_interval_ms: float | None = None


class TelemetryPayload(_Versioned):
    """`telemetry` (QoS 0, every mqtt.telemetry_interval_ms)."""

    time_unix_s: float = Field(default_factory=time.time)
    window_s: float | None = None
    phase: str | None = None
    device: DeviceFigures = DeviceFigures()
    serving: ServingFigures = ServingFigures()
    latency: LatencyFigures = LatencyFigures()
    knobs: KnobFigures = KnobFigures()
    policy: dict[str, Any] | None = None


# ---- events -----------------------------------------------------------------------------

EventKind = Literal[
    "decision",  # a controller decision; message holds its reason
    "policy_changed",
    "policy_rejected",
    "quantization_switch",
    "device_fault",
    "engine_fault",  # the engine loop died; the process exits for a restart
    "knob_drift",  # a device knob read back otherwise than the control loop set it
    "start",
    "drain",
    "stop",
]


class EventPayload(_Versioned):
    """`events` (QoS 1): something happened; `message` is one line for people."""

    kind: EventKind
    message: str = Field(..., max_length=2000)
    time_unix_s: float = Field(default_factory=time.time)
    data: dict[str, Any] = Field(default_factory=dict)


# A policy as the daemon holds it: a pydantic model, a dataclass instance or a dict.
PolicyLike = Any


def policy_fields(policy: PolicyLike) -> dict[str, Any]:
    """A policy as JSON-ready fields, from a pydantic model, a dataclass or a dict."""
    if isinstance(policy, BaseModel):
        return policy.model_dump(mode="json")
    if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
        fields = dataclasses.asdict(policy)
    elif isinstance(policy, dict):
        fields = dict(policy)
    else:
        raise TypeError(f"a policy must be a pydantic model, dataclass or dict, not {policy!r}")
    # Round-trip through JSON so enums and tuples come out as plain values.
    return json.loads(json.dumps(fields, allow_nan=False, default=str))


def policy_payload(policy: PolicyLike) -> bytes:
    """`policy` (retained): the policy in force, flat, plus `"schema": 1`.

    Flat so that a retained `policy` can be published back to `policy/set` unchanged.
    """
    return json.dumps({"schema": SCHEMA_VERSION, **policy_fields(policy)}).encode()


# ---- policy/set -------------------------------------------------------------------------


class PolicySetRejected(ValueError):
    """A `policy/set` payload that was not applied; the message says why, in one line."""

    def __init__(self, message: str, errors: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(message)
        self.errors = list(errors)


def parse_policy_set(payload: bytes) -> dict[str, Any]:
    """The policy fields of a `policy/set` message; raises PolicySetRejected.

    Accepts a JSON object, with or without `"schema": 1` (which is removed); the policy
    model itself validates the fields.
    """
    if len(payload) > MAX_POLICY_SET_BYTES:
        raise PolicySetRejected(
            f"payload is {len(payload)} bytes, more than {MAX_POLICY_SET_BYTES}"
        )
    try:
        data = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise PolicySetRejected(f"payload is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise PolicySetRejected(f"payload must be a JSON object, got {type(data).__name__}")
    if "schema" in data:
        version = data.pop("schema")
        if version != SCHEMA_VERSION:
            raise PolicySetRejected(
                f"unsupported schema {version!r}: this daemon speaks schema {SCHEMA_VERSION}"
            )
    return data


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def describe_rejection(error: Exception) -> PolicySetRejected:
    """A policy handler's error as a one-line reason with structured details."""
    if isinstance(error, PolicySetRejected):
        return error
    if isinstance(error, ValidationError):
        errors = [
            {
                "loc": ".".join(str(p) for p in e["loc"]) or "(policy)",
                "msg": e["msg"],
                "type": e["type"],
            }
            for e in error.errors(include_url=False, include_input=False)
        ]
        shown = "; ".join(f"{e['loc']}: {e['msg']}" for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        return PolicySetRejected(f"invalid policy: {shown}{more}", errors)
    return PolicySetRejected(f"invalid policy: {error}")


# ---- fleet: demand and grant (docs/fleet.md) ------------------------------------------


# Bounds on every number a fleet message carries: a node draws less than 100 kW, an epoch
# is a millisecond count that stays exact in a double, times lie before 2100. A value
# outside them is refused before any arithmetic sees it (a 1,000-digit epoch once made
# every later grant too long to parse).
MAX_FLEET_W = 100_000.0
MAX_FLEET_EPOCH = 2**53 - 1
MAX_UNIX_S = 4_102_444_800.0
MAX_RATIO = 1e6
# A grant or a demand is a few hundred bytes and two levels deep.
MAX_FLEET_BYTES = 4096
MAX_FLEET_DEPTH = 4
# Telemetry (read by the allocator for the measured power): a few kB, a few levels.
MAX_TELEMETRY_BYTES = 64 * 1024
MAX_TELEMETRY_DEPTH = 8

_Watts = Annotated[float, Field(ge=0, le=MAX_FLEET_W)]
_Epoch = Annotated[int, Field(ge=0, le=MAX_FLEET_EPOCH)]
_UnixS = Annotated[float, Field(ge=0, le=MAX_UNIX_S)]
# An HMAC-SHA256 in hex; empty until signed (wattserve.fleet.signing).
_Sig = Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")]


class GrantInForce(_Payload):
    """The grant a node runs under, as its demand reports it back to the allocator."""

    epoch: _Epoch
    budget_w: _Watts
    expires_at_unix_s: _UnixS


class DemandPayload(_Versioned):
    """`demand` (QoS 0, every fleet.demand_interval_ms, with [fleet] enabled): what this node
    asks of the fleet allocator, signed with the node's key (docs/fleet.md).

    need_w: power needed to meet its SLOs now; goodput_per_w: goodput (generated tokens/s
    of requests within the SLOs) per watt, the allocator's estimate of what a watt buys
    here; floor_w / ceiling_w: the range its grant may take (its safe floor or the device's
    minimum power limit, whichever is higher; the device's maximum), which the allocator
    clamps into the site's configured range; grant: the grant in force, null when it runs
    at its safe floor. epoch rises with every demand of this node; issued_at / expires_at
    bound when it may be taken.
    """

    node_id: str = Field(..., max_length=64)
    epoch: _Epoch
    issued_at_unix_s: _UnixS
    expires_at_unix_s: _UnixS
    need_w: _Watts
    goodput_per_w: float = Field(..., ge=0, le=MAX_RATIO)
    floor_w: _Watts
    ceiling_w: _Watts
    power_w: _Watts | None = None
    slo_pressure_ratio: float | None = Field(None, ge=0, le=MAX_RATIO)  # > 1: missing it
    grant: GrantInForce | None = None
    sig: _Sig = ""


class GrantPayload(_Versioned):
    """`grant` (QoS 1, retained, MQTT 5 message expiry = the lease): a node's power budget
    from the fleet allocator, signed with that node's key. Epochs only grow; a grant past
    expires_at_unix_s is void."""

    node_id: str = Field(..., max_length=64)
    budget_w: float = Field(..., gt=0, le=MAX_FLEET_W)
    epoch: _Epoch
    expires_at_unix_s: _UnixS
    issued_at_unix_s: _UnixS
    sig: _Sig = ""


def json_depth(payload: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text (brackets inside strings ignored)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in payload:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def check_bounds(payload: bytes, what: str, max_bytes: int, max_depth: int) -> None:
    """Raise ValueError when payload is longer or nests deeper than allowed."""
    if len(payload) > max_bytes:
        raise ValueError(f"{what} is {len(payload)} bytes, more than {max_bytes}")
    # No more brackets than levels allowed: no need to scan (the usual case).
    if payload.count(b"[") + payload.count(b"{") <= max_depth:
        return
    depth = json_depth(payload)
    if depth > max_depth:
        raise ValueError(f"{what} nests {depth} levels deep, more than {max_depth}")


def parse_json(payload: bytes, what: str, max_bytes: int, max_depth: int) -> Any:
    """A bounded JSON document; ValueError (never RecursionError) when it is not one."""
    check_bounds(payload, what, max_bytes, max_depth)
    try:
        return json.loads(payload, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} is not JSON: {e}") from None


def parse_grant(payload: bytes) -> GrantPayload:
    """A `grant` message, not yet verified; raises ValueError (pydantic's
    ValidationError is one)."""
    check_bounds(payload, "grant", MAX_FLEET_BYTES, MAX_FLEET_DEPTH)
    try:
        return GrantPayload.model_validate_json(payload)
    except RecursionError:
        raise ValueError("grant nests too deep") from None


def parse_demand(payload: bytes) -> DemandPayload:
    """A `demand` message, not yet verified; raises ValueError."""
    check_bounds(payload, "demand", MAX_FLEET_BYTES, MAX_FLEET_DEPTH)
    try:
        return DemandPayload.model_validate_json(payload)
    except RecursionError:
        raise ValueError("demand nests too deep") from None


# ---- topics -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Topics:
    """The topics of one node: `<prefix>/<node_id>/...`."""

    node_id: str
    base: str

    @classmethod
    def for_node(cls, prefix: str, node_id: str) -> Topics:
        return cls(node_id=node_id, base=f"{prefix}/{node_id}")

    @property
    def status(self) -> str:
        return f"{self.base}/status"

    @property
    def telemetry(self) -> str:
        return f"{self.base}/telemetry"

    @property
    def events(self) -> str:
        return f"{self.base}/events"

    @property
    def policy(self) -> str:
        return f"{self.base}/policy"

    @property
    def policy_set(self) -> str:
        return f"{self.base}/policy/set"

    @property
    def demand(self) -> str:
        return f"{self.base}/demand"

    @property
    def grant(self) -> str:
        return f"{self.base}/grant"


_NODE_ID_BAD = re.compile(r"[^A-Za-z0-9_.-]")


def resolve_node_id(cfg: MqttConfig, hostname: str | None = None) -> str:
    """mqtt.node_id, else the hostname made into one safe topic level."""
    if cfg.node_id is not None:
        return cfg.node_id
    host = hostname if hostname is not None else socket.gethostname()
    cleaned = _NODE_ID_BAD.sub("-", host).strip("-.")[:64]
    return cleaned or "node"


# ---- Home Assistant discovery ----------------------------------------------------------


@dataclass(frozen=True)
class _Sensor:
    object_id: str
    name: str
    path: tuple[str, ...]  # into the telemetry JSON
    unit: str | None
    device_class: str | None
    state_class: str | None = "measurement"
    scale: float | None = None  # multiply before reporting (J -> kWh)


HA_SENSORS: tuple[_Sensor, ...] = (
    _Sensor("power", "GPU power", ("device", "power_w"), "W", "power"),
    _Sensor(
        "energy",
        "GPU energy",
        ("device", "energy_j"),
        "kWh",
        "energy",
        "total_increasing",
        scale=1 / 3.6e6,
    ),
    _Sensor("gpu_temp", "GPU temperature", ("device", "gpu_temp_c"), "°C", "temperature"),
    _Sensor("sm_clock", "SM clock", ("device", "sm_clock_mhz"), "MHz", "frequency"),
    _Sensor(
        "throughput",
        "Generation throughput",
        ("serving", "generation_tokens_per_s"),
        "tokens/s",
        None,
    ),
    _Sensor("energy_per_token", "Energy per token", ("serving", "energy_per_token_j"), "J", None),
    _Sensor("running", "Requests running", ("serving", "requests_running"), None, None),
    _Sensor("waiting", "Requests waiting", ("serving", "requests_waiting"), None, None),
    _Sensor("ttft_p99", "TTFT p99", ("latency", "ttft_p99_ms"), "ms", "duration"),
    _Sensor("tpot_p99", "TPOT p99", ("latency", "tpot_p99_ms"), "ms", "duration"),
    _Sensor("slo_attainment", "SLO attainment", ("latency", "slo_attainment_ratio"), None, None),
)


def home_assistant_configs(topics: Topics, ha_prefix: str, version: str) -> list[tuple[str, bytes]]:
    """Retained discovery messages (`<ha_prefix>/sensor/<node>/<object>/config`, payload).

    HA's own config format, not a versioned wattserve payload. Sensors read the
    telemetry topic and take availability from `status`.
    """
    device = {
        "identifiers": [f"wattserve_{topics.node_id}"],
        "name": f"wattserve {topics.node_id}",
        "manufacturer": "wattserve",
        "sw_version": version,
    }
    out = []
    for s in HA_SENSORS:
        expr = "value_json." + ".".join(s.path)
        value = f"{expr} * {s.scale!r}" if s.scale is not None else expr
        config: dict[str, Any] = {
            "name": s.name,
            "unique_id": f"wattserve_{topics.node_id}_{s.object_id}",
            "state_topic": topics.telemetry,
            # A field the device cannot measure is null: report it as unknown.
            "value_template": f"{{{{ ({value}) if {expr} is not none else none }}}}",
            "availability_topic": topics.status,
            "availability_template": "{{ value_json.state }}",
            "payload_available": "online",
            "payload_not_available": "offline",
            "device": device,
        }
        if s.unit is not None:
            config["unit_of_measurement"] = s.unit
        if s.device_class is not None:
            config["device_class"] = s.device_class
        if s.state_class is not None:
            config["state_class"] = s.state_class
        topic = f"{ha_prefix}/sensor/{topics.node_id}/{s.object_id}/config"
        out.append((topic, json.dumps(config).encode()))
    return out


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None
