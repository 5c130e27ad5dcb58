"""install.sh --root refuses a tree it does not own or that holds links or executables it
did not make, and writes nothing through a link.

Each test plants something in a temporary --root, runs install.sh (or --uninstall) and
checks the refusal, that the tree is exactly as planted, and that the link's target or
the planted program was left alone. Ownership cases chown to another uid and need root.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL_SH = REPO / "systemd" / "install.sh"
OTHER_UID = 65534  # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(INSTALL_SH), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every entry under root, links not followed: (mode, content or link target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            what = "-> " + os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            what = p.read_text()
        else:
            what = ""
        out[str(p.relative_to(root))] = (st.st_mode, what)
    return out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir(mode=0o755)
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the root that a followed link would overwrite."""
    path = tmp_path / "outside" / "victim"
    path.parent.mkdir()
    path.write_text("precious\n")
    return path


def refused(r: subprocess.CompletedProcess[str], why: str) -> bool:
    return r.returncode != 0 and "refusing" in r.stderr and why in r.stderr


@pytest.mark.parametrize(
    "target",
    [
        "etc/wattserve/config.toml",
        "etc/wattserve/api-token",
        "etc/systemd/system/wattserve.service",
        "opt/wattserve/share/wattserve/systemd/config.example.toml",
        "etc/wattserve/fleet.toml",
        "etc/systemd/system/wattserve-fleet.service",
        "opt/wattserve/share/wattserve/systemd/fleet.example.toml",
    ],
)
def test_a_link_at_a_target_path_is_refused_and_not_written_through(root, victim, target):
    link = root / target
    link.parent.mkdir(parents=True)
    link.symlink_to(victim)
    before = snapshot(root)
    r = install(root, "--no-venv")
    assert refused(r, "symbolic link"), r.stderr
    assert snapshot(root) == before
    assert victim.read_text() == "precious\n"


def test_a_linked_directory_on_the_way_is_refused(root, victim):
    (root / "etc").symlink_to(victim.parent, target_is_directory=True)
    before = snapshot(root)
    r = install(root, "--no-venv")
    assert refused(r, "symbolic link"), r.stderr
    assert snapshot(root) == before
    assert sorted(os.listdir(victim.parent)) == ["victim"]


def test_a_linked_directory_is_not_followed_by_uninstall(root, victim):
    (root / "opt").symlink_to(victim.parent, target_is_directory=True)
    (victim.parent / "wattserve").mkdir()
    r = install(root, "--uninstall")
    assert refused(r, "symbolic link"), r.stderr
    assert (victim.parent / "wattserve").is_dir()


def test_the_token_is_never_written_through_a_planted_temporary_name(root, victim):
    (root / "etc" / "wattserve").mkdir(parents=True)
    (root / "etc" / "wattserve" / "api-token.tmp").symlink_to(victim)
    r = install(root, "--no-venv")
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious\n"
    token = root / "etc" / "wattserve" / "api-token"
    assert not token.is_symlink() and stat.S_IMODE(token.stat().st_mode) == 0o600


def test_an_executable_at_a_target_path_is_refused(root):
    unit = root / "etc" / "systemd" / "system" / "wattserve.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("#!/bin/sh\n")
    unit.chmod(0o755)
    before = snapshot(root)
    r = install(root, "--no-venv")
    assert refused(r, "not a plain file"), r.stderr
    assert snapshot(root) == before


def test_a_group_writable_directory_is_refused(root):
    (root / "etc").mkdir()
    (root / "etc").chmod(0o775)
    before = snapshot(root)
    r = install(root, "--no-venv")
    assert refused(r, "writable by group or others"), r.stderr
    assert snapshot(root) == before


@needs_root
def test_a_root_owned_by_someone_else_is_refused(root):
    os.chown(root, OTHER_UID, OTHER_UID)
    r = install(root, "--no-venv")
    assert refused(r, "not owned"), r.stderr
    assert list(root.iterdir()) == []


@needs_root
def test_a_directory_of_someone_else_inside_the_root_is_refused(root):
    (root / "etc" / "wattserve").mkdir(parents=True)
    os.chown(root / "etc" / "wattserve", OTHER_UID, OTHER_UID)
    before = snapshot(root)
    r = install(root, "--no-venv")
    assert refused(r, "not owned"), r.stderr
    assert snapshot(root) == before


def _plant_venv(root: Path, marker: Path) -> Path:
    """A fake /opt/wattserve venv whose python and pip would leave `marker` if run."""
    bin_dir = root / "opt" / "wattserve" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "pip"):
        program = bin_dir / name
        program.write_text(f"#!/bin/sh\necho ran >> {marker}\n")
        program.chmod(0o755)
    return bin_dir


@needs_root
def test_programs_in_opt_of_someone_else_are_never_run(root, tmp_path):
    marker = tmp_path / "ran"
    bin_dir = _plant_venv(root, marker)
    os.chown(bin_dir / "pip", OTHER_UID, OTHER_UID)
    before = snapshot(root)
    r = install(root)  # with the venv: it would run opt/wattserve/bin/pip
    assert refused(r, "not owned"), r.stderr
    assert not marker.exists()
    assert snapshot(root) == before


def test_a_link_in_opt_that_a_venv_does_not_make_is_refused(root, tmp_path):
    marker = tmp_path / "ran"
    bin_dir = _plant_venv(root, marker)
    (bin_dir / "pip").unlink()
    elsewhere = tmp_path / "elsewhere-pip"
    elsewhere.write_text(f"#!/bin/sh\necho ran >> {marker}\n")
    elsewhere.chmod(0o755)
    (bin_dir / "pip").symlink_to(elsewhere)
    r = install(root)
    assert refused(r, "symbolic link"), r.stderr
    assert not marker.exists()
