"""The live dashboard on a real daemon: a tiny random model on the virtual GPU.

Plain HTTP first: the page and its static files, the event stream (a backlog, then live
telemetry; it ends when the daemon stops, without holding up the shutdown), and the
dashboard switched off by config. Then the page itself in headless Chromium (Debian's
`chromium`, installed by `make test-services`, driven by Playwright): it loads with no
console errors, the power chart gains points, a budget set through the form with the
right token moves the budget line, a wrong token shows the API's 401 message, and a
decision mark shows its reason on hover. The screenshot goes to the test's tmp dir, and
to docs/dashboard.png when UPDATE_DASHBOARD_SCREENSHOT=1 (so a test run leaves the
committed picture alone).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.api_server import RunningServer, api_config, running_server
from wattserve.daemon.api.app import create_app
from wattserve.daemon.api.dashboard import EnergyCounter, load_assets
from wattserve.daemon.api.state import ServingState
from wattserve.daemon.config import Config, ControllerConfig, DeviceConfig, MqttConfig, load_config
from wattserve.daemon.mqtt.payloads import DeviceFigures, ServingFigures, TelemetryPayload
from wattserve.daemon.mqtt.window import TelemetryWindow

TOKEN = "dashboard-test-token"
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
STREAM_TIMEOUT_S = 20.0
# Regenerating docs/dashboard.png: minutes of load around the budget step, so the picture
# shows more than a daemon that has just started.
UPDATE_SCREENSHOT = os.environ.get("UPDATE_DASHBOARD_SCREENSHOT") == "1"
LOAD_BEFORE_STEP_S, LOAD_AFTER_STEP_S = (100.0, 60.0) if UPDATE_SCREENSHOT else (0.0, 8.0)


def dashboard_config(state_dir: Path, **server: object) -> Config:
    """The test daemon: virtual GPU under control, the controller in auto, no MQTT."""
    cfg = api_config(server=dict(server))
    return cfg.model_copy(
        update={
            "device": DeviceConfig(backend="virtual", mode="control", state_dir=state_dir),
            "controller": ControllerConfig(mode="auto"),
            "mqtt": MqttConfig(enabled=False),
        }
    )


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory) -> Iterator[RunningServer]:
    cfg = dashboard_config(tmp_path_factory.mktemp("device-state"))
    with running_server(cfg, tiny_llama, environ={"WATTSERVE_API_TOKEN": TOKEN}) as srv:
        yield srv


@pytest.fixture()
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c


def read_sse(response: httpx.Response, deadline_s: float) -> Iterator[tuple[str, str]]:
    """(event name, data) pairs of an SSE response as they arrive; comments are skipped."""
    name, lines = "message", []
    for line in response.iter_lines():
        assert time.monotonic() < deadline_s, "stream took too long"
        if line == "":
            if lines:
                yield name, "\n".join(lines)
            name, lines = "message", []
        elif line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            lines.append(line[len("data: ") :])


@contextmanager
def load(base_url: str, workers: int = 2, max_requests: int = 5000) -> Iterator[None]:
    """Completions from background threads until the block ends (at most max_requests each)."""
    stop = threading.Event()

    def work() -> None:
        with httpx.Client(base_url=base_url, timeout=30) as c:
            for i in range(max_requests):
                if stop.is_set():
                    return
                c.post(
                    "/v1/completions",
                    json={"prompt": f"request {i}", "max_tokens": 16, "ignore_eos": True},
                )
                stop.wait(0.05)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(30)


# ---- plain HTTP ---------------------------------------------------------------------------


def test_page_and_static_files(client) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    for src in ("/dashboard/app.js", "/dashboard/vendor/uPlot.iife.min.js"):
        assert f'src="{src}"' in page.text
    for path, media in (
        ("/dashboard/app.js", "text/javascript"),
        ("/dashboard/style.css", "text/css"),
        ("/dashboard/vendor/uPlot.iife.min.js", "text/javascript"),
        ("/dashboard/vendor/uPlot.min.css", "text/css"),
    ):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(media), path
        assert len(r.content) > 500
        again = client.get(path, headers={"If-None-Match": r.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
    # Only the packaged files: no path tricks, no Python source, no licence file.
    for path in ("/dashboard/__init__.py", "/dashboard/../config.py", "/dashboard/nope.js"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # The page, its files and its stream are no API operations.
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and "/v1/events/stream" not in paths


def test_stream_sends_backlog_then_live_telemetry(server) -> None:
    time.sleep(2.5)  # a few snapshots and some device energy behind us
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    with httpx.Client(base_url=server.base_url, timeout=STREAM_TIMEOUT_S) as c:
        with c.stream("GET", "/v1/events/stream") as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["cache-control"] == "no-cache"
            received = []
            for name, data in read_sse(r, deadline):
                received.append((name, json.loads(data)))
                if sum(1 for n, _ in received if n == "telemetry") >= 2:
                    break
    name, backlog = received[0]
    assert name == "backlog"
    assert len(backlog["telemetry"]) >= 2
    assert any(e["kind"] == "start" for e in backlog["events"])
    assert backlog["energy_since_start_j"] > 0  # the virtual GPU draws power at idle
    last = backlog["telemetry"][-1]
    TelemetryPayload.model_validate(last)
    assert last["policy"]["power_budget_w"] == 700.0
    live = [d for n, d in received if n == "telemetry"]
    assert live[0]["time_unix_s"] > last["time_unix_s"]
    assert live[1]["time_unix_s"] > live[0]["time_unix_s"]
    assert live[-1]["device"]["power_w"] > 0 and live[-1]["knobs"]["max_num_seqs"] >= 1


def test_stream_ends_when_the_daemon_stops(tiny_llama, tmp_path) -> None:
    cfg = dashboard_config(tmp_path)
    received: list[str] = []
    with running_server(cfg, tiny_llama) as srv:
        opened = threading.Event()

        def reader() -> None:
            deadline = time.monotonic() + STREAM_TIMEOUT_S
            with httpx.Client(base_url=srv.base_url, timeout=STREAM_TIMEOUT_S) as c:
                with c.stream("GET", "/v1/events/stream") as r:
                    for name, _ in read_sse(r, deadline):
                        received.append(name)
                        opened.set()

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        assert opened.wait(10), "no backlog"
        started = time.monotonic()
        srv.daemon.request_shutdown()
        assert srv.daemon.stopped.wait(15), "daemon did not stop"
        stop_s = time.monotonic() - started
        thread.join(5)
        assert not thread.is_alive(), "stream still open after the daemon stopped"
    assert received[0] == "backlog" and received[-1] == "end"
    # Well inside uvicorn's 5 s graceful-shutdown limit: the open stream did not hold it up.
    assert stop_s < 3.0, f"stop took {stop_s:.1f} s"


def test_disabled_by_config(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("WATTSERVE_"):
            monkeypatch.delenv(name)
    assert load_config(None).server.dashboard_enabled is True
    monkeypatch.setenv("WATTSERVE_SERVER__DASHBOARD_ENABLED", "false")
    cfg = load_config(None)
    assert cfg.server.dashboard_enabled is False
    app = create_app(ServingState(cfg, api_token=None))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        for path in ("/", "/dashboard/app.js", "/v1/events/stream"):
            r = c.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert c.get("/v1/status").status_code == 200


def test_packaged_files_and_energy_counter() -> None:
    assets = load_assets()
    assert {"index.html", "app.js", "style.css", "vendor/uPlot.iife.min.js"} <= set(assets)
    assert not any(p.endswith((".py", "LICENSE")) for p in assets)
    # The device counter reads None, 100, 150, 20 (restarted), 50 J; the live feed's
    # windows close over it as it does for every consumer.
    window, counter = TelemetryWindow(), EnergyCounter()
    for t, energy_j in enumerate((None, 100.0, 150.0, 20.0, 50.0)):
        figures = window.close(
            now_s=float(t), generation_tokens=0, prompt_tokens=0, energy_j=energy_j
        )
        counter.on_telemetry(
            TelemetryPayload(
                device=DeviceFigures(energy_j=energy_j),
                serving=ServingFigures(energy_window_j=figures.energy_window_j),
            )
        )
        if t == 1:
            assert counter.total_j == 0.0
    assert counter.total_j == 80.0


# ---- the browser ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: `make test-services` installs Debian's chromium")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu"],
        )
        try:
            yield b
        finally:
            b.close()


def test_dashboard_in_headless_chromium(server, browser, tmp_path) -> None:
    page = browser.new_page(viewport={"width": 1440, "height": 1220})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    # Predicates are functions: an expression string would need eval, which the page's CSP
    # (rightly) forbids.
    points = "window.wattserve.charts.power.data[0].length"
    try:
        with load(server.base_url):
            page.goto(f"{server.base_url}/")
            page.wait_for_function(f"() => window.wattserve && {points} > 0", timeout=15_000)
            assert page.inner_text("#h-model") == server.engine.model_name
            page.wait_for_function(
                "() => document.getElementById('h-device').textContent.includes('controlling')",
                timeout=15_000,
            )
            assert page.inner_text("#h-device").startswith("virtual · ")
            assert page.is_hidden("#h-fleet-fact")  # no fleet on this daemon
            time.sleep(LOAD_BEFORE_STEP_S)
            before = page.evaluate(f"() => {points}")
            page.wait_for_function(f"() => {points} >= {before + 3}", timeout=15_000)

            # A new budget through the form moves the drawn budget line (series 2).
            page.fill("#f-budget", "450")
            page.fill("#f-token", TOKEN)
            page.click("#f-apply")
            page.wait_for_function(
                "() => document.getElementById('f-result').textContent.startsWith('Applied')",
                timeout=10_000,
            )
            assert page.input_value("#f-token") == ""  # held in memory, not in the field
            page.wait_for_function(
                "() => { const b = window.wattserve.charts.power.data[2];"
                " return b.length > 0 && b[b.length - 1] === 450; }",
                timeout=10_000,
            )
            assert "budget 450 W" in page.inner_text("#h-policy")
            assert server.daemon.state.policy.power_budget_w == 450
            # Let the load draw latency points and the controller answer the new budget.
            page.wait_for_function(
                "() => window.wattserve.charts.ttft.data[2].some((v) => v !== null)",
                timeout=20_000,
            )
            time.sleep(LOAD_AFTER_STEP_S)
            assert errors == [], errors

            # Hovering a mark on the knobs chart shows the message of the event it marks
            # (the most isolated mark, so that a neighbour cannot be the nearer one; every
            # kind the chart marks counts: a quantization trial's decision and its switch
            # land on the same instant, and either may answer the hover). The
            # chart scrolls in real time: on a loaded machine the mark can move away between
            # finding it and hovering it, so the hover is tried again from a fresh position.
            from playwright.sync_api import TimeoutError as PlaywrightTimeout

            tip = page.locator("#marker-tip")
            for attempt in range(4):
                page.mouse.move(5, 5)  # leave the plot: the next move enters it afresh
                mark = page.evaluate(
                    """() => {
                      const u = window.wattserve.charts.knobs;
                      const xs = window.wattserve.data.events
                        .filter((e) => window.wattserve.markKinds.includes(e.kind) &&
                                       e.time_unix_s >= u.scales.x.min)
                        .map((e) => ({x: u.valToPos(e.time_unix_s, "x"), message: e.message}));
                      const gap = (m) => Math.min(...xs.filter((o) => o !== m)
                                                       .map((o) => Math.abs(o.x - m.x)), 1e9);
                      const best = xs.reduce((a, b) => (gap(b) >= gap(a) ? b : a));
                      const r = u.over.getBoundingClientRect();
                      return {x: r.left + best.x, y: r.top + r.height / 2,
                              near: xs.filter((o) => Math.abs(o.x - best.x) <= 8)
                                      .map((o) => o.message)};
                    }"""
                )
                page.mouse.move(mark["x"], mark["y"])
                try:
                    tip.wait_for(state="visible", timeout=2_000)
                    break
                except PlaywrightTimeout:
                    if attempt == 3:
                        raise
            shown = tip.inner_text()
            assert any(message in shown for message in mark["near"]), (shown, mark)
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            if UPDATE_SCREENSHOT:
                page.screenshot(path=str(SCREENSHOT), full_page=True)

            # A wrong token: the API's 401 message, as returned; the policy stays.
            page.mouse.move(5, 5)
            page.fill("#f-token", "not-the-token")
            page.fill("#f-budget", "300")
            page.click("#f-apply")
            page.wait_for_function(
                "() => document.getElementById('f-result').textContent.startsWith('401')",
                timeout=10_000,
            )
            assert page.inner_text("#f-result") == "401: invalid bearer token (invalid_token)"
            assert server.daemon.state.policy.power_budget_w == 450
            # Chrome logs every 4xx fetch as a console error; that is the only one allowed.
            assert all("status of 401" in e for e in errors) and len(errors) == 1, errors
    finally:
        page.close()


# ---- the fleet grant -----------------------------------------------------------------------

FLEET_NODE = "dash-fleet"
FLEET_FLOOR_W = 250.0


def publish_grant(port: int, payload: bytes) -> None:
    """One retained grant for FLEET_NODE (empty: clear the retained one), as the allocator
    publishes it."""
    import asyncio

    import aiomqtt

    async def send() -> None:
        async with aiomqtt.Client("127.0.0.1", port) as c:
            await c.publish(f"wattserve/{FLEET_NODE}/grant", payload, qos=1, retain=True)

    # On a thread of its own: Playwright's sync API runs an event loop on this one.
    worker = threading.Thread(target=lambda: asyncio.run(send()))
    worker.start()
    worker.join(30)
    assert not worker.is_alive()


def test_dashboard_shows_the_fleet_grant_and_lease(broker, tiny_llama, browser, tmp_path):
    from tests.fleet_keys import signed_grant, write_key
    from wattserve.daemon.config import FleetConfig
    from wattserve.daemon.mqtt.payloads import GrantPayload

    cfg = dashboard_config(tmp_path / "device-state").model_copy(
        update={
            "mqtt": MqttConfig(
                enabled=True,
                host="127.0.0.1",
                port=broker.port,
                node_id=FLEET_NODE,
                reconnect_initial_ms=50,
                reconnect_max_ms=300,
            ),
            "fleet": FleetConfig(
                enabled=True,
                safe_floor_w=FLEET_FLOOR_W,
                demand_interval_ms=200,
                key_file=write_key(tmp_path / "keys", FLEET_NODE),
                insecure_lab_waiver=True,
            ),
        }
    )

    def grant(epoch: int, budget_w: float, lease_s: float) -> GrantPayload:
        now_s = time.time()
        return signed_grant(
            FLEET_NODE,
            budget_w=budget_w,
            epoch=epoch,
            expires_at_unix_s=now_s + lease_s,
            issued_at_unix_s=now_s,
        )

    def fleet_text_starts(prefix: str) -> str:
        return (
            "() => { const f = document.getElementById('h-fleet-fact');"
            f" return !f.hidden && document.getElementById('h-fleet').textContent"
            f".startsWith({json.dumps(prefix)}); }}"
        )

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    try:
        with running_server(cfg, tiny_llama, environ={"WATTSERVE_API_TOKEN": TOKEN}) as srv:
            page.goto(f"{srv.base_url}/")
            # No grant yet: the safe floor, and why.
            page.wait_for_function(
                fleet_text_starts("safe floor 250 W (no grant yet)"), timeout=15_000
            )
            # A live grant: its budget, epoch and lease appear (status is polled).
            epoch = int(time.time() * 1000)
            live = grant(epoch, 430.0, lease_s=120.0)
            publish_grant(broker.port, live.to_json_bytes())
            page.wait_for_function(
                fleet_text_starts(f"430 W · epoch {epoch} · lease "), timeout=15_000
            )
            shown = page.inner_text("#h-fleet")
            assert "s left (expires " in shown, shown
            status = httpx.get(f"{srv.base_url}/v1/status").json()["server"]["fleet"]
            assert status["source"] == "grant" and status["epoch"] == epoch
            assert status["expires_at_unix_s"] == live.expires_at_unix_s
            assert 0 < status["lease_left_s"] <= 120.0
            assert "budget 430 W" in page.inner_text("#h-policy")
            # A newer grant with a lease of two seconds and no renewal: once it runs out the
            # node is back at its safe floor, and the page says so.
            publish_grant(broker.port, grant(epoch + 1, 420.0, lease_s=2.0).to_json_bytes())
            page.wait_for_function(
                fleet_text_starts("safe floor 250 W (lease expired)"), timeout=20_000
            )
            status = httpx.get(f"{srv.base_url}/v1/status").json()["server"]["fleet"]
            assert status["source"] == "safe_floor_lease_expired" and status["epoch"] is None
            assert status["budget_w"] == FLEET_FLOOR_W
            assert errors == [], errors
    finally:
        page.close()
        publish_grant(broker.port, b"")
