"""The NVML backend and the shared control path, against a fake pynvml module.

The fake has pynvml's function names, constants and error class shape, keeps per-GPU
state that outlives a "process" (as real GPU settings do), and records every call, so
tests can assert what reached the driver and when.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from wattserve.daemon.config import DeviceConfig
from wattserve.daemon.device.factory import open_device
from wattserve.daemon.device.gate import ActuationGate
from wattserve.daemon.device.protocol import (
    DeviceError,
    Knob,
    NvmlUnavailableError,
    SetOutcome,
    decode_clock_event_reasons,
)

# -- the fake -------------------------------------------------------------------------------

CONSTANTS = {
    "NVML_SUCCESS": 0,
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_UNKNOWN": 999,
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN": 1,
    "NVML_TEMPERATURE_THRESHOLD_GPU_MAX": 3,
    "NVML_CLOCK_SM": 1,
    "NVML_CLOCK_MEM": 2,
    "NVML_FI_DEV_MEMORY_TEMP": 82,
    "NVML_FI_DEV_POWER_AVERAGE": 185,
    "NVML_FI_DEV_POWER_INSTANT": 186,
    "NVML_VALUE_TYPE_DOUBLE": 0,
    "NVML_VALUE_TYPE_UNSIGNED_INT": 1,
}
C = types.SimpleNamespace(**CONSTANTS)

ERROR_CLASSES = {
    C.NVML_ERROR_UNINITIALIZED: "NVMLError_Uninitialized",
    C.NVML_ERROR_NOT_SUPPORTED: "NVMLError_NotSupported",
    C.NVML_ERROR_NO_PERMISSION: "NVMLError_NoPermission",
    C.NVML_ERROR_NOT_FOUND: "NVMLError_NotFound",
    C.NVML_ERROR_DRIVER_NOT_LOADED: "NVMLError_DriverNotLoaded",
    C.NVML_ERROR_LIBRARY_NOT_FOUND: "NVMLError_LibraryNotFound",
    C.NVML_ERROR_GPU_IS_LOST: "NVMLError_GpuIsLost",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return ERROR_CLASSES.get(self.value, f"NVML error {self.value}").removeprefix("NVMLError_")


def _error_class(name: str, code: int) -> type[NVMLError]:
    """Like pynvml's generated NVMLError_* subclasses: raising one carries its code."""

    def __init__(self, *args: Any) -> None:
        NVMLError.__init__(self, code)

    return type(name, (NVMLError,), {"__init__": __init__})


LADDER_MHZ = tuple(range(345, 1981, 15))


@dataclasses.dataclass
class FakeGpu:
    """One GPU's state; it outlives a fake 'process' the way real settings do."""

    index: int
    uuid: str
    bus_id: str
    name: str = "NVIDIA H200"
    power_limit_mw: int = 700_000
    locked_mhz: tuple[int, int] | None = None
    energy_mj: int = 5_000_000
    instant_power_supported: bool = True
    power_limit_settable: int | None = None  # an NVML error code the setter raises, if any
    clock_lock_settable: int | None = None
    clock_event_mask: int = 0x4 | 0x20
    util_gpu_pct: int = 97
    # The SM clock it runs at; None: the locked range's top, else its boost clock.
    sm_clock_mhz: int | None = None
    app_clock_mhz: int = 1755
    lost: bool = False
    generation: int = 0  # bumps when the GPU comes back; older handles go invalid


@dataclasses.dataclass(frozen=True)
class FakeHandle:
    gpu: FakeGpu
    generation: int


class FakeNvml:
    """Builds a module that looks like pynvml and records every call on it."""

    def __init__(self, gpus: list[FakeGpu], clock: Callable[[], float] = lambda: 0.0) -> None:
        self.gpus = gpus
        self.clock = clock
        self.calls: list[tuple[str, tuple]] = []
        self.init_times: list[float] = []
        self.init_error: int | None = None
        self.initialized = 0
        self.before_set: Callable[[str], None] | None = None

    # Calls that would change a GPU setting.
    SETTERS = (
        "nvmlDeviceSetPowerManagementLimit",
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceResetGpuLockedClocks",
    )

    def module(self) -> types.ModuleType:
        m = types.ModuleType("pynvml")
        for name, value in CONSTANTS.items():
            setattr(m, name, value)
        m.NVMLError = NVMLError
        for code, cls_name in ERROR_CLASSES.items():
            setattr(m, cls_name, _error_class(cls_name, code))
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(m, name, self._recorded(name, getattr(self, name)))
        return m

    def _recorded(self, name: str, fn: Callable) -> Callable:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            return fn(*args)

        call.__name__ = name
        return call

    def setter_calls(self) -> list[tuple[str, tuple]]:
        return [c for c in self.calls if c[0] in self.SETTERS]

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    # -- library --
    def nvmlInit(self) -> None:
        self.init_times.append(self.clock())
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        if self.initialized == 0:
            raise NVMLError(C.NVML_ERROR_UNINITIALIZED)
        self.initialized -= 1

    # -- handles --
    def _find(self, match: Callable[[FakeGpu], bool]) -> FakeHandle:
        if not self.initialized:
            raise NVMLError(C.NVML_ERROR_UNINITIALIZED)
        for gpu in self.gpus:
            if match(gpu):
                if gpu.lost:
                    raise NVMLError(C.NVML_ERROR_GPU_IS_LOST)
                return FakeHandle(gpu, gpu.generation)
        raise NVMLError(C.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        return self._find(lambda g: g.index == index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        return self._find(lambda g: g.uuid == uuid)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> FakeHandle:
        return self._find(lambda g: g.bus_id.lower() == bus_id.lower())

    def _gpu(self, handle: FakeHandle) -> FakeGpu:
        if not self.initialized:
            raise NVMLError(C.NVML_ERROR_UNINITIALIZED)
        if handle.gpu.lost:
            raise NVMLError(C.NVML_ERROR_GPU_IS_LOST)
        if handle.generation != handle.gpu.generation:
            raise NVMLError(C.NVML_ERROR_UNINITIALIZED)  # a handle from before a driver reload
        return handle.gpu

    # -- identity and discovery --
    def nvmlDeviceGetName(self, h: FakeHandle) -> str:
        return self._gpu(h).name

    def nvmlDeviceGetUUID(self, h: FakeHandle) -> str:
        return self._gpu(h).uuid

    def nvmlDeviceGetPciInfo(self, h: FakeHandle) -> Any:
        return types.SimpleNamespace(busId=self._gpu(h).bus_id.encode())

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: FakeHandle) -> list[int]:
        self._gpu(h)
        return [200_000, 700_000]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: FakeHandle) -> int:
        self._gpu(h)
        return 700_000

    def nvmlDeviceGetPowerManagementLimit(self, h: FakeHandle) -> int:
        return self._gpu(h).power_limit_mw

    def nvmlDeviceGetSupportedMemoryClocks(self, h: FakeHandle) -> list[int]:
        self._gpu(h)
        return [3201, 1593]

    def nvmlDeviceGetSupportedGraphicsClocks(self, h: FakeHandle, mem_mhz: int) -> list[int]:
        self._gpu(h)
        assert mem_mhz == 3201
        return list(reversed(LADDER_MHZ))  # NVML lists them highest first

    def nvmlDeviceGetMaxClockInfo(self, h: FakeHandle, clock_type: int) -> int:
        self._gpu(h)
        return 1980

    def nvmlDeviceGetTemperatureThreshold(self, h: FakeHandle, which: int) -> int:
        self._gpu(h)
        return {
            C.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 89,
            C.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: 87,
        }[which]

    # -- telemetry --
    def nvmlDeviceGetFieldValues(self, h: FakeHandle, field_ids: list[int]) -> list[Any]:
        gpu = self._gpu(h)
        out = []
        for fid in field_ids:
            ret, value = C.NVML_SUCCESS, 0
            if fid == C.NVML_FI_DEV_POWER_INSTANT:
                if gpu.instant_power_supported:
                    value = 312_500
                else:
                    ret = C.NVML_ERROR_NOT_SUPPORTED
            elif fid == C.NVML_FI_DEV_POWER_AVERAGE:
                value = 300_000
            elif fid == C.NVML_FI_DEV_MEMORY_TEMP:
                value = 61
            out.append(
                types.SimpleNamespace(
                    fieldId=fid,
                    nvmlReturn=ret,
                    valueType=C.NVML_VALUE_TYPE_UNSIGNED_INT,
                    value=types.SimpleNamespace(uiVal=value, dVal=0.0),
                )
            )
        return out

    def nvmlDeviceGetPowerUsage(self, h: FakeHandle) -> int:
        self._gpu(h)
        return 305_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeHandle) -> int:
        gpu = self._gpu(h)
        gpu.energy_mj += 30_000
        return gpu.energy_mj

    def nvmlDeviceGetTemperature(self, h: FakeHandle, sensor: int) -> int:
        self._gpu(h)
        return 55

    def nvmlDeviceGetClockInfo(self, h: FakeHandle, clock_type: int) -> int:
        gpu = self._gpu(h)
        if clock_type == C.NVML_CLOCK_MEM:
            return 3201
        if gpu.sm_clock_mhz is not None:
            return gpu.sm_clock_mhz
        return gpu.locked_mhz[1] if gpu.locked_mhz else 1980

    def nvmlDeviceGetApplicationsClock(self, h: FakeHandle, clock_type: int) -> int:
        gpu = self._gpu(h)
        return 3201 if clock_type == C.NVML_CLOCK_MEM else gpu.app_clock_mhz

    def nvmlDeviceGetUtilizationRates(self, h: FakeHandle) -> Any:
        return types.SimpleNamespace(gpu=self._gpu(h).util_gpu_pct, memory=64)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeHandle) -> int:
        return self._gpu(h).clock_event_mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: FakeHandle) -> int:
        return self._gpu(h).clock_event_mask

    def nvmlDeviceGetMarginTemperature(self, h: FakeHandle) -> int:
        self._gpu(h)
        return 32

    # -- setters --
    def _before_set(self, name: str) -> None:
        if self.before_set is not None:
            self.before_set(name)

    def nvmlDeviceSetPowerManagementLimit(self, h: FakeHandle, limit_mw: int) -> None:
        self._before_set("nvmlDeviceSetPowerManagementLimit")
        gpu = self._gpu(h)
        if gpu.power_limit_settable is not None:
            raise NVMLError(gpu.power_limit_settable)
        if not 200_000 <= limit_mw <= 700_000:
            raise NVMLError(C.NVML_ERROR_INVALID_ARGUMENT)
        gpu.power_limit_mw = limit_mw

    def nvmlDeviceSetGpuLockedClocks(self, h: FakeHandle, lo: int, hi: int) -> None:
        self._before_set("nvmlDeviceSetGpuLockedClocks")
        gpu = self._gpu(h)
        if gpu.clock_lock_settable is not None:
            raise NVMLError(gpu.clock_lock_settable)
        gpu.locked_mhz = (lo, hi)

    def nvmlDeviceResetGpuLockedClocks(self, h: FakeHandle) -> None:
        self._before_set("nvmlDeviceResetGpuLockedClocks")
        gpu = self._gpu(h)
        if gpu.clock_lock_settable is not None:
            raise NVMLError(gpu.clock_lock_settable)
        gpu.locked_mhz = None


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


GPU0 = dict(index=0, uuid="GPU-11111111-2222-3333-4444-555555555555", bus_id="00000000:19:00.0")
GPU1 = dict(index=1, uuid="GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", bus_id="00000000:3B:00.0")


@pytest.fixture
def gpus() -> list[FakeGpu]:
    return [FakeGpu(**GPU0), FakeGpu(**GPU1)]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def nvml(monkeypatch, gpus, clock) -> FakeNvml:
    fake = FakeNvml(gpus, clock)
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake


def new_process(monkeypatch, gpus, clock) -> FakeNvml:
    """A fresh pynvml for a new daemon process; the GPUs keep their settings."""
    fake = FakeNvml(gpus, clock)
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake


def cfg(tmp_path: Path, **kw: Any) -> DeviceConfig:
    base = dict(backend="nvml", mode="control", gpu="0", state_dir=tmp_path)
    base.update(kw)
    return DeviceConfig(**base)


def state_file(tmp_path: Path, gpu: FakeGpu = None) -> Path:
    uuid = gpu.uuid if gpu else GPU0["uuid"]
    return tmp_path / f"device-{uuid}.json"


# -- the fake is faithful ----------------------------------------------------------------


def test_fake_has_the_real_pynvml_names_and_values():
    real = pytest.importorskip("pynvml")
    for name, value in CONSTANTS.items():
        if name == "NVML_ERROR_UNKNOWN":
            assert real.NVML_ERROR_UNKNOWN == 999
            continue
        assert getattr(real, name) == value, name
    for name in dir(FakeNvml):
        if name.startswith("nvml"):
            assert callable(getattr(real, name)), name
    for cls_name in ERROR_CLASSES.values():
        assert issubclass(getattr(real, cls_name), real.NVMLError)


# -- selection and reading ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "lookup"),
    [
        ("1", "nvmlDeviceGetHandleByIndex"),
        (GPU1["uuid"], "nvmlDeviceGetHandleByUUID"),
        (GPU1["bus_id"], "nvmlDeviceGetHandleByPciBusId"),
        ("3B:00.0", "nvmlDeviceGetHandleByPciBusId"),
    ],
)
def test_selects_the_gpu_by_index_uuid_or_pci_bus_id(nvml, tmp_path, selector, lookup):
    if selector == "3B:00.0":
        nvml.gpus[1].bus_id = "3B:00.0"
    device = open_device(cfg(tmp_path, gpu=selector))
    caps = device.capabilities()
    assert caps.uuid == GPU1["uuid"] and caps.backend == "nvml" and not caps.is_virtual
    assert lookup in nvml.names()
    device.close()


def test_a_bad_gpu_selector_is_a_clear_error(nvml, tmp_path):
    with pytest.raises(DeviceError, match="not a GPU index"):
        open_device(cfg(tmp_path, gpu="the big one"))
    with pytest.raises(DeviceError, match="no GPU matches '7'"):
        open_device(cfg(tmp_path, gpu="7"))
    assert nvml.initialized == 0  # the library was shut down again


def test_reads_instant_power_energy_counter_and_clock_event_reasons(nvml, tmp_path):
    device = open_device(cfg(tmp_path))
    t = device.read()
    assert t.power_w == pytest.approx(312.5) and t.power_w_is_instant
    assert t.power_avg_w == pytest.approx(300.0) and t.power_avg_window_s == 1.0
    assert t.energy_j == pytest.approx(5_060.0)  # mJ counter -> J (second read)
    assert t.gpu_temp_c == 55 and t.memory_temp_c == 61 and t.thermal_margin_c == 32
    assert t.sm_clock_mhz == 1980 and t.mem_clock_mhz == 3201 and t.sm_app_clock_mhz == 1755
    assert (t.gpu_util_pct, t.mem_util_pct) == (97, 64)
    assert t.clock_event_reasons == ("SwPowerCap", "SwThermal")
    assert (t.power_limit_w, t.power_limit_min_w, t.power_limit_max_w) == (700, 200, 700)
    assert t.sm_clock_ladder_mhz == LADDER_MHZ  # ascending
    assert (t.max_operating_temp_c, t.slowdown_temp_c) == (87, 89)
    assert not t.stale and not t.device_lost
    names = nvml.names()
    assert "nvmlDeviceGetCurrentClocksEventReasons" in names
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" not in names  # the deprecated name
    assert "nvmlDeviceGetPowerUsage" not in names
    assert "power_w" in device.capabilities().readable
    device.close()


def test_falls_back_to_power_usage_where_the_instant_field_is_missing(nvml, tmp_path):
    nvml.gpus[0].instant_power_supported = False
    device = open_device(cfg(tmp_path))
    t = device.read()
    assert t.power_w == pytest.approx(305.0) and not t.power_w_is_instant
    last_fields = [args for name, args in nvml.calls if name == "nvmlDeviceGetFieldValues"][-1]
    assert C.NVML_FI_DEV_POWER_INSTANT not in last_fields[1]  # not asked again
    device.close()


def test_unknown_reason_bits_are_named_not_dropped():
    assert decode_clock_event_reasons(0x8 | 0x40 | 0x80) == (
        "HwSlowdown",
        "HwThermal",
        "HwPowerBrake",
    )
    assert decode_clock_event_reasons(0x1000) == ("UnknownBit0x1000",)


# -- NVML absent or broken --------------------------------------------------------------


def _device_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("wattserve.daemon.device") and r.levelno >= logging.WARNING
    ]


def test_pynvml_absent_falls_back_to_virtual_with_one_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    caplog.set_level(logging.INFO)
    device = open_device(cfg(tmp_path, backend="auto"))
    assert device.capabilities().is_virtual
    warnings = _device_warnings(caplog)
    assert len(warnings) == 1
    assert "nvidia-ml-py" in warnings[0] and "virtual GPU" in warnings[0]
    device.close()


def test_nvml_library_missing_falls_back_to_virtual(nvml, tmp_path, caplog):
    nvml.init_error = C.NVML_ERROR_LIBRARY_NOT_FOUND
    device = open_device(cfg(tmp_path, backend="auto"))
    assert device.capabilities().is_virtual
    assert len(_device_warnings(caplog)) == 1
    device.close()


def test_nvml_absent_is_an_error_when_nvml_is_asked_for(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(NvmlUnavailableError, match="nvidia-ml-py"):
        open_device(cfg(tmp_path, backend="nvml"))


def test_a_broken_driver_is_an_error_not_a_silent_fallback(nvml, tmp_path):
    nvml.init_error = C.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(DeviceError, match="driver") as err:
        open_device(cfg(tmp_path, backend="auto"))
    assert not isinstance(err.value, NvmlUnavailableError)


# -- knobs the device refuses ------------------------------------------------------------


def test_no_permission_on_the_power_limit_makes_that_knob_observe_only(nvml, tmp_path, caplog):
    nvml.gpus[0].power_limit_settable = C.NVML_ERROR_NO_PERMISSION
    device = open_device(cfg(tmp_path))
    first = device.set_power_limit_w(500)
    assert first.outcome is SetOutcome.UNAVAILABLE and "NO_PERMISSION" in first.detail
    knob = device.capabilities().knob(Knob.POWER_LIMIT)
    assert not knob.writable and "NO_PERMISSION" in knob.reason
    calls = len(nvml.setter_calls())
    assert device.set_power_limit_w(450).outcome is SetOutcome.UNAVAILABLE
    assert len(nvml.setter_calls()) == calls  # not sent again
    # The other knob still works, and the state file records only what changed.
    assert device.lock_sm_clocks_mhz(1005, 1500).outcome is SetOutcome.APPLIED
    originals = json.loads(state_file(tmp_path).read_text())["originals"]
    assert originals == {"sm_clock_lock_mhz": None}
    assert any("observe-only" in m for m in _device_warnings(caplog))
    device.close()
    assert nvml.gpus[0].locked_mhz is None and not state_file(tmp_path).exists()


def test_not_supported_on_clock_locking_makes_that_knob_observe_only(nvml, tmp_path):
    nvml.gpus[0].clock_lock_settable = C.NVML_ERROR_NOT_SUPPORTED
    device = open_device(cfg(tmp_path))
    result = device.lock_sm_clocks_mhz(1005, 1500)
    assert result.outcome is SetOutcome.UNAVAILABLE and "NOT_SUPPORTED" in result.detail
    assert not device.capabilities().knob(Knob.SM_CLOCKS).writable
    assert device.capabilities().knob(Knob.POWER_LIMIT).writable
    assert not state_file(tmp_path).exists()  # nothing changed, nothing recorded
    device.close()


# -- the GPU falls off the bus ----------------------------------------------------------


def test_gpu_lost_turns_stale_and_reinitialises_with_capped_backoff_by_bus_id(
    nvml, tmp_path, clock
):
    device = open_device(cfg(tmp_path), clock=clock)
    good = device.read()
    gpu = nvml.gpus[0]
    gpu.lost = True
    lost = device.read()
    assert lost.stale and lost.device_lost and lost.power_w == good.power_w
    assert device.set_power_limit_w(500).outcome is SetOutcome.DEVICE_LOST
    assert device.lock_sm_clocks_mhz(1005, 1005).outcome is SetOutcome.DEVICE_LOST
    assert nvml.setter_calls() == []

    lost_at = clock.now_s
    nvml.init_times.clear()
    while clock.now_s < lost_at + 100:
        clock.now_s += 0.5
        assert device.read().stale
    attempts = [round(t - lost_at, 1) for t in nvml.init_times]
    assert attempts == [1.0, 3.0, 7.0, 15.0, 31.0, 61.0, 91.0]  # doubling, capped at 30 s

    gpu.lost = False
    gpu.generation += 1  # the driver came back; old handles are invalid
    lookups_before = nvml.names().count("nvmlDeviceGetHandleByPciBusId")
    clock.now_s += 30
    back = device.read()
    assert not back.stale and not back.device_lost
    assert nvml.names().count("nvmlDeviceGetHandleByPciBusId") == lookups_before + 1
    assert ("nvmlDeviceGetHandleByPciBusId", (GPU0["bus_id"],)) in nvml.calls
    assert not device.read().stale  # the new handle works
    assert device.set_power_limit_w(500).outcome is SetOutcome.APPLIED
    device.close()


def test_gpu_lost_during_a_setter_is_reported_and_telemetry_turns_stale(nvml, tmp_path):
    device = open_device(cfg(tmp_path))
    nvml.before_set = lambda name: setattr(nvml.gpus[0], "lost", True)
    result = device.set_power_limit_w(500)
    assert result.outcome is SetOutcome.DEVICE_LOST
    assert device.read().device_lost
    device.close(restore=False)


# -- clamping, idempotence, the state file ---------------------------------------------


def test_setter_targets_are_clamped_snapped_and_idempotent(nvml, tmp_path):
    device = open_device(cfg(tmp_path))
    high = device.set_power_limit_w(900)
    assert (high.target_w, high.clamped, high.outcome) == (700, True, SetOutcome.UNCHANGED)
    low = device.set_power_limit_w(50)
    assert (low.target_w, low.clamped, low.outcome) == (200, True, SetOutcome.APPLIED)
    assert ("nvmlDeviceSetPowerManagementLimit", (nvml.calls[-1][1][0], 200_000)) in nvml.calls

    wide = device.lock_sm_clocks_mhz(100, 5000)
    assert (wide.target_min_mhz, wide.target_max_mhz, wide.clamped) == (345, 1980, True)
    snapped = device.lock_sm_clocks_mhz(1000, 1510)
    assert (snapped.target_min_mhz, snapped.target_max_mhz) == (1005, 1500)
    assert nvml.gpus[0].locked_mhz == (1005, 1500)
    backwards = device.lock_sm_clocks_mhz(1500, 1005)
    assert (backwards.target_min_mhz, backwards.target_max_mhz) == (1005, 1005)

    sent = len(nvml.setter_calls())
    assert device.lock_sm_clocks_mhz(1005, 1005).outcome is SetOutcome.UNCHANGED
    assert device.set_power_limit_w(200).outcome is SetOutcome.UNCHANGED
    assert len(nvml.setter_calls()) == sent
    with pytest.raises(ValueError):
        device.set_power_limit_w(float("nan"))
    device.close()


# -- the clock lock the GPU enforces (NVML cannot read a lock back) -----------------------


def _reads(device, clock, seconds: float, step_s: float = 0.25):
    """Telemetry read every step_s for `seconds` of the fake clock; the last reading."""
    end = clock.now_s + seconds
    t = device.read()
    while clock.now_s < end:
        clock.now_s += step_s
        t = device.read()
    return t


def test_a_lock_reset_behind_the_daemon_is_seen_on_a_busy_gpu_and_written_again(
    nvml, tmp_path, clock, caplog
):
    device = open_device(cfg(tmp_path), clock=clock)
    assert device.lock_sm_clocks_mhz(1200, 1200).outcome is SetOutcome.APPLIED
    assert _reads(device, clock, 3.0).sm_clock_lock_mhz == (1200, 1200)  # held at 1200

    gpu = nvml.gpus[0]
    gpu.locked_mhz = None  # `nvidia-smi -rgc`: the busy GPU boosts to 1980 MHz
    assert device.read().sm_clock_lock_mhz == (1200, 1200)  # one reading is not enough
    with caplog.at_level(logging.WARNING, logger="wattserve.daemon.device.nvml"):
        t = _reads(device, clock, 1.0)
    assert t.sm_clock_lock_mhz is None and t.sm_clock_mhz == 1980
    assert any("1200-1200 MHz is no longer in force" in r.getMessage() for r in caplog.records)
    assert any("busy at 1980 MHz" in r.getMessage() for r in caplog.records)

    # Not "unchanged": the lock is written to the GPU again.
    sent = nvml.names().count("nvmlDeviceSetGpuLockedClocks")
    assert device.lock_sm_clocks_mhz(1200, 1200).outcome is SetOutcome.APPLIED
    assert nvml.names().count("nvmlDeviceSetGpuLockedClocks") == sent + 1
    assert gpu.locked_mhz == (1200, 1200)
    assert _reads(device, clock, 3.0).sm_clock_lock_mhz == (1200, 1200)
    device.close()


def test_an_idle_gpu_or_a_capped_clock_does_not_contradict_the_lock(nvml, tmp_path, clock):
    device = open_device(cfg(tmp_path), clock=clock)
    device.lock_sm_clocks_mhz(1200, 1200)
    gpu = nvml.gpus[0]
    # Idle: the clock sits low (and may read anything) whatever the lock.
    gpu.util_gpu_pct, gpu.clock_event_mask, gpu.sm_clock_mhz = 0, 0x1, 345
    assert _reads(device, clock, 5.0).sm_clock_lock_mhz == (1200, 1200)
    gpu.sm_clock_mhz = 1980
    assert _reads(device, clock, 5.0).sm_clock_lock_mhz == (1200, 1200)
    # Busy below the lock under a power cap or a thermal slowdown: the cap explains it.
    gpu.util_gpu_pct, gpu.sm_clock_mhz = 100, 900
    for mask in (0x4, 0x8, 0x20, 0x40, 0x80):
        gpu.clock_event_mask = mask
        assert _reads(device, clock, 3.0).sm_clock_lock_mhz == (1200, 1200), hex(mask)
    # Busy below the lock with no cap: someone locked it lower.
    gpu.clock_event_mask = 0
    t = _reads(device, clock, 1.0)
    assert t.sm_clock_lock_mhz is None
    device.close()


def test_a_brief_contradiction_is_not_drift(nvml, tmp_path, clock):
    """A clock still settling after a write reads off the lock once or twice."""
    device = open_device(cfg(tmp_path), clock=clock)
    device.lock_sm_clocks_mhz(1200, 1200)
    gpu = nvml.gpus[0]
    for _ in range(5):
        gpu.sm_clock_mhz = 1980
        _reads(device, clock, 0.5)
        gpu.sm_clock_mhz = None  # back at the locked 1200
        assert _reads(device, clock, 0.25).sm_clock_lock_mhz == (1200, 1200)
    device.close()


def test_originals_are_recorded_before_the_first_change_and_restored_on_clean_exit(nvml, tmp_path):
    path = state_file(tmp_path)
    seen_before_set: list[dict | None] = []
    nvml.before_set = lambda name: seen_before_set.append(
        json.loads(path.read_text())["originals"] if path.exists() else None
    )
    device = open_device(cfg(tmp_path))
    device.set_power_limit_w(500)
    assert seen_before_set == [{"power_limit_w": 700.0}]  # on disk before the driver call
    device.set_power_limit_w(400)
    device.lock_sm_clocks_mhz(1005, 1500)
    record = json.loads(path.read_text())
    assert record["originals"] == {"power_limit_w": 700.0, "sm_clock_lock_mhz": None}
    assert record["pid"] == os.getpid() and record["uuid"] == GPU0["uuid"]
    assert nvml.gpus[0].power_limit_mw == 400_000

    device.close()
    assert nvml.gpus[0].power_limit_mw == 700_000 and nvml.gpus[0].locked_mhz is None
    assert not path.exists()


def test_no_change_is_made_when_the_original_cannot_be_recorded(nvml, tmp_path):
    device = open_device(cfg(tmp_path))
    # Block the atomic write's temporary file with a directory of the same name.
    (tmp_path / f".{state_file(tmp_path).name}.{os.getpid()}.tmp").mkdir()
    result = device.set_power_limit_w(500)
    assert result.outcome is SetOutcome.FAILED and "cannot write state file" in result.detail
    assert nvml.setter_calls() == [] and nvml.gpus[0].power_limit_mw == 700_000
    device.close()


def test_an_unreadable_state_file_blocks_control_mode_only(nvml, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(DeviceError, match="cannot read state file"):
        open_device(cfg(not_a_dir))
    state_file(tmp_path).write_text("{not json")
    with pytest.raises(DeviceError, match="not valid JSON"):
        open_device(cfg(tmp_path))
    open_device(cfg(tmp_path, mode="observe")).close()


def test_settings_left_by_a_crashed_run_are_restored_at_the_next_start(
    nvml, monkeypatch, gpus, clock, tmp_path, caplog
):
    crashed = open_device(cfg(tmp_path))
    crashed.set_power_limit_w(450)
    crashed.lock_sm_clocks_mhz(1005, 1500)
    del crashed  # SIGKILL: no close(), the GPU keeps 450 W and the lock

    assert gpus[0].power_limit_mw == 450_000 and gpus[0].locked_mhz == (1005, 1500)
    assert state_file(tmp_path).exists()
    fresh = new_process(monkeypatch, gpus, clock)
    device = open_device(cfg(tmp_path))
    assert gpus[0].power_limit_mw == 700_000 and gpus[0].locked_mhz is None
    assert [n for n, _ in fresh.setter_calls()] == [
        "nvmlDeviceSetPowerManagementLimit",
        "nvmlDeviceResetGpuLockedClocks",
    ]
    assert not state_file(tmp_path).exists()
    assert any("restored settings left by an earlier run" in m for m in _device_warnings(caplog))
    device.close()


def test_a_restore_the_driver_refuses_keeps_the_state_file(
    nvml, monkeypatch, gpus, clock, tmp_path
):
    crashed = open_device(cfg(tmp_path))
    crashed.set_power_limit_w(450)
    del crashed
    new_process(monkeypatch, gpus, clock)
    gpus[0].power_limit_settable = C.NVML_ERROR_NO_PERMISSION
    device = open_device(cfg(tmp_path))
    assert state_file(tmp_path).exists()
    result = device.restore_original_settings()
    assert not result.complete and result.changes[0].outcome is SetOutcome.UNAVAILABLE
    device.close()
    assert state_file(tmp_path).exists()


def test_a_live_controller_of_the_same_gpu_blocks_control_mode(nvml, tmp_path, caplog):
    path = state_file(tmp_path)
    path.write_text(
        json.dumps(
            {
                "format": 1,
                "backend": "nvml",
                "uuid": GPU0["uuid"],
                "pci_bus_id": GPU0["bus_id"],
                "name": "NVIDIA H200",
                "pid": os.getppid(),
                "boot_id": None,
                "recorded_at_unix_s": 0.0,
                "originals": {"power_limit_w": 700.0},
            }
        )
    )
    with pytest.raises(DeviceError, match=f"pid {os.getppid()}"):
        open_device(cfg(tmp_path))
    device = open_device(cfg(tmp_path, mode="observe"))
    assert nvml.setter_calls() == [] and path.exists()
    device.close()


# -- observe mode ------------------------------------------------------------------------


def test_observe_mode_never_calls_a_setter(nvml, monkeypatch, gpus, clock, tmp_path, caplog):
    crashed = open_device(cfg(tmp_path))
    crashed.set_power_limit_w(450)
    del crashed
    recorded = state_file(tmp_path).read_bytes()
    fake = new_process(monkeypatch, gpus, clock)

    device = open_device(cfg(tmp_path, mode="observe"))
    assert any("observe mode leaves them" in m for m in _device_warnings(caplog))
    caps = device.capabilities()
    assert caps.mode == "observe" and not any(k.writable for k in caps.knobs)
    assert device.set_power_limit_w(300).outcome is SetOutcome.OBSERVE_ONLY
    assert device.lock_sm_clocks_mhz(1005, 1005).outcome is SetOutcome.OBSERVE_ONLY
    assert all(c.outcome is SetOutcome.OBSERVE_ONLY for c in device.reset().changes)
    assert not device.restore_original_settings().complete
    device.read()
    device.close()

    assert fake.setter_calls() == []
    assert not [n for n in fake.names() if n.startswith(("nvmlDeviceSet", "nvmlDeviceReset"))]
    assert state_file(tmp_path).read_bytes() == recorded
    assert gpus[0].power_limit_mw == 450_000


def test_the_gate_is_the_one_decision():
    gate = ActuationGate("observe")
    assert all(gate.decide(k).outcome is SetOutcome.OBSERVE_ONLY for k in Knob)
    gate = ActuationGate("control")
    assert gate.decide(Knob.POWER_LIMIT).allowed
    gate.mark_unavailable(Knob.POWER_LIMIT, "NO_PERMISSION: Insufficient Permissions")
    assert gate.decide(Knob.POWER_LIMIT).outcome is SetOutcome.UNAVAILABLE
    assert gate.decide(Knob.SM_CLOCKS).allowed
    with pytest.raises(ValueError):
        ActuationGate("yolo")
