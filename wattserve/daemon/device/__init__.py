"""GPU telemetry and actuation: one Device protocol, an NVML backend, a simulated GPU.

Import what the daemon needs from here; pynvml is imported only when an NVML backend
is opened. Nothing in this package holds a device globally.
"""

from wattserve.daemon.device.factory import open_device
from wattserve.daemon.device.managed import ManagedDevice
from wattserve.daemon.device.protocol import (
    Capabilities,
    ClockLockResult,
    Device,
    DeviceError,
    EngineActivity,
    Knob,
    NvmlUnavailableError,
    PowerLimitResult,
    ResetResult,
    RestoreResult,
    SetOutcome,
    Telemetry,
    energy_between_j,
)
from wattserve.daemon.device.sampler import TelemetrySampler
from wattserve.daemon.device.virtual import SimClock, VirtualGpu, VirtualGpuParams, run_activity

__all__ = [
    "Capabilities",
    "ClockLockResult",
    "Device",
    "DeviceError",
    "EngineActivity",
    "Knob",
    "ManagedDevice",
    "NvmlUnavailableError",
    "PowerLimitResult",
    "ResetResult",
    "RestoreResult",
    "SetOutcome",
    "SimClock",
    "Telemetry",
    "TelemetrySampler",
    "VirtualGpu",
    "VirtualGpuParams",
    "energy_between_j",
    "open_device",
    "run_activity",
]
