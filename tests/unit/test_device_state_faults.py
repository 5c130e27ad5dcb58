"""Restoring GPU settings when the state file cannot be written or one setter raises.

The virtual GPU in control mode changes both knobs; then the state file's writes fail
(as in a read-only or full state directory: the test runs as any user, so the write is
made to fail rather than the directory's mode) or the backend's power-limit setter
raises. Every knob must still be restored on its own, the failure logged once, and
`wattserve device reset` must exit 0 when the device is back.
"""

from __future__ import annotations

import argparse
import logging

import pytest

from wattserve.daemon.config import load_config
from wattserve.daemon.device.commands import device_reset
from wattserve.daemon.device.factory import open_device
from wattserve.daemon.device.protocol import SetOutcome, StateFileError
from wattserve.daemon.device.state import StateFile
from wattserve.daemon.device.virtual import SimClock, VirtualGpu

STATE_NAME = "device-GPU-virtual-0.json"


pytestmark = pytest.mark.usefixtures("clean_wattserve_env")


def control_config(tmp_path):
    return load_config(
        overrides={"device": {"backend": "virtual", "mode": "control", "state_dir": str(tmp_path)}}
    )


def changed_device(tmp_path):
    device = open_device(control_config(tmp_path).device, clock=SimClock())
    assert device.set_power_limit_w(400).in_force
    assert device.lock_sm_clocks_mhz(1005, 1500).in_force
    assert (tmp_path / STATE_NAME).exists()
    return device


def break_state_writes(monkeypatch) -> None:
    def refuse(self, *args, **kwargs):
        raise StateFileError(f"cannot write state file {self.path}: Read-only file system")

    monkeypatch.setattr(StateFile, "_write", refuse)
    monkeypatch.setattr(StateFile, "clear", refuse)


def test_close_restores_every_knob_when_the_state_file_cannot_be_written(
    tmp_path, monkeypatch, caplog
):
    device = changed_device(tmp_path)
    gpu = device.backend
    break_state_writes(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="wattserve.daemon.device"):
        result = device.close(restore=True)
    assert gpu.current_power_limit_w() == 700.0
    assert gpu.current_sm_clock_lock_mhz() is None
    assert result is not None and result.complete
    assert result.state_file_error and "Read-only file system" in result.state_file_error
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "Read-only file system" in errors[0].getMessage()


def test_close_restores_the_other_knob_when_one_setter_raises(tmp_path, monkeypatch):
    device = changed_device(tmp_path)
    gpu = device.backend

    def broken(self, power_limit_w):
        raise RuntimeError("driver bug")

    monkeypatch.setattr(VirtualGpu, "write_power_limit_w", broken)
    result = device.close(restore=True)
    assert result is not None and not result.complete
    outcomes = {c.knob.value: c.outcome for c in result.changes}
    assert outcomes == {"power_limit_w": SetOutcome.FAILED, "sm_clock_lock_mhz": SetOutcome.APPLIED}
    assert gpu.current_sm_clock_lock_mhz() is None
    # The record keeps the knob still to restore, for `wattserve device reset`.
    record = StateFile(tmp_path / STATE_NAME).load()
    assert record is not None and [k.value for k in record.originals] == ["power_limit_w"]


def test_reset_exits_0_when_restored_though_the_state_file_cannot_be_removed(
    tmp_path, monkeypatch, capsys
):
    changed_device(tmp_path)  # a run that died with both knobs changed
    break_state_writes(monkeypatch)
    assert device_reset(control_config(tmp_path), argparse.Namespace()) == 0
    out, err = capsys.readouterr()
    assert "power_limit_w: restored" in out and "sm_clock_lock_mhz: restored" in out
    assert "settings restored, but" in err and "Read-only file system" in err


def test_reset_restores_the_other_knob_when_one_knob_raises(tmp_path, monkeypatch, capsys):
    changed_device(tmp_path)

    def broken(self):
        raise RuntimeError("driver bug")

    # reset opens a fresh virtual GPU (at its default limit): its power-limit read raises.
    monkeypatch.setattr(VirtualGpu, "current_power_limit_w", broken)
    assert device_reset(control_config(tmp_path), argparse.Namespace()) == 1
    out, err = capsys.readouterr()
    assert "power_limit_w: NOT restored (failed: RuntimeError: driver bug)" in out
    assert "sm_clock_lock_mhz: restored" in out
    assert "kept" in err
