"""The C++ kernels' build lock: a build killed mid-way never makes a later start wait.

torch.utils.cpp_extension.load takes its own lock file in the build directory and waits,
polling, for as long as that file exists; a build killed mid-way leaves it behind. These
tests run the real cpp_extension.load with its compile and import steps stubbed (no
compiler, seconds), and make torch's wait raise instead of spinning, so that a load that
would wait fails at once instead of hanging the test.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from wattserve.kernels.extension import BUILD_LOCK_NAME, build_and_load, build_lock


class _NeverWait(cpp_extension.FileBaton):
    def wait(self) -> None:
        raise AssertionError(f"the load waited on torch's build lock {self.lock_file_path}")


@pytest.fixture
def stubbed_build(monkeypatch) -> list[str]:
    """cpp_extension.load up to, around and after its lock, without compiling: the build
    directories it would have built in."""
    built: list[str] = []
    monkeypatch.setattr(cpp_extension, "FileBaton", _NeverWait)
    monkeypatch.setattr(
        cpp_extension,
        "_write_ninja_file_and_build_library",
        lambda **kw: built.append(kw["build_directory"]),
    )
    monkeypatch.setattr(cpp_extension, "_import_module_from_library", lambda *a, **kw: None)
    return built


def test_a_torch_lock_left_by_a_killed_build_does_not_make_the_load_wait(
    tmp_path, stubbed_build, caplog
):
    build_dir = tmp_path / "wattserve_cpu_kernels_test0"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what a build killed mid-way leaves
    with caplog.at_level(logging.WARNING, logger="wattserve.kernels.extension"):
        build_and_load("wattserve_cpu_kernels_test0", build_dir)
    assert stubbed_build == [str(build_dir)]  # built there, without waiting
    assert not (build_dir / "lock").exists()
    assert any("stale build lock" in r.getMessage() for r in caplog.records)


def test_a_torch_lock_a_live_process_holds_open_is_waited_on_not_removed(
    tmp_path, stubbed_build
):
    """A build by code that takes torch's lock without ours (an older wattserve) is live."""
    build_dir = tmp_path / "wattserve_cpu_kernels_test2"
    build_dir.mkdir()
    lock = build_dir / "lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, time\n"
            f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)\n"  # as torch's FileBaton
            "print('held', flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(AssertionError, match="waited on torch's build lock"):
            build_and_load("wattserve_cpu_kernels_test2", build_dir)
        assert lock.exists() and stubbed_build == []
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_load_without_a_leftover_lock_builds_and_leaves_no_lock(tmp_path, stubbed_build):
    build_dir = tmp_path / "fresh"
    build_and_load("wattserve_cpu_kernels_test1", build_dir)
    assert stubbed_build == [str(build_dir)]
    assert sorted(p.name for p in build_dir.iterdir()) == [BUILD_LOCK_NAME]


def test_our_lock_is_held_by_a_live_builder_and_freed_when_it_is_killed(tmp_path: Path):
    """Why ours can judge torch's: the kernel drops an flock with the process holding it."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            f"f = open({str(tmp_path / BUILD_LOCK_NAME)!r}, 'a')\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with build_lock(tmp_path, wait=False) as held:
            assert held is False  # a live build: its torch lock is not ours to remove
        holder.kill()  # a build killed mid-way
        holder.wait(timeout=30)
        with build_lock(tmp_path, wait=False) as held:
            assert held is True
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
