"""The serving daemon's MQTT feed against a real Mosquitto broker on a random loopback port.

A real Daemon (uvicorn on loopback, a tiny random Llama, the virtual GPU, the controller
in auto mode) publishes to a private broker (tests/mqtt_broker.py, fixtures in
tests/conftest.py); a plain aiomqtt subscriber checks what arrives against the pydantic
payload models, and HTTP shows what `policy/set` changed. The Last Will and SIGTERM
tests run `python -m wattserve.daemon.cli serve` as a child process. Every wait is on a condition
with a bounded timeout; nothing is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiomqtt
import httpx
import pytest

from tests.api_server import RunningServer, api_config, running_server
from tests.mqtt_broker import (
    REPO,
    Broker,
    Received,
    Recorder,
    expect_will,
    free_port,
    is_status,
    run,
    wait_until,
)
from wattserve.controller.schema import to_model
from wattserve.daemon.config import Config, ConfigError
from wattserve.daemon.mqtt import EventPayload, StatusPayload, TelemetryPayload, Topics
from wattserve.daemon.server import Daemon

TOKEN = "mqtt-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENVIRON = {"WATTSERVE_API_TOKEN": TOKEN}
TEST_TIMEOUT_S = 120.0
START_TIMEOUT_S = 60.0
WAIT_S = 15.0
# policy/set over this anonymous test broker: opted in, credentials explicitly waived.
ANONYMOUS_POLICY = {"accept_policy": True, "accept_policy_unauthenticated": True}
PROMPT = {"prompt": "The power budget", "max_tokens": 8, "temperature": 0.0}


def daemon_config(port: int, node: str, tmp_path: Path, **mqtt: Any) -> Config:
    return api_config(
        device={"backend": "virtual", "mode": "control", "state_dir": str(tmp_path)},
        controller={"mode": "auto", "period_s": 0.1},
        mqtt={
            "enabled": True,
            "host": "127.0.0.1",
            "port": port,
            "node_id": node,
            "telemetry_interval_ms": 200,
            "reconnect_initial_ms": 50,
            "reconnect_max_ms": 300,
            "shutdown_timeout_ms": 5000,
            **mqtt,
        },
    )


def topics(node: str) -> Topics:
    return Topics.for_node("wattserve", node)


@contextlib.asynccontextmanager
async def serving(cfg: Config, loaded: Any, **kw: Any) -> AsyncIterator[RunningServer]:
    """running_server() entered and left on worker threads, so the broker's messages keep
    flowing into the test's subscribers meanwhile."""
    cm = running_server(cfg, loaded, environ=ENVIRON, **kw)
    srv = await asyncio.to_thread(cm.__enter__)
    try:
        yield srv
    finally:
        await asyncio.to_thread(cm.__exit__, None, None, None)


def kind(name: str, **data: Any) -> Callable[[Any], bool]:
    """An event of this kind whose `data` holds these items."""
    return lambda p: p["kind"] == name and all(p["data"].get(k) == v for k, v in data.items())


def events_of(sub: Recorder, t: Topics, name: str) -> list[dict[str, Any]]:
    return [m.json() for m in sub.on(t.events) if m.json()["kind"] == name]


def metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


async def served_telemetry(
    sub: Recorder, t: Topics, client: httpx.AsyncClient, srv: RunningServer
) -> Received:
    """The first telemetry tick that counts finished requests, after serving three.

    Telemetry is QoS 0 and its outbox drops the oldest beyond its bound, so a tick may be
    lost by design; that loss is counted (dropped, or a connection lost mid-publish). Only
    a counted loss earns another round of requests; an uncounted one fails, with the
    link's counters and what the ticks said.
    """
    link = srv.daemon.mqtt
    assert link is not None
    for _ in range(3):
        before = link.stats()
        for _ in range(3):
            r = await client.post("/v1/completions", json=PROMPT)
            assert r.status_code == 200
        try:
            return await sub.wait_for(
                t.telemetry, lambda p: (p["serving"]["requests_finished"] or 0) >= 1
            )
        except AssertionError:
            after = link.stats()
            counted = (after.dropped_telemetry, after.connection_losses) != (
                before.dropped_telemetry,
                before.connection_losses,
            )
            finished = [m.json()["serving"]["requests_finished"] for m in sub.on(t.telemetry)]
            if not counted:
                raise AssertionError(
                    f"no telemetry counted the requests and no loss was counted: {after}; "
                    f"requests_finished per tick: {finished}"
                ) from None
    raise AssertionError(f"telemetry lost three rounds in a row: {link.stats()}")


# ---- the feed ----------------------------------------------------------------------------


def test_online_ready_periodic_telemetry_and_decision_events(broker, tiny_llama, tmp_path):
    node = "daemon-feed"
    t = topics(node)
    cfg = daemon_config(broker.port, node, tmp_path)

    async def body() -> None:
        async with Recorder(broker, f"wattserve/{node}/#") as sub:
            async with serving(cfg, tiny_llama) as srv:
                online = await sub.wait_for(t.status, lambda p: p["phase"] == "ready")
                status = StatusPayload.model_validate_json(online.payload)
                assert online.qos == 1 and status.state == "online"
                assert status.model == srv.daemon.state.served_model_name
                assert status.device is not None and status.device.is_virtual
                assert (status.device.backend, status.device.mode) == ("virtual", "control")
                # Every status while starting was `online` with a starting phase, in order.
                phases = [m.json()["phase"] for m in sub.on(t.status)]
                assert phases == sorted(phases, key=["loading", "warming", "ready"].index)

                policy = await sub.wait_for(t.policy)
                assert policy.json() == {
                    "schema": 1,
                    **to_model(srv.daemon.state.policy).model_dump(),
                }
                # Both are retained: a subscriber arriving now gets them at once.
                async with Recorder(broker, t.status, t.policy) as late:
                    again = await late.wait_for(t.status)
                    assert again.retain and again.payload == online.payload
                    assert (await late.wait_for(t.policy)).retain
                start = await sub.wait_for(t.events, kind("start"))
                assert EventPayload.model_validate_json(start.payload).data["model"] == status.model

                async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
                    # Window figures: a tick after the requests counts them and their latency.
                    served = await served_telemetry(sub, t, client, srv)
                    await sub.count(t.telemetry, 3)
                    # The controller in auto mode decides (its first decision always goes out).
                    decision = await sub.wait_for(t.events, kind("decision"))
                    metrics = (await client.get("/metrics")).text

            ticks = [m for m in sub.on(t.telemetry)]
            assert all(m.qos == 0 and not m.retain for m in ticks)
            payloads = [TelemetryPayload.model_validate_json(m.payload) for m in ticks]
            assert all(p.schema_version == 1 for p in payloads)
            # The first snapshot only opens the MQTT window; each later one covers a period.
            assert all(p.window_s is not None and p.window_s > 0 for p in payloads[1:])
            ready = [p for p in payloads if p.phase == "ready"]
            assert ready and all(p.device.power_w and p.device.power_w > 0 for p in ready)
            engine = srv.engine
            assert ready[0].knobs.max_num_seqs is not None
            assert ready[0].knobs.quant_level == engine.quant_level
            assert ready[0].policy == to_model(srv.daemon.state.policy).model_dump()
            figures = TelemetryPayload.model_validate_json(served.payload)
            assert figures.latency.ttft_p50_ms is not None and figures.latency.ttft_p50_ms > 0
            assert (figures.serving.generation_tokens_per_s or 0) > 0
            event = EventPayload.model_validate_json(decision.payload)
            assert decision.qos == 1 and event.message and event.data

            assert metric(metrics, "wattserve_mqtt_connected") == 1
            published = 'wattserve_mqtt_messages_published_total{kind="telemetry"}'
            assert metric(metrics, published) >= 3

            # Leaving the server drained and stopped it: drain and stop, then `offline`.
            await sub.wait_for(t.status, is_status("offline", "shutdown"))
            order = [(m.topic, m.json().get("kind") or m.json().get("state")) for m in sub.messages]
            assert order.index((t.events, "drain")) < order.index((t.events, "stop"))
            assert order.index((t.events, "stop")) < order.index((t.status, "offline"))

    run(body, TEST_TIMEOUT_S)


# ---- policy/set ----------------------------------------------------------------------------


def test_policy_set_changes_the_policy_seen_over_http(broker, tiny_llama, tmp_path):
    node = "daemon-policy"
    t = topics(node)
    cfg = daemon_config(broker.port, node, tmp_path, **ANONYMOUS_POLICY)
    new = {"power_budget_w": 450.0, "ttft_slo_ms": 900.0, "tpot_slo_ms": 80.0, "mode": "manual"}

    async def body() -> None:
        async with Recorder(broker, f"wattserve/{node}/#") as sub:
            async with serving(cfg, tiny_llama) as srv:
                await sub.wait_for(t.status, lambda p: p["phase"] == "ready")
                await sub.wait_for(t.policy)
                await sub.publish(t.policy_set, json.dumps({"schema": 1, **new}))
                changed = await sub.wait_for(t.events, kind("policy_changed"))
                assert changed.json()["data"] == {"changed_by": "mqtt", "policy": new}
                in_force = await sub.wait_for(t.policy, lambda p: p["power_budget_w"] == 450.0)
                assert in_force.json() == {"schema": 1, **new}

                async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
                    assert (await client.get("/v1/control/policy", headers=AUTH)).json() == new
                    status = (await client.get("/v1/status")).json()
                    assert status["policy"] == new
                    controller = status["controller"]
                    assert controller["mode"] == "manual"
                    assert controller["policy"]["power_budget_w"] == 450.0
                    # A later change over HTTP: its event follows the first one on the same
                    # queue, so once it is here any duplicate of the first would be too.
                    http = {**new, "power_budget_w": 500.0}
                    r = await client.put("/v1/control/policy", json=http, headers=AUTH)
                    assert r.status_code == 200
                    await sub.wait_for(t.events, kind("policy_changed", changed_by="http"))
                    # The retained policy follows an HTTP change too.
                    await sub.wait_for(t.policy, lambda p: p["power_budget_w"] == 500.0)
                    metrics = (await client.get("/metrics")).text

            by = [e["data"]["changed_by"] for e in events_of(sub, t, "policy_changed")]
            assert by == ["mqtt", "http"]
            accepted = 'wattserve_mqtt_policy_set_messages_total{outcome="accepted"}'
            assert metric(metrics, accepted) == 1

    run(body, TEST_TIMEOUT_S)


def test_invalid_policy_set_changes_nothing_and_says_why(broker, tiny_llama, tmp_path):
    node = "daemon-bad-policy"
    t = topics(node)
    cfg = daemon_config(broker.port, node, tmp_path, **ANONYMOUS_POLICY)
    good = {"power_budget_w": 450.0, "ttft_slo_ms": 900.0, "tpot_slo_ms": 80.0, "mode": "auto"}
    bad = [
        (json.dumps({**good, "power_budget_w": -5}), "power_budget_w"),
        (json.dumps({**good, "mode": "turbo"}), "mode"),
        (json.dumps({**good, "max_tokens": 1}), "max_tokens"),  # unknown field
        (json.dumps({k: v for k, v in good.items() if k != "tpot_slo_ms"}), "tpot_slo_ms"),
        ("{not json", "not JSON"),
        (json.dumps({**good, "schema": 2}), "unsupported schema"),
    ]

    async def body() -> None:
        async with Recorder(broker, f"wattserve/{node}/#") as sub:
            async with serving(cfg, tiny_llama) as srv:
                await sub.wait_for(t.status, lambda p: p["phase"] == "ready")
                first = await sub.wait_for(t.policy)
                before = to_model(srv.daemon.state.policy).model_dump()
                for payload, _ in bad:
                    await sub.publish(t.policy_set, payload)
                await wait_until(lambda: len(events_of(sub, t, "policy_rejected")) >= len(bad))
                rejected = events_of(sub, t, "policy_rejected")
                for event, (_, why) in zip(rejected, bad, strict=True):
                    EventPayload.model_validate(event)
                    assert why in event["message"] and "nothing changed" in event["message"]
                assert rejected[0]["data"]["errors"][0]["loc"] == "power_budget_w"

                async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
                    assert (await client.get("/v1/control/policy", headers=AUTH)).json() == before
                    status = (await client.get("/v1/status")).json()
                    assert status["policy"] == before
                    budget_w = status["controller"]["policy"]["power_budget_w"]
                    assert budget_w == before["power_budget_w"]
                    metrics = (await client.get("/metrics")).text
                # The rejections went through the live feed: the dashboard sees them too.
                feed_kinds = [e.kind for e in srv.daemon.feed.recent_events()]
                assert feed_kinds.count("policy_rejected") == len(bad)

            assert len(events_of(sub, t, "policy_rejected")) == len(bad)
            assert not events_of(sub, t, "policy_changed")
            assert [m.payload for m in sub.on(t.policy)] == [first.payload]  # not republished
            outcome = 'wattserve_mqtt_policy_set_messages_total{outcome="rejected"}'
            assert metric(metrics, outcome) == len(bad)

    run(body, TEST_TIMEOUT_S)


def test_a_retained_policy_set_never_overrides_a_later_http_put(broker, tiny_llama, tmp_path):
    node = "daemon-retained-set"
    t = topics(node)
    cfg = daemon_config(broker.port, node, tmp_path, **ANONYMOUS_POLICY)
    fleet = {"power_budget_w": 321.0, "ttft_slo_ms": 700.0, "tpot_slo_ms": 70.0, "mode": "manual"}
    http = {**fleet, "power_budget_w": 555.0, "mode": "auto"}

    async def body() -> None:
        async with Recorder(broker, t.policy, t.events) as sub:
            try:
                async with serving(cfg, tiny_llama) as srv:
                    link = srv.daemon.mqtt
                    assert link is not None and await link.wait_connected(WAIT_S)
                    # Published with retain while the node listens: delivered live, applied.
                    await sub.publish(t.policy_set, json.dumps(fleet), retain=True)
                    await sub.wait_for(t.events, kind("policy_changed", changed_by="mqtt"))
                    async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
                        r = await client.put("/v1/control/policy", json=http, headers=AUTH)
                        assert r.status_code == 200
                        await sub.wait_for(t.policy, lambda p: p["power_budget_w"] == 555.0)
                        # The connection drops (a client takes over the node's client id);
                        # at the reconnect the broker hands the retained policy/set over
                        # again: it is older than the PUT and must not undo it.
                        async with aiomqtt.Client(
                            "127.0.0.1", broker.port, identifier=link.client_id
                        ):
                            pass
                        ignored = await sub.wait_for(
                            t.events, lambda p: p["kind"] == "policy_rejected"
                        )
                        assert "retained policy/set ignored" in ignored.json()["message"]
                        assert link.stats().connects >= 2
                        assert (await client.get("/v1/control/policy", headers=AUTH)).json() == http
                        status = (await client.get("/v1/status")).json()
                    assert status["policy"] == http
                    assert status["controller"]["policy"]["power_budget_w"] == 555.0
                    assert status["server"]["mqtt_remote_policy"] == "unauthenticated"
            finally:
                await sub.publish(t.policy_set, b"", retain=True)  # clear it on the broker
            changes = events_of(sub, t, "policy_changed")
            assert [e["data"]["changed_by"] for e in changes] == ["mqtt", "http"]

    run(body, TEST_TIMEOUT_S)


def test_policy_set_is_not_taken_by_default(broker, tiny_llama, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="wattserve.mqtt")
    node = "daemon-policy-off"
    t = topics(node)
    cfg = daemon_config(broker.port, node, tmp_path)  # no accept_policy
    before = {"power_budget_w": 700.0, "ttft_slo_ms": 2000.0, "tpot_slo_ms": 200.0}
    before |= {"mode": "auto"}

    async def body() -> None:
        async with Recorder(broker, f"wattserve/{node}/#") as sub:
            async with serving(cfg, tiny_llama) as srv:
                link = srv.daemon.mqtt
                assert link is not None and not link.accepts_policy
                await sub.wait_for(t.status, lambda p: p["phase"] == "ready")
                await sub.publish(t.policy_set, json.dumps({**before, "power_budget_w": 100.0}))
                # Absence has no event to wait for; two telemetry ticks bound the wait (a
                # subscribed node applies a message within one loop turn of receiving it).
                await sub.count(t.telemetry, len(sub.on(t.telemetry)) + 2)
                async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
                    status = (await client.get("/v1/status")).json()
                assert status["policy"] == before
                assert status["server"]["mqtt_remote_policy"] == "off"
                s = link.stats()
                assert (s.policy_set_accepted, s.policy_set_rejected) == (0, 0)
            assert not events_of(sub, t, "policy_changed")
            assert not events_of(sub, t, "policy_rejected")

    run(body, TEST_TIMEOUT_S)
    said = [r.getMessage() for r in caplog.records]
    assert any("remote policy off" in m for m in said), said


# ---- reliability -----------------------------------------------------------------------------


def test_broker_killed_serving_goes_on_then_reconnects_and_republishes(
    own_broker, tiny_llama, tmp_path
):
    broker = own_broker
    node = "daemon-restart"
    t = topics(node)
    cfg = daemon_config(broker.port, node, tmp_path, **ANONYMOUS_POLICY)

    async def body() -> None:
        broker.start()
        async with serving(cfg, tiny_llama) as srv:
            link = srv.daemon.mqtt
            assert link is not None
            async with Recorder(broker, t.status) as sub:
                await sub.wait_for(t.status, lambda p: p["phase"] == "ready")
            published = link.stats().published
            broker.kill()
            await wait_until(lambda: not link.connected)
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
                for _ in range(3):
                    r = await client.post("/v1/completions", json=PROMPT)
                    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
                # A change while the broker is away: retained policy and event wait for it.
                down = {"power_budget_w": 600.0, "ttft_slo_ms": 1000.0, "tpot_slo_ms": 90.0}
                down |= {"mode": "observe"}
                r = await client.put("/v1/control/policy", json=down, headers=AUTH)
                assert r.status_code == 200
                assert (await client.get("/ready")).status_code == 200

                broker.start()  # same port, a fresh broker: nothing retained survived
                # Reconnected and republished: a new subscriber then gets them as retained.
                await wait_until(
                    lambda: all(
                        link.stats().published[k] > published[k] for k in ("status", "policy")
                    )
                )
                async with Recorder(broker, f"wattserve/{node}/#") as sub:
                    status = await sub.wait_for(t.status, is_status("online"))
                    assert status.retain and status.json()["phase"] == "ready"
                    policy = await sub.wait_for(t.policy)
                    assert policy.retain and policy.json() == {"schema": 1, **down}
                    # Resubscribed: policy/set works again.
                    await sub.publish(t.policy_set, json.dumps({**down, "power_budget_w": 610}))
                    await sub.wait_for(t.policy, lambda p: p["power_budget_w"] == 610)
                    got = (await client.get("/v1/control/policy", headers=AUTH)).json()
                    assert got["power_budget_w"] == 610
                metrics = (await client.get("/metrics")).text
        assert metric(metrics, "wattserve_mqtt_connection_losses_total") == 1
        assert metric(metrics, "wattserve_mqtt_connects_total") == 2

    run(body, TEST_TIMEOUT_S)


def test_no_broker_one_log_line_and_serving_goes_on(tiny_llama, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="wattserve.mqtt")
    cfg = daemon_config(free_port(), "daemon-alone", tmp_path, reconnect_max_ms=100)

    async def body() -> None:
        async with serving(cfg, tiny_llama) as srv:
            link = srv.daemon.mqtt
            assert link is not None
            await wait_until(lambda: link.stats().connect_failures >= 4)
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
                assert (await client.post("/v1/completions", json=PROMPT)).status_code == 200
            assert link.stats().connects == 0

    run(body, TEST_TIMEOUT_S)
    mqtt_warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("wattserve.mqtt") and r.levelno >= logging.WARNING
    ]
    assert len(mqtt_warnings) == 1 and "cannot connect" in mqtt_warnings[0], mqtt_warnings


def test_unreadable_password_file_stops_the_start(tmp_path):
    cfg = api_config(
        mqtt={"enabled": True, "username": "wattserve", "password_file": str(tmp_path / "none")}
    )
    with pytest.raises(ConfigError, match=r"mqtt\.password_file: cannot read"):
        Daemon(cfg, environ={})


# ---- the process dies / stops ------------------------------------------------------------


class ServeProcess:
    """`python -m wattserve.daemon.cli serve` with a TOML config: the tiny model, virtual
    GPU, MQTT."""

    def __init__(
        self, tmp_path: Path, model_dir: Path, cache_dir: Path, broker: Broker, node: str
    ) -> None:
        config = tmp_path / "wattserve.toml"
        config.write_text(
            "[server]\nport = 0\ndrain_timeout_s = 5.0\n"
            f'[engine]\nmodel = "{model_dir}"\nkv_cache_bytes = 8388608\nmax_model_len = 256\n'
            f'[device]\nbackend = "virtual"\nstate_dir = "{tmp_path}"\n'
            f'[mqtt]\nport = {broker.port}\nnode_id = "{node}"\ntelemetry_interval_ms = 200\n'
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("WATTSERVE_")}
        env.update(WATTSERVE_CACHE=str(cache_dir), WATTSERVE_CONFIG=str(config))
        self.log = tmp_path / "serve.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "wattserve.daemon.cli", "serve"],
                env=env,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    async def wait_ready(self, sub: Recorder, t: Topics) -> Received:
        """The retained `online` with phase ready; fails early if the process exits."""
        task = asyncio.create_task(
            sub.wait_for(t.status, lambda p: p["phase"] == "ready", START_TIMEOUT_S)
        )
        while not task.done():
            if self.proc.poll() is not None:
                task.cancel()
                raise AssertionError(f"serve exited {self.proc.returncode}: {self.tail()}")
            await asyncio.sleep(0.05)
        return task.result()

    async def wait(self, timeout_s: float = 30.0) -> int:
        return await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def serve_process(tmp_path, tiny_dirs, cache_dir):
    started: list[ServeProcess] = []

    def start(broker: Broker, node: str) -> ServeProcess:
        p = ServeProcess(tmp_path, tiny_dirs["llama"], cache_dir, broker, node)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


def test_sigkill_of_the_daemon_makes_the_will_report_offline(broker, serve_process):
    node = "daemon-killed"
    t = topics(node)

    async def body() -> None:
        async with Recorder(broker, t.status) as sub:
            proc = serve_process(broker, node)
            await proc.wait_ready(sub, t)
            proc.proc.kill()
            assert await proc.wait() == -signal.SIGKILL
            await expect_will(broker, sub, t.status, node)

    run(body, TEST_TIMEOUT_S)


def test_sigterm_publishes_offline_before_exit(broker, serve_process):
    node = "daemon-stopped"
    t = topics(node)
    marker = f"test/{node}/marker"

    async def body() -> None:
        async with Recorder(broker, t.status, t.events, marker) as sub:
            proc = serve_process(broker, node)
            await proc.wait_ready(sub, t)
            await sub.wait_for(t.events, kind("start"))
            proc.proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0, proc.tail()
            offline = await sub.wait_for(t.status, is_status("offline", "shutdown"))
            assert StatusPayload.model_validate_json(offline.payload).phase is None
            states = [m.json()["state"] for m in sub.on(t.status)]
            kinds = [m.json().get("kind") or m.json().get("state") for m in sub.messages]
            # Drain and stop went out before `offline`; `online` said draining meanwhile.
            assert kinds.index("drain") < kinds.index("stop") < kinds.index("offline")
            assert [m.json()["phase"] for m in sub.on(t.status)][-2] == "draining"
            # A round trip through the broker after the exit: no Will followed "shutdown".
            await sub.publish(marker, b"{}")
            await sub.wait_for(marker)
            assert states.count("offline") == 1
            assert [m.json()["state"] for m in sub.on(t.status)][-1] == "offline"
        assert "mqtt: published offline and disconnected" in proc.tail()

    run(body, TEST_TIMEOUT_S)
