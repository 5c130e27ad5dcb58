"""The real GPU backend, on NVML through nvidia-ml-py (module pynvml), imported lazily here.

Selects one GPU by index, UUID or PCI bus id; reads power (the instantaneous field where
the GPU has it, else nvmlDeviceGetPowerUsage), the energy counter, temperatures, clocks
(current and application SM clocks), utilization, clock-event reasons, power limits and
the SM clock ladder; and writes the power limit and locked SM clocks when ManagedDevice
asks. NVML cannot read a clock lock back: the lock reported is the one this process set
for as long as the clocks the GPU enforces agree with it (clock_check.py), so a lock reset
behind the daemon's back (`nvidia-smi -rgc`) is forgotten and the controller re-applies it.
It keeps the daemon alive: NVML absent raises NvmlUnavailableError (the factory logs one
line and falls back); NO_PERMISSION / NOT_SUPPORTED on a setter raise KnobUnavailableError
(the knob becomes read-only); GPU_IS_LOST or a driver reload turn telemetry stale while the backend
re-initialises with capped backoff and finds the GPU again by its PCI bus id.
This module must not decide whether a setter may run (gate.py does) and must not
write any state file (managed.py does).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

from wattserve.daemon.device.clock_check import LockWatch, check_lock
from wattserve.daemon.device.protocol import (
    DeviceError,
    DeviceIdentity,
    DeviceLimits,
    DeviceLostError,
    EngineActivity,
    Knob,
    KnobUnavailableError,
    NvmlUnavailableError,
    Telemetry,
    decode_clock_event_reasons,
    provided_measurements,
)

log = logging.getLogger(__name__)

# NVML documents NVML_FI_DEV_POWER_AVERAGE as averaged over one second.
_NVML_POWER_AVERAGE_WINDOW_S = 1.0
# NVML refreshes power and energy readings no faster than this on current data-center parts.
_NVML_UPDATE_PERIOD_S = 0.1

_PCI_BUS_ID = re.compile(r"^(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")

SelectorKind = Literal["index", "uuid", "pci_bus_id"]


def import_pynvml() -> ModuleType:
    """Import pynvml now (never at daemon import time); absent -> NvmlUnavailableError."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailableError(
            "NVML is not available: the nvidia-ml-py package (module pynvml) is not installed"
        ) from None
    return pynvml


def parse_gpu_selector(selector: str) -> tuple[SelectorKind, str | int]:
    """device.gpu: an index ('0'), a UUID ('GPU-…' or 'MIG-…') or a PCI bus id ('0000:65:00.0')."""
    text = selector.strip()
    if text.isdigit():
        return "index", int(text)
    if text.upper().startswith(("GPU-", "MIG-")):
        return "uuid", text
    if _PCI_BUS_ID.match(text):
        return "pci_bus_id", text
    raise DeviceError(
        f"device.gpu: {selector!r} is not a GPU index, a UUID (GPU-...) "
        "or a PCI bus id (0000:65:00.0)"
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _GpuLost(Exception):
    """Internal: an NVML call said the GPU or the driver went away."""


class NvmlBackend:
    """One NVIDIA GPU through NVML. Implements DeviceBackend."""

    def __init__(
        self,
        gpu: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        reinit_backoff_initial_s: float = 1.0,
        reinit_backoff_max_s: float = 30.0,
    ) -> None:
        kind, key = parse_gpu_selector(gpu)
        self._nv = import_pynvml()
        self._clock = clock
        self._lock = threading.RLock()
        self._backoff_initial_s = reinit_backoff_initial_s
        self._backoff_max_s = reinit_backoff_max_s
        self._backoff_s = reinit_backoff_initial_s
        self._next_attempt_s = 0.0
        self._lost = False
        self._reinit_attempts = 0
        self._unsupported: set[str] = set()
        self._known_lock_mhz: tuple[int, int] | None = None
        self._lock_watch = LockWatch()
        self._last: Telemetry | None = None
        nv = self._nv
        self._refused_codes = {nv.NVML_ERROR_NO_PERMISSION, nv.NVML_ERROR_NOT_SUPPORTED}
        self._lost_codes = {
            getattr(nv, name)
            for name in (
                "NVML_ERROR_GPU_IS_LOST",
                "NVML_ERROR_RESET_REQUIRED",
                "NVML_ERROR_DRIVER_NOT_LOADED",
                "NVML_ERROR_UNINITIALIZED",
            )
            if hasattr(nv, name)
        }
        # The clock-event call replaced the deprecated throttle-reasons name; older
        # bindings only have the latter.
        self._reasons_fn = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        # Field ids an older binding lacks are simply not asked for.
        self._field_ids = {
            name: getattr(nv, constant)
            for name, constant in (
                ("power_instant", "NVML_FI_DEV_POWER_INSTANT"),
                ("power_average", "NVML_FI_DEV_POWER_AVERAGE"),
                ("memory_temp", "NVML_FI_DEV_MEMORY_TEMP"),
            )
            if hasattr(nv, constant)
        }
        self._init_library()
        try:
            self._handle = self._lookup(kind, key, gpu)
            self._identity = DeviceIdentity(
                backend="nvml",
                name=_text(nv.nvmlDeviceGetName(self._handle)),
                uuid=_text(nv.nvmlDeviceGetUUID(self._handle)),
                pci_bus_id=_text(nv.nvmlDeviceGetPciInfo(self._handle).busId),
            )
            self._limits, self._unsupported_knobs = self._discover()
            first = self._read_now(self._clock())
        except nv.NVMLError as e:
            self._shutdown_quietly()
            raise DeviceError(f"NVML: reading GPU {gpu!r} failed: {self._describe(e)}") from None
        except _GpuLost as e:
            self._shutdown_quietly()
            raise DeviceError(f"NVML: GPU {gpu!r} is lost: {e}") from None
        self._last = first
        self._readable = provided_measurements(first)

    # -- DeviceBackend ------------------------------------------------------------------

    @property
    def identity(self) -> DeviceIdentity:
        return self._identity

    @property
    def update_period_s(self) -> float:
        return _NVML_UPDATE_PERIOD_S

    @property
    def reinit_attempts(self) -> int:
        return self._reinit_attempts

    def now_s(self) -> float:
        return self._clock()

    def limits(self) -> DeviceLimits:
        return self._limits

    def readable_fields(self) -> tuple[str, ...]:
        return self._readable

    def unsupported_knobs(self) -> dict[Knob, str]:
        return dict(self._unsupported_knobs)

    def is_lost(self) -> bool:
        return self._lost

    def current_power_limit_w(self) -> float | None:
        with self._lock:
            if self._lost:
                return None
            try:
                mw = self._query(
                    "power_limit", self._nv.nvmlDeviceGetPowerManagementLimit, self._handle
                )
            except _GpuLost as e:
                self._enter_lost(str(e))
                return None
            return mw / 1000.0 if mw is not None else None

    def current_sm_clock_lock_mhz(self) -> tuple[int, int] | None:
        # NVML cannot read locked clocks back: this is what this process set, forgotten
        # once the GPU's own clocks contradict it (_check_known_lock).
        return self._known_lock_mhz

    def write_power_limit_w(self, power_limit_w: float) -> None:
        self._write(
            Knob.POWER_LIMIT,
            self._nv.nvmlDeviceSetPowerManagementLimit,
            int(round(power_limit_w * 1000)),
        )

    def write_sm_clock_lock_mhz(self, min_mhz: int, max_mhz: int) -> None:
        self._write(
            Knob.SM_CLOCKS, self._nv.nvmlDeviceSetGpuLockedClocks, int(min_mhz), int(max_mhz)
        )
        self._known_lock_mhz = (int(min_mhz), int(max_mhz))
        self._lock_watch.reset()

    def write_sm_clock_unlock(self) -> None:
        self._write(Knob.SM_CLOCKS, self._nv.nvmlDeviceResetGpuLockedClocks)
        self._known_lock_mhz = None
        self._lock_watch.reset()

    def record_engine_step(self, activity: EngineActivity) -> float:
        """A real GPU stretches nothing: the engine's own step time is the truth."""
        return 0.0

    def read(self) -> Telemetry:
        with self._lock:
            now = self._clock()
            if self._lost and not self._try_reinit(now):
                return self._stale_snapshot(now)
            try:
                telemetry = self._read_now(now)
            except _GpuLost as e:
                self._enter_lost(str(e))
                return self._stale_snapshot(now)
            self._last = telemetry
            return telemetry

    def close(self) -> None:
        with self._lock:
            self._shutdown_quietly()

    # -- discovery ----------------------------------------------------------------------

    def _init_library(self) -> None:
        nv = self._nv
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            if e.value == nv.NVML_ERROR_LIBRARY_NOT_FOUND:
                raise NvmlUnavailableError(
                    "NVML is not available: libnvidia-ml.so.1 was not found (no NVIDIA driver here)"
                ) from None
            raise DeviceError(
                f"NVML failed to initialise: {self._describe(e)}; the NVIDIA driver looks broken "
                '(set device.backend = "virtual" to run on the simulated GPU instead)'
            ) from None

    def _lookup(self, kind: SelectorKind, key: str | int, selector: str) -> Any:
        nv = self._nv
        try:
            if kind == "index":
                return nv.nvmlDeviceGetHandleByIndex(key)
            if kind == "uuid":
                return nv.nvmlDeviceGetHandleByUUID(key)
            return nv.nvmlDeviceGetHandleByPciBusId(key)
        except nv.NVMLError as e:
            self._shutdown_quietly()
            raise DeviceError(
                f"device.gpu: no GPU matches {selector!r} by {kind} ({self._describe(e)})"
            ) from None

    def _discover(self) -> tuple[DeviceLimits, dict[Knob, str]]:
        nv, h = self._nv, self._handle
        unsupported: dict[Knob, str] = {}
        constraints = self._query(
            "power_limit_constraints", nv.nvmlDeviceGetPowerManagementLimitConstraints, h
        )
        default_mw = self._query(
            "power_limit_default", nv.nvmlDeviceGetPowerManagementDefaultLimit, h
        )
        if constraints is None or default_mw is None:
            unsupported[Knob.POWER_LIMIT] = (
                "the GPU reports no settable power-limit range (NOT_SUPPORTED)"
            )
        ladder: tuple[int, ...] = ()
        mem_clocks = self._query(
            "supported_memory_clocks", nv.nvmlDeviceGetSupportedMemoryClocks, h
        )
        if mem_clocks:
            sm_clocks = self._query(
                "supported_graphics_clocks",
                nv.nvmlDeviceGetSupportedGraphicsClocks,
                h,
                max(mem_clocks),
            )
            ladder = tuple(sorted({int(c) for c in sm_clocks or ()}))
        sm_max = self._query("max_sm_clock", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
        if not ladder and sm_max is None:
            unsupported[Knob.SM_CLOCKS] = "the GPU reports no SM clock range (NOT_SUPPORTED)"
        self._max_operating_c = self._query(
            "max_operating_temp",
            nv.nvmlDeviceGetTemperatureThreshold,
            h,
            nv.NVML_TEMPERATURE_THRESHOLD_GPU_MAX,
        )
        self._slowdown_c = self._query(
            "slowdown_temp",
            nv.nvmlDeviceGetTemperatureThreshold,
            h,
            nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
        )
        limits = DeviceLimits(
            power_limit_min_w=constraints[0] / 1000.0 if constraints else None,
            power_limit_max_w=constraints[1] / 1000.0 if constraints else None,
            power_limit_default_w=default_mw / 1000.0 if default_mw is not None else None,
            sm_clock_ladder_mhz=ladder,
            sm_clock_max_mhz=int(sm_max) if sm_max is not None else None,
        )
        return limits, unsupported

    # -- reading ------------------------------------------------------------------------

    def _query(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML read. Refused -> None, remembered; lost -> _GpuLost; other errors -> None."""
        if name in self._unsupported:
            return None
        nv = self._nv
        try:
            return fn(*args)
        except nv.NVMLError as e:
            if e.value in self._refused_codes:
                self._unsupported.add(name)
                return None
            if e.value in self._lost_codes:
                raise _GpuLost(f"{name}: {self._describe(e)}") from None
            log.debug("device: NVML %s failed: %s", name, self._describe(e))
            return None

    def _field_values(self) -> dict[str, float]:
        nv = self._nv
        wanted = [
            (n, fid) for n, fid in self._field_ids.items() if f"field:{n}" not in self._unsupported
        ]
        if not wanted:
            return {}
        try:
            values = nv.nvmlDeviceGetFieldValues(self._handle, [fid for _, fid in wanted])
        except nv.NVMLError as e:
            if e.value in self._refused_codes:
                self._unsupported.update(f"field:{n}" for n, _ in wanted)
                return {}
            if e.value in self._lost_codes:
                raise _GpuLost(f"field values: {self._describe(e)}") from None
            return {}
        out: dict[str, float] = {}
        for (name, _), fv in zip(wanted, values, strict=False):
            if fv.nvmlReturn == nv.NVML_SUCCESS:
                out[name] = self._field_number(fv)
            elif fv.nvmlReturn in self._refused_codes:
                self._unsupported.add(f"field:{name}")
            elif fv.nvmlReturn in self._lost_codes:
                raise _GpuLost(f"field {name}: NVML error {fv.nvmlReturn}")
        return out

    def _field_number(self, fv: Any) -> float:
        nv = self._nv
        members = {
            getattr(nv, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
            getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
            getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
            getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
            getattr(nv, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
            getattr(nv, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
            getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
        }
        return float(getattr(fv.value, members.get(fv.valueType, "uiVal")))

    def _read_now(self, now: float) -> Telemetry:
        nv, h = self._nv, self._handle
        fields = self._field_values()
        if "power_instant" in fields:
            power_w: float | None = fields["power_instant"] / 1000.0
            is_instant = True
        else:
            usage_mw = self._query("power_usage", nv.nvmlDeviceGetPowerUsage, h)
            power_w = usage_mw / 1000.0 if usage_mw is not None else None
            is_instant = False
        avg_mw = fields.get("power_average")
        energy_mj = self._query("energy", nv.nvmlDeviceGetTotalEnergyConsumption, h)
        gpu_temp = self._query("gpu_temp", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        sm_clock = self._query("sm_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        mem_clock = self._query("mem_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        app_clock = self._query(
            "app_sm_clock", nv.nvmlDeviceGetApplicationsClock, h, nv.NVML_CLOCK_SM
        )
        util = self._query("utilization", nv.nvmlDeviceGetUtilizationRates, h)
        mask = self._query("clock_event_reasons", self._reasons_fn, h)
        self._check_known_lock(
            now,
            None if sm_clock is None else int(sm_clock),
            None if util is None else float(util.gpu),
            None if mask is None else int(mask),
            None if app_clock is None else int(app_clock),
        )
        limit_mw = self._query("power_limit", nv.nvmlDeviceGetPowerManagementLimit, h)
        margin = None
        if hasattr(nv, "nvmlDeviceGetMarginTemperature"):
            margin = self._query("margin_temp", nv.nvmlDeviceGetMarginTemperature, h)
        if margin is None and self._max_operating_c is not None and gpu_temp is not None:
            margin = self._max_operating_c - gpu_temp
        limits = self._limits
        return Telemetry(
            timestamp_s=now,
            power_w=power_w,
            power_w_is_instant=is_instant,
            power_avg_w=avg_mw / 1000.0 if avg_mw is not None else None,
            power_avg_window_s=_NVML_POWER_AVERAGE_WINDOW_S if avg_mw is not None else None,
            energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
            gpu_temp_c=float(gpu_temp) if gpu_temp is not None else None,
            memory_temp_c=fields.get("memory_temp"),
            sm_clock_mhz=int(sm_clock) if sm_clock is not None else None,
            mem_clock_mhz=int(mem_clock) if mem_clock is not None else None,
            sm_app_clock_mhz=int(app_clock) if app_clock is not None else None,
            gpu_util_pct=float(util.gpu) if util is not None else None,
            mem_util_pct=float(util.memory) if util is not None else None,
            clock_event_reasons_mask=int(mask) if mask is not None else None,
            clock_event_reasons=decode_clock_event_reasons(int(mask)) if mask is not None else (),
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            power_limit_default_w=limits.power_limit_default_w,
            power_limit_min_w=limits.power_limit_min_w,
            power_limit_max_w=limits.power_limit_max_w,
            sm_clock_ladder_mhz=limits.sm_clock_ladder_mhz,
            sm_clock_lock_mhz=self._known_lock_mhz,
            max_operating_temp_c=float(self._max_operating_c)
            if self._max_operating_c is not None
            else None,
            slowdown_temp_c=float(self._slowdown_c) if self._slowdown_c is not None else None,
            thermal_margin_c=float(margin) if margin is not None else None,
        )

    def _check_known_lock(
        self,
        now: float,
        sm_clock_mhz: int | None,
        gpu_util_pct: float | None,
        reasons_mask: int | None,
        app_clock_mhz: int | None,
    ) -> None:
        """Forget the lock this process set once the GPU's clocks have contradicted it
        for a while: someone reset or replaced it, and it is to be written again."""
        lock = self._known_lock_mhz
        check = check_lock(lock, sm_clock_mhz, gpu_util_pct, reasons_mask, app_clock_mhz)
        if not self._lock_watch.observe(now, check):
            return
        log.warning(
            "device: the SM clock lock %s-%s MHz is no longer in force (%s): reset or "
            "replaced outside this daemon",
            lock[0],
            lock[1],
            check.why,
        )
        self._known_lock_mhz = None
        self._lock_watch.reset()

    def _stale_snapshot(self, now: float) -> Telemetry:
        if self._last is None:
            return Telemetry(timestamp_s=now, device_lost=True, stale=True)
        return dataclasses.replace(self._last, device_lost=True, stale=True)

    # -- writing ------------------------------------------------------------------------

    def _write(self, knob: Knob, fn: Callable[..., Any], *args: Any) -> None:
        nv = self._nv
        with self._lock:
            if self._lost:
                raise DeviceLostError(f"GPU {self._identity.pci_bus_id} is lost; re-initialising")
            try:
                fn(self._handle, *args)
            except nv.NVMLError as e:
                why = self._describe(e)
                if e.value in self._refused_codes:
                    raise KnobUnavailableError(knob, why) from None
                if e.value in self._lost_codes:
                    self._enter_lost(f"{fn.__name__}: {why}")
                    raise DeviceLostError(f"GPU lost during {fn.__name__}: {why}") from None
                raise DeviceError(f"{fn.__name__} failed: {why}") from None

    # -- losing and finding the GPU -------------------------------------------------------

    def _enter_lost(self, why: str) -> None:
        if self._lost:
            return
        self._lost = True
        self._backoff_s = self._backoff_initial_s
        self._next_attempt_s = self._clock() + self._backoff_s
        log.warning(
            "device: GPU %s (%s) lost: %s; telemetry is stale and the controller holds "
            "while NVML re-initialises (backoff up to %.0f s)",
            self._identity.uuid,
            self._identity.pci_bus_id,
            why,
            self._backoff_max_s,
        )

    def _try_reinit(self, now: float) -> bool:
        """One re-initialisation attempt when its backoff has passed; True when back."""
        if now < self._next_attempt_s:
            return False
        nv = self._nv
        self._reinit_attempts += 1
        self._shutdown_quietly()
        try:
            nv.nvmlInit()
            handle = nv.nvmlDeviceGetHandleByPciBusId(self._identity.pci_bus_id)
            uuid = _text(nv.nvmlDeviceGetUUID(handle))
        except nv.NVMLError as e:
            log.debug("device: re-initialising NVML failed: %s", self._describe(e))
            return self._schedule_retry(now)
        if uuid != self._identity.uuid:
            log.error(
                "device: bus %s now holds GPU %s, not %s; not taking it over",
                self._identity.pci_bus_id,
                uuid,
                self._identity.uuid,
            )
            return self._schedule_retry(now)
        self._handle = handle
        self._lost = False
        # A driver reload drops locked clocks; the controller re-applies what it wants.
        self._known_lock_mhz = None
        self._lock_watch.reset()
        log.warning(
            "device: GPU %s is back after %d re-initialisation attempt(s)",
            self._identity.uuid,
            self._reinit_attempts,
        )
        return True

    def _schedule_retry(self, now: float) -> bool:
        self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
        self._next_attempt_s = now + self._backoff_s
        return False

    def _shutdown_quietly(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass

    def _describe(self, err: Any) -> str:
        code = getattr(err, "value", None)
        name = next(
            (
                k
                for k in dir(self._nv)
                if k.startswith("NVML_ERROR_") and getattr(self._nv, k) == code
            ),
            f"NVML error {code}",
        )
        try:
            text = str(err)
        except Exception:  # pynvml may call back into the library to word an unknown code
            text = ""
        return (
            f"{name.removeprefix('NVML_ERROR_')}: {text}"
            if text
            else name.removeprefix("NVML_ERROR_")
        )
