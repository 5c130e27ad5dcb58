"""`wattserve device info` and `wattserve device reset` on the virtual GPU."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from wattserve.daemon.config import load_config
from wattserve.daemon.device.commands import device_info, device_reset
from wattserve.daemon.device.factory import open_device
from wattserve.daemon.device.virtual import SimClock

STATE_NAME = "device-GPU-virtual-0.json"


pytestmark = pytest.mark.usefixtures("clean_wattserve_env")


def config(tmp_path, mode="observe", backend="virtual"):
    return load_config(
        overrides={
            "device": {"backend": backend, "mode": mode, "state_dir": str(tmp_path)},
        }
    )


def crash_after_changes(tmp_path) -> None:
    """A control-mode run that changed both knobs and died without cleaning up."""
    device = open_device(config(tmp_path, mode="control").device, clock=SimClock())
    assert device.set_power_limit_w(400).in_force
    assert device.lock_sm_clocks_mhz(1005, 1500).in_force
    assert (tmp_path / STATE_NAME).exists()


def test_info_prints_identity_capabilities_and_a_snapshot(tmp_path, capsys):
    assert device_info(config(tmp_path), argparse.Namespace(json=False)) == 0
    out = capsys.readouterr().out
    assert out.startswith("*** VIRTUAL GPU")
    assert "NVIDIA H200 (virtual)" in out and "GPU-virtual-0" in out
    assert "mode observe" in out and "power_limit_w: read-only (device.mode = observe)" in out
    assert "instantaneous" in out and "averaged over 1 s" in out and "energy counter" in out
    assert "sm ladder 345-1980 MHz (110 steps)" in out
    assert "reasons    GpuIdle" in out
    assert "nothing recorded" in out


def test_info_json_is_one_object(tmp_path, capsys):
    assert device_info(config(tmp_path, mode="control"), argparse.Namespace(json=True)) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    info = json.loads(out[0])
    caps, t = info["capabilities"], info["telemetry"]
    assert caps["is_virtual"] and caps["backend"] == "virtual" and caps["mode"] == "control"
    assert {k["knob"] for k in caps["knobs"] if k["writable"]} == {
        "power_limit_w",
        "sm_clock_lock_mhz",
    }
    assert 65 <= t["power_w"] <= 75 and t["power_w_is_instant"]
    assert t["clock_event_reasons"] == ["GpuIdle"] and not t["stale"]
    assert info["recorded_settings"] is None and info["state_file"].endswith(STATE_NAME)


def test_info_shows_a_leftover_record_and_leaves_it(tmp_path, capsys):
    crash_after_changes(tmp_path)
    before = (tmp_path / STATE_NAME).read_bytes()
    assert device_info(config(tmp_path, mode="control"), argparse.Namespace(json=False)) == 0
    out = capsys.readouterr().out
    assert f"recorded by pid {os.getpid()}" in out and "power_limit_w=700.0" in out
    assert (tmp_path / STATE_NAME).read_bytes() == before


def test_reset_with_nothing_recorded_changes_nothing(tmp_path, capsys):
    assert device_reset(config(tmp_path, mode="control"), argparse.Namespace()) == 0
    assert "nothing recorded" in capsys.readouterr().out


def test_reset_restores_what_a_crashed_run_recorded(tmp_path, capsys):
    crash_after_changes(tmp_path)
    assert device_reset(config(tmp_path, mode="control"), argparse.Namespace()) == 0
    out = capsys.readouterr().out
    assert f"settings recorded by pid {os.getpid()}" in out
    assert "power_limit_w: restored" in out and "700 W" in out
    assert "sm_clock_lock_mhz: restored (applied: unlocked)" in out
    assert "removed" in out and not (tmp_path / STATE_NAME).exists()
    # Run again (as ExecStopPost would after a clean exit): nothing left to do.
    assert device_reset(config(tmp_path, mode="control"), argparse.Namespace()) == 0
    assert "nothing recorded" in capsys.readouterr().out


def test_reset_in_observe_mode_keeps_the_record_and_fails(tmp_path, capsys):
    crash_after_changes(tmp_path)
    assert device_reset(config(tmp_path, mode="observe"), argparse.Namespace()) == 1
    captured = capsys.readouterr()
    assert "NOT restored (observe_only: device.mode = observe" in captured.out
    assert "kept" in captured.err
    assert (tmp_path / STATE_NAME).exists()


def test_commands_report_an_unavailable_backend_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert device_info(config(tmp_path, backend="nvml"), argparse.Namespace(json=True)) == 1
    assert device_reset(config(tmp_path, backend="nvml"), argparse.Namespace()) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert err[0].startswith("wattserve device info: NVML is not available")
    assert err[1].startswith("wattserve device reset: NVML is not available")
