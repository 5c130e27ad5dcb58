"""The systemd unit, its control drop-in and install.sh, checked with systemd's own tools.

install.sh runs into a temporary --root; `systemd-analyze verify` and `systemd-analyze
security --offline=yes` then read the installed tree with --root (with this machine's
stock units copied in, since a unit's dependencies must resolve). No live systemctl:
the machine need not be booted with systemd. Tests that need systemd-analyze or
shellcheck skip with a reason where the binary is absent (`make test-services` installs
both).
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from wattserve.daemon.cli import main

REPO = Path(__file__).resolve().parents[2]
SYSTEMD_DIR = REPO / "systemd"
INSTALL_SH = SYSTEMD_DIR / "install.sh"
MAX_EXPOSURE = 3.0

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (make test-services installs package systemd)",
)


def install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(INSTALL_SH), "--root", str(root), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )


def tree(root: Path) -> dict[str, str]:
    """relative path -> permission string ("d" prefix for directories)."""
    out = {}
    for p in sorted(root.rglob("*")):
        kind = "d" if p.is_dir() else "-"
        out[str(p.relative_to(root))] = kind + oct(stat.S_IMODE(p.stat().st_mode))[2:]
    return out


def analyzable_root(tmp_path: Path, control: bool) -> Path:
    """An installed tree that systemd-analyze can load the unit from with --root."""
    root = tmp_path / ("control" if control else "observe")
    root.mkdir()
    r = install(root, "--no-venv", *(["--control"] if control else []))
    assert r.returncode == 0, r.stderr
    # The stock units (sysinit.target, multi-user.target, ...) the unit depends on.
    stock = next(p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
                 if p.is_dir())
    shutil.copytree(stock, root / "usr/lib/systemd/system", symlinks=True)
    # verify checks that ExecStart= is executable; a launcher of this checkout's daemon.
    exe = root / "opt/wattserve/bin/wattserve"
    exe.parent.mkdir(parents=True)
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m wattserve.daemon.cli "$@"\n')
    exe.chmod(0o755)
    return root


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", *args], capture_output=True, text=True, timeout=60, check=False
    )


def exposure(root: Path) -> float:
    r = analyze("security", "--offline=yes", f"--root={root}", "--no-pager", "wattserve.service")
    m = re.search(r"Overall exposure level for wattserve\.service: (\d+\.\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


def flagged(root: Path) -> set[str]:
    """The security checks that count against the unit."""
    r = analyze("security", "--offline=yes", f"--root={root}", "--json=short",
                "wattserve.service")
    assert r.returncode == 0, r.stderr
    return {e["name"] for e in json.loads(r.stdout) if e["exposure"] not in (None, "0.0")}


@needs_analyze
@pytest.mark.parametrize("control", [False, True], ids=["observe", "control"])
def test_systemd_analyze_verify_is_clean(tmp_path, control) -> None:
    root = analyzable_root(tmp_path, control)
    r = analyze("verify", f"--root={root}", "wattserve.service")
    # verify exits 0 on many problems (unknown keys, bad values): any output is a finding.
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr


@needs_analyze
@pytest.mark.parametrize("instance", ["0", "GPU-5f2c0c1e-8a3b-4c7d-9e10-0123456789ab"])
def test_systemd_analyze_verify_is_clean_for_a_gpu_instance(tmp_path, instance) -> None:
    root = analyzable_root(tmp_path, control=False)
    (root / f"etc/wattserve/gpu-{instance}.env").write_text("WATTSERVE_SERVER__PORT=8001\n")
    r = analyze("verify", f"--root={root}", f"wattserve@{instance}.service")
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr


def test_gpu_template_differs_from_the_unit_only_per_instance() -> None:
    """The template is wattserve.service with the GPU, port, state, cache and node id
    made per instance; every hardening line is the same."""
    unit = (SYSTEMD_DIR / "wattserve.service").read_text().splitlines()
    template = (SYSTEMD_DIR / "wattserve@.service").read_text().splitlines()

    def settings(lines: list[str]) -> set[str]:
        return {ln for ln in lines if ln and not ln.startswith("#")}

    added, removed = settings(template) - settings(unit), settings(unit) - settings(template)
    assert removed == {
        "Description=wattserve power-aware LLM inference daemon",
        "Environment=WATTSERVE_CACHE=%C/wattserve/weights",
        "Environment=XDG_CACHE_HOME=%C/wattserve",
        "StateDirectory=wattserve",
        "CacheDirectory=wattserve",
    }
    assert added == {
        "Description=wattserve power-aware LLM inference daemon on GPU %i",
        "Environment=WATTSERVE_DEVICE__GPU=%i",
        "Environment=WATTSERVE_ENGINE__DEVICE=auto",
        "Environment=WATTSERVE_MQTT__NODE_ID=%H-%i",
        "EnvironmentFile=%E/wattserve/gpu-%i.env",
        "Environment=WATTSERVE_CACHE=%C/wattserve-%i/weights",
        "Environment=XDG_CACHE_HOME=%C/wattserve-%i",
        "StateDirectory=wattserve-%i",
        "CacheDirectory=wattserve-%i",
    }


@needs_analyze
def test_verify_would_catch_a_broken_unit(tmp_path) -> None:
    root = analyzable_root(tmp_path, control=False)
    unit = root / "etc/systemd/system/wattserve.service"
    unit.write_text(unit.read_text().replace("WatchdogSec=30", "WatchdogSec=thirty"))
    r = analyze("verify", f"--root={root}", "wattserve.service")
    assert "WatchdogSec" in r.stdout + r.stderr or "thirty" in r.stdout + r.stderr


@needs_analyze
def test_observe_unit_exposure_and_capabilities(tmp_path, record_property) -> None:
    observe = analyzable_root(tmp_path, control=False)
    control = analyzable_root(tmp_path, control=True)
    observe_score, control_score = exposure(observe), exposure(control)
    record_property("exposure_observe", observe_score)
    record_property("exposure_control", control_score)
    print(f"systemd-analyze security exposure: observe {observe_score}, control {control_score}")
    assert observe_score <= MAX_EXPOSURE
    observe_flags, control_flags = flagged(observe), flagged(control)
    # Observe mode holds no capability at all, and sees other users only as nobody.
    assert not {f for f in observe_flags if "Capabilit" in f or f == "PrivateUsers="}
    # The drop-in adds exactly CAP_SYS_ADMIN (ambient) and the host user namespace it needs.
    assert control_flags - observe_flags == {
        "CapabilityBoundingSet=~CAP_SYS_ADMIN", "AmbientCapabilities=", "PrivateUsers=",
    }
    assert control_score > observe_score


def test_install_tree_is_as_documented_and_idempotent(tmp_path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    r = install(root, "--no-venv")
    assert r.returncode == 0, r.stderr
    share = "opt/wattserve/share/wattserve/systemd"
    files = {
        "etc/systemd/system/wattserve.service": "-644",
        "etc/systemd/system/wattserve@.service": "-644",
        "etc/systemd/system/wattserve-fleet.service": "-644",
        "etc/wattserve/config.toml": "-644",
        "etc/wattserve/fleet.toml": "-644",
        "etc/wattserve/api-token": "-600",
        f"{share}/wattserve.service": "-644",
        f"{share}/wattserve@.service": "-644",
        f"{share}/wattserve-control.conf": "-644",
        f"{share}/config.example.toml": "-644",
        f"{share}/wattserve-fleet.service": "-644",
        f"{share}/fleet.example.toml": "-644",
    }
    first = tree(root)
    assert {k: v for k, v in first.items() if v[0] == "-"} == files
    assert (root / "etc/systemd/system/wattserve.service").read_text() == (
        SYSTEMD_DIR / "wattserve.service"
    ).read_text()
    assert (root / "etc/wattserve/config.toml").read_text() == (
        SYSTEMD_DIR / "config.example.toml"
    ).read_text()
    # The fleet allocator's unit (not enabled: no [Install] link is made) and its example.
    assert (root / "etc/systemd/system/wattserve-fleet.service").read_text() == (
        SYSTEMD_DIR / "wattserve-fleet.service"
    ).read_text()
    assert (root / "etc/wattserve/fleet.toml").read_text() == (
        SYSTEMD_DIR / "fleet.example.toml"
    ).read_text()
    assert not (root / "etc/systemd/system/multi-user.target.wants").exists()
    token = (root / "etc/wattserve/api-token").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}\n", token)

    # Again, after the admin edited the configs: same tree, configs and token kept.
    (root / "etc/wattserve/config.toml").write_text("[server]\nport = 8001\n")
    edited_fleet = (root / "etc/wattserve/fleet.toml").read_text().replace("2400.0", "3000.0")
    (root / "etc/wattserve/fleet.toml").write_text(edited_fleet)
    r = install(root, "--no-venv")
    assert r.returncode == 0, r.stderr
    assert tree(root) == first
    assert (root / "etc/wattserve/api-token").read_text() == token
    assert (root / "etc/wattserve/config.toml").read_text() == "[server]\nport = 8001\n"
    assert (root / "etc/wattserve/fleet.toml").read_text() == edited_fleet

    # --control adds the drop-in, and only that.
    r = install(root, "--no-venv", "--control")
    assert r.returncode == 0 and "control mode" in r.stdout, r.stderr
    added = set(tree(root)) - set(first)
    assert added == {
        "etc/systemd/system/wattserve.service.d",
        "etc/systemd/system/wattserve.service.d/control.conf",
    }

    # --uninstall keeps config, token and state; --purge removes them too.
    (root / "var/lib/private/wattserve").mkdir(parents=True)
    r = install(root, "--uninstall")
    assert r.returncode == 0, r.stderr
    left = {k for k, v in tree(root).items() if v[0] == "-"}
    assert left == {
        "etc/wattserve/config.toml",
        "etc/wattserve/fleet.toml",
        "etc/wattserve/api-token",
    }
    assert not (root / "opt/wattserve").exists()
    assert not (root / "etc/systemd/system/wattserve.service.d").exists()
    assert (root / "var/lib/private/wattserve").is_dir()
    r = install(root, "--uninstall", "--purge")
    assert r.returncode == 0, r.stderr
    assert not (root / "etc/wattserve").exists()
    assert not (root / "var/lib/private/wattserve").exists()


def test_install_refuses_bad_arguments(tmp_path) -> None:
    r = install(tmp_path, "--bogus")
    assert r.returncode != 0 and "unknown argument" in r.stderr
    r = install(tmp_path, "--purge")
    assert r.returncode != 0 and "--uninstall" in r.stderr
    r = subprocess.run(
        ["bash", str(INSTALL_SH), "--root", str(tmp_path / "absent")],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert r.returncode != 0
    assert not (tmp_path / "absent").exists()


@pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck not installed (make test-services installs it)",
)
def test_install_sh_is_shellcheck_clean() -> None:
    r = subprocess.run(
        ["shellcheck", "--severity=style", str(INSTALL_SH)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "args,source", [([], "wattserve.service"), (["--control"], "wattserve-control.conf")]
)
def test_install_service_print(args, source, capsys) -> None:
    assert main(["install-service", "--print", *args]) == 0
    assert capsys.readouterr().out == (SYSTEMD_DIR / source).read_text()


def test_install_service_without_print_points_to_install_sh(capsys) -> None:
    assert main(["install-service"]) == 2
    assert "install.sh" in capsys.readouterr().err


def _unit_settings(path: Path) -> dict[str, str]:
    """Key -> value of the unit's lines (the last one wins, as in systemd)."""
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def _bytes(value: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if value[-1:].upper() in units:
        return int(float(value[:-1]) * units[value[-1].upper()])
    return int(value)


def test_unit_limits_fit_the_server_limits() -> None:
    from wattserve.daemon.config import ServerConfig

    server = ServerConfig()
    unit = _unit_settings(SYSTEMD_DIR / "wattserve.service")
    # Every allowed connection is a file descriptor; the daemon's own files (model, libraries,
    # MQTT, the listening socket) need room besides.
    soft_nofile = int(unit["LimitNOFILE"].split(":")[0])
    assert soft_nofile >= server.max_connections + 1024, unit["LimitNOFILE"]
    # Memory: a share of RAM that leaves the host room, or a size well above the request
    # buffers the server limits allow (each connection: a head, a body, unsent answer).
    memory_max = unit["MemoryMax"]
    buffers = server.max_connections * (server.max_header_bytes + server.max_body_bytes + 65536)
    if memory_max.endswith("%"):
        assert 50 <= float(memory_max[:-1]) <= 90, memory_max
    else:
        assert _bytes(memory_max) >= 4 * buffers, (memory_max, buffers)


@needs_analyze
def test_fleet_unit_verifies_clean_and_is_tightly_sandboxed(tmp_path) -> None:
    root = analyzable_root(tmp_path, control=False)  # install.sh installs the fleet unit too
    r = analyze("verify", f"--root={root}", "wattserve-fleet.service")
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr
    r = analyze(
        "security", "--offline=yes", f"--root={root}", "--no-pager", "wattserve-fleet.service"
    )
    m = re.search(r"Overall exposure level for wattserve-fleet\.service: (\d+\.\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    # No GPU, no capability: at least as tight as the observe-mode daemon.
    assert float(m.group(1)) <= min(MAX_EXPOSURE, exposure(root))


def test_fleet_example_config_loads_and_its_floors_fit(tmp_path) -> None:
    from wattserve.fleet.service import load_fleet_config

    root = tmp_path / "root"
    root.mkdir()
    r = install(root, "--no-venv")
    assert r.returncode == 0, r.stderr
    cfg = load_fleet_config(root / "etc/wattserve/fleet.toml")  # as installed
    assert sum(n.floor_w for n in cfg.nodes) <= cfg.allocator.site_budget_w
    unit = (SYSTEMD_DIR / "wattserve-fleet.service").read_text()
    assert "wattserve fleet --config %E/wattserve/fleet.toml" in unit
    assert str(cfg.allocator.status_file).startswith("/run/wattserve-fleet/")
