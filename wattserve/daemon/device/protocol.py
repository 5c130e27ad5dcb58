"""The device contract: what the daemon reads from a GPU and what it may ask it to change.

This module holds only value types, the `Device` protocol the rest of the daemon uses,
the `DeviceBackend` protocol that nvml.py and virtual.py implement, and the errors.
It must not import pynvml, torch or the engine, and must not perform I/O.
Units are in the names: _w watts, _j joules, _c degrees Celsius, _mhz, _s seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, Protocol

BackendName = Literal["nvml", "virtual"]
DeviceMode = Literal["control", "observe"]

# NVML's clock-event ("throttle") reason bits, named as the daemon reports them. The bit
# values are NVML's own (nvmlClocksEventReason*), so the virtual GPU reports the same masks.
CLOCK_EVENT_REASON_BITS: tuple[tuple[int, str], ...] = (
    (0x1, "GpuIdle"),
    (0x2, "ApplicationsClocksSetting"),
    (0x4, "SwPowerCap"),
    (0x8, "HwSlowdown"),
    (0x10, "SyncBoost"),
    (0x20, "SwThermal"),
    (0x40, "HwThermal"),
    (0x80, "HwPowerBrake"),
    (0x100, "DisplayClockSetting"),
)
REASON_GPU_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80


def decode_clock_event_reasons(mask: int) -> tuple[str, ...]:
    """Names for the bits set in an NVML clock-event reason mask; unknown bits as UnknownBit0x..."""
    names = [name for bit, name in CLOCK_EVENT_REASON_BITS if mask & bit]
    known = 0
    for bit, _ in CLOCK_EVENT_REASON_BITS:
        known |= bit
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"UnknownBit0x{bit:x}")
            rest &= ~bit
        bit <<= 1
    return tuple(names)


class Knob(StrEnum):
    """A device setting the daemon may change."""

    POWER_LIMIT = "power_limit_w"
    SM_CLOCKS = "sm_clock_lock_mhz"


class SetOutcome(StrEnum):
    """What happened to a setter call."""

    APPLIED = "applied"  # the device accepted the (clamped) target
    UNCHANGED = "unchanged"  # already in force; nothing was sent
    OBSERVE_ONLY = "observe_only"  # device.mode = observe: setters never run
    UNAVAILABLE = (
        "unavailable"  # the device refused (NO_PERMISSION / NOT_SUPPORTED): knob is read-only
    )
    DEVICE_LOST = (
        "device_lost"  # GPU lost or driver reloading; nothing was sent or its effect is unknown
    )
    FAILED = "failed"  # any other driver error


IN_FORCE = frozenset({SetOutcome.APPLIED, SetOutcome.UNCHANGED})


class DeviceError(RuntimeError):
    """A device problem, worded as one line an operator can act on."""


class NvmlUnavailableError(DeviceError):
    """NVML is absent: the pynvml module is not installed or libnvidia-ml cannot be loaded."""


class DeviceLostError(DeviceError):
    """The GPU fell off the bus or the driver is reloading; the backend re-initialises."""


class KnobUnavailableError(DeviceError):
    """The device refused a setter for good (NO_PERMISSION / NOT_SUPPORTED)."""

    def __init__(self, knob: Knob, reason: str) -> None:
        super().__init__(f"{knob.value}: {reason}")
        self.knob = knob
        self.reason = reason


class StateFileError(DeviceError):
    """The settings state file cannot be read or written."""


@dataclass(frozen=True)
class EngineActivity:
    """What one engine step did, as the virtual GPU needs it to price time and power.

    step_duration_s: the step's measured wall time on this machine.
    prefill_tokens / decode_tokens: tokens the step processed (carried for accounting).
    weight_bytes_read / kv_bytes_read: bytes the step's matmuls and attention read.
    flops: floating-point operations of the step (about 2 x parameters x tokens + attention).
    """

    step_duration_s: float
    prefill_tokens: int = 0
    decode_tokens: int = 0
    weight_bytes_read: int = 0
    kv_bytes_read: int = 0
    flops: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "step_duration_s",
            "prefill_tokens",
            "decode_tokens",
            "weight_bytes_read",
            "kv_bytes_read",
            "flops",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"EngineActivity.{name} must be a finite number >= 0, got {value!r}"
                )

    @property
    def bytes_read(self) -> int:
        return self.weight_bytes_read + self.kv_bytes_read


@dataclass(frozen=True)
class Telemetry:
    """One snapshot of a GPU. Fields a device cannot provide are None.

    timestamp_s is the device's monotonic clock (simulated time for a simulated GPU).
    power_w is instantaneous when power_w_is_instant, else the driver's default reading;
    power_avg_w is the device's own average over power_avg_window_s. Energy over a window
    must come from energy_j deltas (see energy_between_j), never from averaged power.
    sm_app_clock_mhz is the SM application clock (the target of a busy GPU with no lock).
    sm_clock_lock_mhz is the lock this daemon set and still believes in force (None: none
    known): NVML cannot read a lock back, so the NVML backend keeps it only while the
    clocks the GPU enforces agree with it (device/clock_check.py).
    thermal_margin_c is the distance to the nearest thermal slowdown threshold.
    stale: older than two sampling periods, or the GPU is lost; hold, do not act on it.
    """

    timestamp_s: float
    power_w: float | None = None
    power_w_is_instant: bool = False
    power_avg_w: float | None = None
    power_avg_window_s: float | None = None
    energy_j: float | None = None
    gpu_temp_c: float | None = None
    memory_temp_c: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    sm_app_clock_mhz: int | None = None
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    clock_event_reasons_mask: int | None = None
    clock_event_reasons: tuple[str, ...] = ()
    power_limit_w: float | None = None
    power_limit_default_w: float | None = None
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    sm_clock_ladder_mhz: tuple[int, ...] = ()
    sm_clock_lock_mhz: tuple[int, int] | None = None
    max_operating_temp_c: float | None = None
    slowdown_temp_c: float | None = None
    thermal_margin_c: float | None = None
    device_lost: bool = False
    stale: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for status, metrics and MQTT payloads)."""
        out = asdict(self)
        out["clock_event_reasons"] = list(self.clock_event_reasons)
        out["sm_clock_ladder_mhz"] = list(self.sm_clock_ladder_mhz)
        out["sm_clock_lock_mhz"] = list(self.sm_clock_lock_mhz) if self.sm_clock_lock_mhz else None
        return out


_NOT_MEASUREMENTS = frozenset(
    {
        "timestamp_s",
        "power_w_is_instant",
        "clock_event_reasons_mask",
        "sm_clock_lock_mhz",
        "device_lost",
        "stale",
    }
)


def provided_measurements(telemetry: Telemetry) -> tuple[str, ...]:
    """Names of the measurements a snapshot carries (what a device can read)."""
    return tuple(
        f.name
        for f in fields(Telemetry)
        if f.name not in _NOT_MEASUREMENTS and getattr(telemetry, f.name) not in (None, ())
    )


def energy_between_j(earlier: Telemetry, later: Telemetry) -> float | None:
    """Energy used between two snapshots, from the device's energy counter."""
    if earlier.energy_j is None or later.energy_j is None:
        return None
    return later.energy_j - earlier.energy_j


@dataclass(frozen=True)
class KnobCapability:
    knob: Knob
    writable: bool
    reason: str = ""  # why it is read-only, or a note on its state


@dataclass(frozen=True)
class Capabilities:
    """What this device can read and change, as discovered at start and updated since."""

    backend: BackendName
    name: str
    uuid: str
    pci_bus_id: str
    mode: DeviceMode
    update_period_s: float  # the device's own telemetry update period
    readable: tuple[str, ...]  # Telemetry field names this device fills in
    knobs: tuple[KnobCapability, ...]

    @property
    def is_virtual(self) -> bool:
        return self.backend == "virtual"

    def knob(self, knob: Knob) -> KnobCapability:
        for k in self.knobs:
            if k.knob == knob:
                return k
        raise KeyError(knob)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "is_virtual": self.is_virtual,
            "name": self.name,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "mode": self.mode,
            "update_period_s": self.update_period_s,
            "readable": list(self.readable),
            "knobs": [
                {"knob": k.knob.value, "writable": k.writable, "reason": k.reason}
                for k in self.knobs
            ],
        }


class _Outcome:
    outcome: SetOutcome

    @property
    def in_force(self) -> bool:
        """The target is what the device now has (applied now, or already)."""
        return self.outcome in IN_FORCE


@dataclass(frozen=True)
class PowerLimitResult(_Outcome):
    """set_power_limit_w's report: what was asked, what the clamp made of it, what happened."""

    requested_w: float
    target_w: float
    clamped: bool
    outcome: SetOutcome
    detail: str = ""


@dataclass(frozen=True)
class ClockLockResult(_Outcome):
    """lock_sm_clocks_mhz's report; targets are clamped to the range and snapped to the ladder."""

    requested_min_mhz: int
    requested_max_mhz: int
    target_min_mhz: int
    target_max_mhz: int
    clamped: bool
    outcome: SetOutcome
    detail: str = ""


@dataclass(frozen=True)
class KnobChange(_Outcome):
    knob: Knob
    outcome: SetOutcome
    detail: str = ""


@dataclass(frozen=True)
class ResetResult:
    """reset(): default power limit, SM clocks unlocked."""

    changes: tuple[KnobChange, ...]

    @property
    def ok(self) -> bool:
        return all(c.outcome in IN_FORCE for c in self.changes)


@dataclass(frozen=True)
class RestoreResult:
    """restore_original_settings(): put back what the state file recorded."""

    state_file: Path
    recorded_by_pid: int | None  # None: nothing was recorded
    changes: tuple[KnobChange, ...] = ()
    # The state file could not be updated or removed (the device may still be restored).
    state_file_error: str | None = None

    @property
    def nothing_recorded(self) -> bool:
        return self.recorded_by_pid is None

    @property
    def complete(self) -> bool:
        return all(c.outcome in IN_FORCE for c in self.changes)


@dataclass(frozen=True)
class DeviceIdentity:
    backend: BackendName
    name: str
    uuid: str
    pci_bus_id: str


@dataclass(frozen=True)
class DeviceLimits:
    """The device's own constraints, used to clamp setter targets."""

    power_limit_min_w: float | None
    power_limit_max_w: float | None
    power_limit_default_w: float | None
    sm_clock_ladder_mhz: tuple[int, ...]  # ascending; empty when the device lists none
    sm_clock_max_mhz: int | None


class Device(Protocol):
    """A GPU as the daemon sees it. Setters clamp, are idempotent, and report what happened.

    Every setter passes the one actuation gate (wattserve.daemon.device.gate): in observe mode none
    of them reaches the hardware, and a knob the device refused stays read-only.
    """

    def now_s(self) -> float:
        """The device's monotonic clock in seconds (simulated for a simulated GPU)."""
        ...

    def capabilities(self) -> Capabilities: ...

    def read(self) -> Telemetry: ...

    def set_power_limit_w(self, power_limit_w: float) -> PowerLimitResult: ...

    def lock_sm_clocks_mhz(self, min_mhz: int, max_mhz: int) -> ClockLockResult: ...

    def reset(self) -> ResetResult: ...

    def restore_original_settings(self) -> RestoreResult: ...

    def record_engine_step(self, activity: EngineActivity) -> float:
        """Account one engine step; returns the extra seconds the engine must wait (>= 0)."""
        ...

    def close(self) -> RestoreResult | None:
        """Restore what this process changed (if anything), then release the device."""
        ...


class DeviceBackend(Protocol):
    """What nvml.py and virtual.py implement. Only ManagedDevice calls the write_* methods,
    and only after the actuation gate allowed it; backends themselves never decide that."""

    @property
    def identity(self) -> DeviceIdentity: ...

    @property
    def update_period_s(self) -> float: ...

    def now_s(self) -> float: ...

    def limits(self) -> DeviceLimits: ...

    def readable_fields(self) -> tuple[str, ...]: ...

    def unsupported_knobs(self) -> dict[Knob, str]:
        """Knobs the device showed at discovery it cannot set, with the reason."""
        ...

    def is_lost(self) -> bool: ...

    def read(self) -> Telemetry: ...

    def current_power_limit_w(self) -> float | None: ...

    def current_sm_clock_lock_mhz(self) -> tuple[int, int] | None: ...

    def write_power_limit_w(self, power_limit_w: float) -> None: ...

    def write_sm_clock_lock_mhz(self, min_mhz: int, max_mhz: int) -> None: ...

    def write_sm_clock_unlock(self) -> None: ...

    def record_engine_step(self, activity: EngineActivity) -> float: ...

    def close(self) -> None: ...
