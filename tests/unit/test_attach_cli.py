"""`wattserve attach` as a process: start against the fake server, front and status, SIGTERM
restores the GPU; bad arguments are one line and exit 1."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.mqtt_broker import Recorder, run
from wattserve.attach.names import SGLANG
from wattserve.bench.attach_fake import FakeServer, free_port, serve_in_thread
from wattserve.daemon.mqtt.payloads import TelemetryPayload, Topics

DATA = Path(__file__).resolve().parent.parent / "data" / "attach"
REPO = Path(__file__).resolve().parents[2]


def _attach(*args: str, state_dir: Path, **env_extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WATTSERVE_")}
    env["STATE_DIRECTORY"] = str(state_dir)
    env["WATTSERVE_MQTT__ENABLED"] = "false"
    env.update(env_extra)
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "wattserve.daemon.cli", "--log-level", "warning", "attach"]
    return subprocess.Popen(
        [*argv, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_attach_serves_its_front_and_restores_the_gpu_at_sigterm(tmp_path) -> None:
    fake = FakeServer((DATA / "sglang-00ae9c1.metrics").read_text(), SGLANG)
    port = free_port()
    with serve_in_thread(fake.app) as url:
        proc = _attach(
            url,
            "--front-port",
            str(port),
            "--period-s",
            "0.2",
            "--device-backend",
            "virtual",
            "--device-mode",
            "control",
            "--controller-mode",
            "auto",
            state_dir=tmp_path,
        )
        try:
            front = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            status = None
            while time.monotonic() < deadline:
                try:
                    status = httpx.get(f"{front}/v1/status", timeout=2).json()
                    if status["controller"]["counters"]["decisions"]:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            assert status is not None, proc.stderr.read() if proc.poll() is not None else ""
            assert status["attached"]["server_kind"] == "sglang"  # told from the metrics
            assert status["attached"]["health"] == "ok"
            r = httpx.post(f"{front}/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert r.status_code == 200 and fake.state.finished == 1
            # The controller has set the virtual GPU: its state file records the originals.
            deadline = time.monotonic() + 30
            while not list(tmp_path.glob("*.json")) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert list(tmp_path.glob("*.json"))
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not list(tmp_path.glob("*.json"))  # restored and removed at exit


def test_attach_serves_the_dashboard_and_its_stream_ends_at_sigterm(tmp_path) -> None:
    fake = FakeServer((DATA / "sglang-00ae9c1.metrics").read_text(), SGLANG)
    port = free_port()
    with serve_in_thread(fake.app) as url:
        proc = _attach(
            url, "--front-port", str(port), "--period-s", "0.2", "--device-backend", "virtual",
            state_dir=tmp_path,
        )  # fmt: skip
        front = f"http://127.0.0.1:{port}"
        events: list[str] = []
        try:
            deadline = time.monotonic() + 60
            page = None
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    page = httpx.get(f"{front}/", timeout=2)
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            assert page is not None, proc.stderr.read() if proc.poll() is not None else ""
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            assert httpx.get(f"{front}/dashboard/app.js", timeout=2).status_code == 200
            status = httpx.get(f"{front}/v1/status", timeout=2).json()
            assert status["model"] == f"sglang at {url}"
            assert status["device"]["capabilities"]["is_virtual"] is True
            assert status["server"]["control_enabled"] is False  # policy comes over MQTT
            httpx.post(f"{front}/v1/completions", json={"prompt": "x", "max_tokens": 3})
            signalled_s = None
            with httpx.stream("GET", f"{front}/v1/events/stream", timeout=30) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        events.append(line[7:])
                        if events.count("telemetry") == 2:
                            # The stream is open: SIGTERM must still end it (uvicorn
                            # waits for every connection before it exits).
                            proc.send_signal(signal.SIGTERM)
                            signalled_s = time.monotonic()
                    if signalled_s is not None and time.monotonic() - signalled_s > 20:
                        break  # still streaming after the signal: the assert below fails
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert events[0] == "backlog" and events[-1] == "end"


def test_a_server_that_never_answers_is_one_line_and_exit_1(tmp_path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = _attach(url, "--wait-s", "0", "--device-backend", "virtual", state_dir=tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("wattserve attach: error:")
    assert url in lines[0]


def test_attach_publishes_telemetry_over_mqtt_and_is_one_fleet_node(tmp_path, broker) -> None:
    fake = FakeServer((DATA / "sglang-00ae9c1.metrics").read_text(), SGLANG)
    node = "attach-node"
    topics = Topics.for_node("wattserve", node)
    key_file = tmp_path / "fleet.key"
    key_file.write_text("0123456789abcdef0123456789abcdef\n")
    key_file.chmod(0o600)

    async def body(url: str) -> None:
        async with Recorder(broker, topics.telemetry, topics.status) as rec:
            proc = _attach(
                url,
                "--period-s",
                "0.2",
                "--device-backend",
                "virtual",
                state_dir=tmp_path,
                WATTSERVE_MQTT__ENABLED="true",
                WATTSERVE_MQTT__PORT=str(broker.port),
                WATTSERVE_MQTT__NODE_ID=node,
                WATTSERVE_MQTT__TELEMETRY_INTERVAL_MS="200",
                WATTSERVE_FLEET__ENABLED="true",
                WATTSERVE_FLEET__SAFE_FLOOR_W="123",
                # A fleet node signs with its own key and needs control and auto modes; the
                # lab waiver stands in for broker credentials and TLS on loopback.
                WATTSERVE_FLEET__KEY_FILE=str(key_file),
                WATTSERVE_FLEET__INSECURE_LAB_WAIVER="true",
                WATTSERVE_DEVICE__MODE="control",
                WATTSERVE_CONTROLLER__MODE="auto",
            )
            try:
                # A process start under load: imports take a while.
                online = await rec.wait_for(
                    topics.status, lambda m: m["state"] == "online", timeout_s=60
                )
                assert online.json()["model"].startswith("sglang at ")
                await asyncio.to_thread(
                    httpx.post, f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 9}
                )
                msg = await rec.wait_for(
                    topics.telemetry,
                    lambda m: (m["serving"]["generation_tokens_per_s"] or 0) > 0,
                    timeout_s=30,
                )
                payload = TelemetryPayload.model_validate(msg.json())
                assert payload.device.power_w is not None
                assert payload.phase == "ready"
                # No grant yet: the fleet link holds the node at its safe floor.
                assert payload.policy["power_budget_w"] == 123
            finally:
                proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(proc.communicate, timeout=30)
            assert proc.returncode == 0
            await rec.wait_for(topics.status, lambda m: m["state"] == "offline")

    with serve_in_thread(fake.app) as url:
        run(lambda: body(url), timeout_s=150)
