"""`wattserve device info` and `wattserve device reset`, as functions the CLI calls.

info opens the configured GPU without changing anything and prints what it is, what it
can read and change, one telemetry snapshot and any settings recorded in the state file
(--json: one JSON object). reset restores the settings recorded in the state file (what
systemd runs in ExecStopPost): 0 once every knob is back, even if the state file could
not be removed (said on stderr). Both return a process exit code and print one line to
stderr on failure. Neither starts the engine; neither changes settings it did not record.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from wattserve.daemon.config import Config
from wattserve.daemon.device.factory import open_device
from wattserve.daemon.device.managed import ManagedDevice
from wattserve.daemon.device.protocol import IN_FORCE, Capabilities, DeviceError, Telemetry
from wattserve.daemon.device.state import SettingsRecord


def device_info(cfg: Config, args: argparse.Namespace) -> int:
    """Print the configured GPU's identity, capabilities and one snapshot; 0 on success."""
    device = _open(cfg, "info")
    if device is None:
        return 1
    try:
        caps = device.capabilities()
        telemetry = device.read()
        try:
            record = device.state_file.load()
            record_error = None
        except DeviceError as e:
            record, record_error = None, str(e)
        state_path = str(device.state_file.path)
    finally:
        device.close(restore=False)
    if getattr(args, "json", False):
        print(
            json.dumps(
                {
                    "capabilities": caps.to_dict(),
                    "telemetry": telemetry.to_dict(),
                    "state_file": state_path,
                    "recorded_settings": record.to_json() if record else None,
                    "state_file_error": record_error,
                },
                sort_keys=True,
            )
        )
        return 0
    print(_info_text(caps, telemetry, state_path, record, record_error))
    return 0


def device_reset(cfg: Config, args: argparse.Namespace) -> int:
    """Restore the settings recorded in the state file; 0 when nothing is left to restore."""
    device = _open(cfg, "reset")
    if device is None:
        return 1
    try:
        caps = device.capabilities()
        record = device.state_file.load()
        label = f"{caps.name} ({caps.uuid}, bus {caps.pci_bus_id})"
        if record is None:
            print(f"{label}: nothing recorded in {device.state_file.path}; settings untouched")
            return 0
        if record.written_by_live_other_process():
            print(
                f"wattserve device reset: wattserve pid {record.pid} is still running and "
                f"controls {label}; stop it first",
                file=sys.stderr,
            )
            return 1
        result = device.restore_original_settings()
    except DeviceError as e:
        print(f"wattserve device reset: {e}", file=sys.stderr)
        return 1
    finally:
        device.close(restore=False)
    print(f"{label}: settings recorded by pid {record.pid}")
    for change in result.changes:
        verb = "restored" if change.outcome in IN_FORCE else "NOT restored"
        print(f"  {change.knob.value}: {verb} ({change.outcome.value}: {change.detail})")
    if result.complete and result.state_file_error is not None:
        # The GPU is back as recorded; only the bookkeeping failed (a rerun is harmless).
        print(
            f"wattserve device reset: settings restored, but {result.state_file_error}",
            file=sys.stderr,
        )
        return 0
    if result.complete:
        print(f"  state file {result.state_file} removed")
        return 0
    print(f"  state file {result.state_file} kept", file=sys.stderr)
    return 1


def _open(cfg: Config, command: str) -> ManagedDevice | None:
    # Never restore at open: info must change nothing, and reset reports what it restores.
    try:
        return open_device(cfg.device, restore_leftover=False)
    except DeviceError as e:
        print(f"wattserve device {command}: {e}", file=sys.stderr)
        return None


def _fmt(value: Any, unit: str, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f} {unit}" if isinstance(value, float) else f"{value} {unit}"


def _info_text(
    caps: Capabilities,
    t: Telemetry,
    state_path: str,
    record: SettingsRecord | None,
    record_error: str | None,
) -> str:
    lines = []
    if caps.is_virtual:
        lines.append("*** VIRTUAL GPU: simulated, not real hardware (device.backend) ***")
    lines.append(f"gpu        {caps.name}")
    lines.append(f"uuid       {caps.uuid}")
    lines.append(f"pci bus    {caps.pci_bus_id}")
    lines.append(
        f"backend    {caps.backend}, mode {caps.mode}, updates every {caps.update_period_s:g} s"
    )
    for i, knob in enumerate(caps.knobs):
        state = "settable" if knob.writable else "read-only"
        head = "knobs      " if i == 0 else "           "
        lines.append(f"{head}{knob.knob.value}: {state} ({knob.reason})")
    lines.append(f"reads      {', '.join(caps.readable)}")
    kind = "instantaneous" if t.power_w_is_instant else "driver reading"
    avg = (
        f", {_fmt(t.power_avg_w, 'W', 1)} averaged over {t.power_avg_window_s:g} s"
        if t.power_avg_window_s
        else ""
    )
    lines.append(
        f"power      {_fmt(t.power_w, 'W', 1)} {kind}{avg}; "
        f"energy counter {_fmt(t.energy_j, 'J', 3)}"
    )
    lines.append(
        f"limit      {_fmt(t.power_limit_w, 'W')} (default {_fmt(t.power_limit_default_w, 'W')}, "
        f"range {_fmt(t.power_limit_min_w, 'W')} to {_fmt(t.power_limit_max_w, 'W')})"
    )
    lines.append(
        f"temp       gpu {_fmt(t.gpu_temp_c, 'C')}, memory {_fmt(t.memory_temp_c, 'C')}; "
        f"max operating {_fmt(t.max_operating_temp_c, 'C')}, slowdown "
        f"{_fmt(t.slowdown_temp_c, 'C')}, margin {_fmt(t.thermal_margin_c, 'C')}"
    )
    ladder = (
        f"{t.sm_clock_ladder_mhz[0]}-{t.sm_clock_ladder_mhz[-1]} MHz "
        f"({len(t.sm_clock_ladder_mhz)} steps)"
        if t.sm_clock_ladder_mhz
        else "n/a"
    )
    lock = (
        f"{t.sm_clock_lock_mhz[0]}-{t.sm_clock_lock_mhz[1]} MHz"
        if t.sm_clock_lock_mhz
        else "none known"
    )
    lines.append(
        f"clocks     sm {_fmt(t.sm_clock_mhz, 'MHz')}, memory {_fmt(t.mem_clock_mhz, 'MHz')}; "
        f"sm ladder {ladder}; lock {lock}"
    )
    lines.append(f"util       gpu {_fmt(t.gpu_util_pct, '%')}, memory {_fmt(t.mem_util_pct, '%')}")
    lines.append(f"reasons    {', '.join(t.clock_event_reasons) or 'none'}")
    if t.device_lost:
        lines.append("status     GPU LOST: telemetry is stale")
    if record_error:
        lines.append(f"state      {record_error}")
    elif record is None:
        lines.append(f"state      {state_path}: nothing recorded")
    else:
        recorded = ", ".join(f"{k.value}={v}" for k, v in record.originals.items())
        lines.append(
            f"state      {state_path}: originals recorded by pid {record.pid}: {recorded} "
            "(restore with `wattserve device reset`)"
        )
    return "\n".join(lines)
