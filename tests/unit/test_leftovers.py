"""Leftover temporary files are removed at the next start only when their writer is gone.

The state file's `.<name>.<pid>.tmp` (opening the device in control mode) and a model
conversion's `<entry>.tmp<pid>` (loading a model) are planted for a dead pid, a live pid
of another process, and this process's own pid before and after it started.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from wattserve.daemon.config import load_config
from wattserve.daemon.device.factory import open_device
from wattserve.daemon.device.virtual import SimClock
from wattserve.daemon.engine.loader import load_model

STATE_NAME = "device-GPU-virtual-0.json"


pytestmark = pytest.mark.usefixtures("clean_wattserve_env")


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not psutil.pid_exists(proc.pid)
    return proc.pid


def live_other_pid() -> int:
    pid = os.getppid()  # the test runner's parent: alive, and not us
    assert pid != os.getpid() and psutil.pid_exists(pid)
    return pid


def before_this_process_started(path) -> None:
    started = psutil.Process().create_time()
    if started - 1 < psutil.boot_time():
        pytest.skip("this process started within a second of boot")
    os.utime(path, (started - 1, started - 1))


def test_opening_the_device_removes_state_temp_files_of_gone_writers(tmp_path, dead_pid):
    def plant(pid):
        path = tmp_path / f".{STATE_NAME}.{pid}.tmp"
        path.write_text("{")
        return path

    dead, live, own_old = plant(dead_pid), plant(live_other_pid()), plant(os.getpid())
    before_this_process_started(own_old)
    other_gpu = tmp_path / f".device-GPU-other.json.{dead_pid}.tmp"
    other_gpu.write_text("{")

    def device_config(mode):
        device = {"backend": "virtual", "mode": mode, "state_dir": str(tmp_path)}
        return load_config(overrides={"device": device}).device

    open_device(device_config("observe"), clock=SimClock()).close(restore=False)
    assert dead.exists() and own_old.exists()  # observe mode writes nothing, removes nothing

    open_device(device_config("control"), clock=SimClock()).close()
    assert not dead.exists() and not own_old.exists()
    assert live.exists()
    assert other_gpu.exists()  # another GPU's file is for that GPU's device to judge
    assert not (tmp_path / STATE_NAME).exists()


def test_loading_a_model_removes_conversions_of_gone_writers(tmp_path, tiny_dirs, dead_pid):
    converted = tmp_path / "converted"
    converted.mkdir()

    def plant(name):
        path = converted / name
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half")
        return path

    dead = plant(f"SmolLM2-135M-Instruct.Q4_1-0123456789abcdef.tmp{dead_pid}")
    live = plant(f"other-0123456789abcdef.tmp{live_other_pid()}")
    own_old = plant(f"old-0123456789abcdef.tmp{os.getpid()}")
    before_this_process_started(own_old)
    own_new = plant(f"new-0123456789abcdef.tmp{os.getpid()}")
    entry = plant("SmolLM2-135M-Instruct.Q4_1-0123456789abcdef")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep").write_text("x")
    (converted / f"link.tmp{dead_pid}").symlink_to(outside)

    load_model(str(tiny_dirs["llama"]), tmp_path)
    assert not dead.exists() and not own_old.exists()
    assert live.exists() and own_new.exists() and entry.exists()
    # A planted link is removed itself; what it pointed at is untouched.
    assert not (converted / f"link.tmp{dead_pid}").is_symlink()
    assert (outside / "keep").exists()
