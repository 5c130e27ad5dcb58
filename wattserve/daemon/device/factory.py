"""open_device: build the daemon's Device from [device] config.

backend = "nvml" uses the real GPU and fails loudly if NVML is missing or broken;
"virtual" uses the simulated GPU and says so; "auto" tries NVML and falls back to the
virtual GPU with one log line only when NVML is absent (a broken driver stays an error).
At start, settings a crashed run left recorded are restored first (control mode).
This module must not be imported by backends and must not hold any device globally.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from wattserve.daemon.config import DeviceConfig
from wattserve.daemon.device.gate import ActuationGate
from wattserve.daemon.device.managed import ManagedDevice
from wattserve.daemon.device.nvml import NvmlBackend
from wattserve.daemon.device.power_calibration import PowerCalibration
from wattserve.daemon.device.protocol import DeviceBackend, DeviceError, NvmlUnavailableError
from wattserve.daemon.device.state import StateFile, resolve_state_dir, state_file_path
from wattserve.daemon.device.virtual import VirtualGpu, VirtualGpuParams

log = logging.getLogger(__name__)


def open_device(
    cfg: DeviceConfig,
    *,
    clock: Callable[[], float] | None = None,
    environ: Mapping[str, str] | None = None,
    virtual_params: VirtualGpuParams | None = None,
    restore_leftover: bool = True,
) -> ManagedDevice:
    """Open the configured GPU as a ManagedDevice.

    clock: the monotonic clock (a SimClock for simulated time); default time.monotonic.
    virtual_params: the simulated GPU's parameters; seed and ambient come from cfg.
    restore_leftover: restore settings a previous run left recorded (control mode), or
    in observe mode leave them and say so. `wattserve device info|reset` pass False.
    Raises DeviceError (NvmlUnavailableError when backend = "nvml" and NVML is absent).
    """
    backend = _open_backend(cfg, clock or time.monotonic, virtual_params)
    try:
        gate = ActuationGate(cfg.mode)
        state = StateFile(
            state_file_path(resolve_state_dir(cfg.state_dir, environ), backend.identity)
        )
        device = ManagedDevice(backend, gate, state)
        try:
            record = state.load()
        except DeviceError as e:
            if cfg.mode == "control" and restore_leftover:
                raise  # without the record, changes could not be undone
            log.warning("device: %s", e)
            record = None
        if record is not None and restore_leftover:
            _handle_leftover(device, cfg, record.pid, record.written_by_live_other_process())
    except BaseException:
        backend.close()
        raise
    return device


def _open_backend(
    cfg: DeviceConfig, clock: Callable[[], float], virtual_params: VirtualGpuParams | None
) -> DeviceBackend:
    if cfg.backend == "virtual":
        gpu = _virtual(cfg, clock, virtual_params)
        log.info(
            "device: using the virtual GPU (%s, simulated) as configured by device.backend",
            gpu.identity.name,
        )
        return gpu
    try:
        nvml = NvmlBackend(cfg.gpu, clock=clock)
    except NvmlUnavailableError as e:
        if cfg.backend == "nvml":
            raise
        gpu = _virtual(cfg, clock, virtual_params)
        log.warning(
            "device: %s; using the virtual GPU (%s, simulated: power and temperatures "
            "are modelled, not measured)",
            e,
            gpu.identity.name,
        )
        return gpu
    log.info(
        "device: using %s (%s, bus %s) through NVML",
        nvml.identity.name,
        nvml.identity.uuid,
        nvml.identity.pci_bus_id,
    )
    return nvml


def _virtual(
    cfg: DeviceConfig, clock: Callable[[], float], params: VirtualGpuParams | None
) -> VirtualGpu:
    params = dataclasses.replace(
        params or VirtualGpuParams(), seed=cfg.virtual_seed, ambient_c=cfg.virtual_ambient_c
    )
    calibration = None
    if cfg.virtual_power_calibration is not None:
        calibration = PowerCalibration.load(cfg.virtual_power_calibration)
        log.info(
            "device: the virtual GPU prices power from %s (%s at %.0f MHz)",
            cfg.virtual_power_calibration,
            calibration.gpu_name,
            calibration.sm_clock_mhz,
        )
    return VirtualGpu(params, clock=clock, calibration=calibration)


def _handle_leftover(device: ManagedDevice, cfg: DeviceConfig, pid: int, live_other: bool) -> None:
    path = device.state_file.path
    if live_other:
        if cfg.mode == "control":
            raise DeviceError(
                f"GPU {device.capabilities().uuid} is controlled by another running wattserve "
                f"(pid {pid}, state file {path}); stop it first"
            )
        log.warning(
            "device: another wattserve (pid %d) controls this GPU (state file %s); observing only",
            pid,
            path,
        )
        return
    if cfg.mode == "observe":
        log.warning(
            "device: settings changed by an earlier run (pid %d) are still in force; "
            "observe mode leaves them: run `wattserve device reset` with device.mode = "
            '"control" to restore them (state file %s)',
            pid,
            path,
        )
        return
    result = device.restore_original_settings()
    summary = ", ".join(f"{c.knob.value} {c.outcome.value} ({c.detail})" for c in result.changes)
    if result.complete:
        log.warning("device: restored settings left by an earlier run (pid %d): %s", pid, summary)
    else:
        device.adopt_leftover_record()  # keep trying at clean exit
        log.error(
            "device: could not restore every setting left by an earlier run (pid %d): %s; "
            "state file kept at %s",
            pid,
            summary,
            path,
        )
