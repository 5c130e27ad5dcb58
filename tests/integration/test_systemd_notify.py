"""The serving daemon speaks sd_notify to a fake NOTIFY_SOCKET, as it would to systemd.

As a real `wattserve serve` subprocess: EXTEND_TIMEOUT_USEC while the model loads,
READY=1 only once /ready answers 200 (after the warm-up), STATUS= and WATCHDOG=1 while it
serves, STOPPING=1 on SIGTERM, then exit 0. In process: freezing the engine loop (a step
hook that blocks, with a request pending) stops WATCHDOG=1 within one ping interval, and
the pings resume when the loop runs again.
These tests run once wattserve/daemon/server.py uses sdnotify; until then they skip.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.fake_notify_socket import Datagram, fake_notify_socket

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0



def _server_uses_sdnotify() -> bool:
    server = REPO / "wattserve" / "daemon" / "server.py"
    return server.exists() and "sdnotify" in server.read_text()


pytestmark = pytest.mark.skipif(
    not _server_uses_sdnotify(),
    reason="wattserve/daemon/server.py does not use sdnotify yet (wiring: docs/systemd.md)",
)


def _keys(datagrams: list[Datagram]) -> list[str]:
    return [k for d in datagrams for k in d.keys]


def test_serve_notifies_loading_ready_status_watchdog_and_stopping(
    tmp_path, tiny_dirs, cache_dir
) -> None:
    config = tmp_path / "wattserve.toml"
    config.write_text(
        f"[server]\nport = 0\ndrain_timeout_s = 5.0\n"
        f"[engine]\nmodel = \"{tiny_dirs['llama']}\"\nkv_cache_bytes = 8388608\n"
        "max_model_len = 256\n[mqtt]\nenabled = false\n"
    )
    with fake_notify_socket("path") as notify:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WATTSERVE_")}
        env.update(
            WATTSERVE_CACHE=str(cache_dir), WATTSERVE_CONFIG=str(config),
            NOTIFY_SOCKET=notify.address, WATCHDOG_USEC="1000000",  # a ping every 0.5 s
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "wattserve.daemon.cli", "serve"], env=env, cwd=REPO,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        log: list[str] = []
        reader = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
        reader.start()
        try:
            ready = notify.wait_for("READY=1", START_TIMEOUT_S)
            url = next(
                m.group(1) for line in list(log) if (m := re.search(r"listening on (\S+)", line))
            )
            # READY=1 comes after the warm-up: the daemon already takes requests.
            assert httpx.get(url + "/ready", timeout=5).status_code == 200
            assert any(a.startswith("STATUS=ready: model ") for a in ready.assignments)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                after = notify.datagrams[notify.datagrams.index(ready) + 1 :]
                if _keys(after).count("WATCHDOG") >= 2 and "STATUS" in _keys(after):
                    break
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            stopping = notify.wait_for("STOPPING=1", 10)
            code = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        reader.join(10)
    text = "".join(log)
    assert code == 0, text[-2000:]
    datagrams = notify.datagrams
    keys = _keys(datagrams)
    i_ready, i_stop = datagrams.index(ready), datagrams.index(stopping)
    # Loading extends the start timeout; nothing else is said before READY=1 but that.
    assert keys[0] == "EXTEND_TIMEOUT_USEC"
    assert set(_keys(datagrams[:i_ready])) == {"EXTEND_TIMEOUT_USEC"}
    assert all(
        int(a.split("=")[1]) >= 10_000_000 for d in datagrams[:i_ready] for a in d.assignments
    )
    between = _keys(datagrams[i_ready + 1 : i_stop])
    assert between.count("WATCHDOG") >= 2 and "STATUS" in between, keys
    assert "EXTEND_TIMEOUT_USEC" not in between and keys.count("READY") == 1
    assert keys.count("STOPPING") == 1 and "READY" not in _keys(datagrams[i_stop:])


def test_frozen_engine_loop_stops_watchdog_pings(tiny_llama) -> None:
    from tests.api_server import api_config, running_server

    period_s = 0.6
    interval_s = period_s / 2
    freeze = threading.Event()
    frozen_at: list[float] = []

    def hook(_stats) -> None:  # engine thread: the test's way to hang the step loop
        if freeze.is_set():
            frozen_at.append(time.monotonic())
            while freeze.is_set():
                time.sleep(0.01)

    with fake_notify_socket("abstract") as notify:
        environ = {"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": str(int(period_s * 1e6))}
        cfg = api_config()
        with running_server(cfg, tiny_llama, environ=environ,
                            before_start=lambda e: e.add_step_hook(hook)) as srv:
            notify.wait_for("READY=1", 10)
            time.sleep(interval_s * 2.5)
            freeze.set()
            body = {"prompt": "abc", "max_tokens": 8, "ignore_eos": True}
            with httpx.Client(base_url=srv.base_url, timeout=30) as client:
                result: list[int] = []
                request = threading.Thread(
                    target=lambda: result.append(
                        client.post("/v1/completions", json=body).status_code
                    )
                )
                request.start()
                deadline = time.monotonic() + 10
                while not frozen_at and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert frozen_at, "the request never reached the engine"
                time.sleep(interval_s * 4)
                resumed_at = time.monotonic()
                freeze.clear()
                request.join(30)
                assert result == [200]
                time.sleep(interval_s * 2.5)
        notify.wait_for("STOPPING=1", 10)
    pings = [d.received_s for d in notify.datagrams if d.keys == ("WATCHDOG",)]
    before = [t for t in pings if t < frozen_at[0]]
    during = [t for t in pings if frozen_at[0] <= t < resumed_at]
    after = [t for t in pings if t >= resumed_at]
    assert len(before) >= 2, pings
    # At most one ping (for progress made before the freeze), within one interval.
    assert len(during) <= 1 and all(t <= frozen_at[0] + interval_s + 0.15 for t in during), (
        frozen_at, resumed_at, pings,
    )
    assert len(after) >= 1, pings


def test_frozen_control_loop_stops_watchdog_pings(tiny_llama) -> None:
    """A hung control thread would leave the knobs wherever they were: systemd must see it."""
    from tests.api_server import api_config, running_server

    period_s = 0.8
    interval_s = period_s / 2
    freeze = threading.Event()
    frozen_at: list[float] = []

    with fake_notify_socket("abstract") as notify:
        environ = {"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": str(int(period_s * 1e6))}
        cfg = api_config(device={"backend": "virtual"}, controller={"period_s": 0.1})
        with running_server(cfg, tiny_llama, environ=environ) as srv:
            loop = srv.daemon.state.control_loop
            assert loop is not None
            tick = loop.tick

            def frozen_tick():  # the control thread hangs here while `freeze` is set
                if freeze.is_set():
                    frozen_at.append(time.monotonic())
                    while freeze.is_set():
                        time.sleep(0.01)
                return tick()

            loop.tick = frozen_tick
            notify.wait_for("READY=1", 10)
            time.sleep(interval_s * 2.5)
            freeze.set()
            time.sleep(interval_s * 4)
            resumed_at = time.monotonic()
            freeze.clear()
            time.sleep(interval_s * 3)
        notify.wait_for("STOPPING=1", 10)
    assert frozen_at, "the control loop never ticked"
    pings = [d.received_s for d in notify.datagrams if d.keys == ("WATCHDOG",)]
    during = [t for t in pings if frozen_at[0] <= t < resumed_at]
    assert len([t for t in pings if t < frozen_at[0]]) >= 2, pings
    assert len(during) <= 1 and all(t <= frozen_at[0] + interval_s + 0.15 for t in during), (
        frozen_at, resumed_at, pings,
    )
    assert [t for t in pings if t >= resumed_at], pings
