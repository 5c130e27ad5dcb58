"""The MQTT link against a real Mosquitto broker on a random loopback port.

Each broker is a private `mosquitto` process with a generated config (tests/mqtt_broker.py:
anonymous; password file plus the ACL shipped in systemd/; TLS with client certificates).
Subscribers are plain aiomqtt clients. Waits are on conditions with bounded timeouts;
nothing sleeps to assert. The Last Will and SIGTERM tests run the link in a child process.
The daemon's wiring of the link is tested in test_mqtt_daemon.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import aiomqtt
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.mqtt_broker import (
    REPO,
    USERS,
    WAIT_S,
    Broker,
    Recorder,
    TlsFiles,
    expect_will,
    is_status,
    run,
    wait_until,
)
from wattserve.daemon.config import MqttConfig
from wattserve.daemon.mqtt import (
    DeviceFigures,
    DeviceSummary,
    EventPayload,
    MqttLink,
    ServingFigures,
    StatusPayload,
    TelemetryPayload,
)
from wattserve.daemon.mqtt.payloads import HA_SENSORS

# Brokers come from the fixtures in tests/conftest.py (broker, own_broker, auth_broker).


class _Policy(BaseModel):
    """Stands in for the daemon's policy model (same fields as the HTTP control body)."""

    model_config = ConfigDict(extra="forbid")
    power_budget_w: float = Field(gt=0, le=100_000)
    ttft_slo_ms: float = Field(gt=0)
    tpot_slo_ms: float = Field(gt=0)
    mode: Literal["auto", "manual", "observe"]


class PolicyStore:
    """The daemon side of policy/set: validate, apply, report the change (to `report`, as
    the daemon's live feed does), return the policy in force."""

    def __init__(self) -> None:
        self.policy = _Policy(power_budget_w=700, ttft_slo_ms=2000, tpot_slo_ms=200, mode="observe")
        self.applied: list[_Policy] = []
        self.report: Callable[[EventPayload], None] = lambda _event: None

    def __call__(self, fields: dict[str, Any]) -> _Policy:
        policy = _Policy.model_validate(fields)
        self.policy = policy
        self.applied.append(policy)
        self.report(
            EventPayload(
                kind="policy_changed",
                message="policy changed by mqtt",
                data={"changed_by": "mqtt", "policy": policy.model_dump()},
            )
        )
        return policy


# policy/set over this anonymous test broker: opted in, credentials explicitly waived.
ANONYMOUS_POLICY = {"accept_policy": True, "accept_policy_unauthenticated": True}


def config(broker: Broker, node_id: str, **kw: Any) -> MqttConfig:
    base: dict[str, Any] = {
        "port": broker.port,
        "node_id": node_id,
        "telemetry_interval_ms": 100,
        "reconnect_initial_ms": 50,
        "reconnect_max_ms": 300,
        "shutdown_timeout_ms": 5000,
    }
    return MqttConfig(**{**base, **kw})


def telemetry_counter() -> Callable[[], TelemetryPayload]:
    ticks = iter(range(1_000_000))

    def source() -> TelemetryPayload:
        n = next(ticks)
        return TelemetryPayload(
            window_s=0.1,
            phase="ready",
            device=DeviceFigures(power_w=300.0 + n, energy_j=1000.0 * n, gpu_temp_c=55.0),
            serving=ServingFigures(requests_running=n, generation_tokens_per_s=40.0),
        )

    return source


# ---- the feed ----------------------------------------------------------------------------


def test_online_status_periodic_telemetry_events_and_clean_offline(broker) -> None:
    node = "feed"

    async def body() -> None:
        link = MqttLink(config(broker, node), telemetry_source=telemetry_counter(), version="9.9")
        t = link.topics
        link.set_status(
            phase="ready",
            model="tiny-llama",
            device=DeviceSummary(backend="virtual", name="H200", mode="observe", is_virtual=True),
        )
        link.set_policy(PolicyStore().policy)
        async with Recorder(broker, f"wattserve/{node}/#") as sub:
            await link.start()
            online = await sub.wait_for(t.status, is_status("online"))
            status = StatusPayload.model_validate_json(online.payload)
            assert status.schema_version == 1 and online.json()["schema"] == 1
            assert (status.node_id, status.version, status.phase) == (node, "9.9", "ready")
            assert status.model == "tiny-llama" and status.device is not None
            assert status.device.is_virtual

            ticks = await sub.count(t.telemetry, 3)
            payloads = [TelemetryPayload.model_validate_json(m.payload) for m in ticks[:3]]
            assert [m.qos for m in ticks[:3]] == [0, 0, 0]
            powers = [p.device.power_w for p in payloads]
            assert powers == sorted(powers) and len(set(powers)) == 3
            assert all(p.schema_version == 1 for p in payloads)
            assert "power_w" in ticks[0].json()["device"]

            link.publish_event(EventPayload(kind="decision", message="batch cap 8 -> 4: TPOT"))
            event = await sub.wait_for(t.events, lambda p: p["kind"] == "decision")
            assert event.qos == 1
            assert EventPayload.model_validate_json(event.payload).message.startswith("batch cap")

            # A late subscriber gets the retained status and policy, and no telemetry.
            async with Recorder(broker, t.status, t.policy) as late:
                retained = await late.wait_for(t.status)
                assert retained.retain and retained.json()["state"] == "online"
                policy = await late.wait_for(t.policy)
                assert policy.retain and policy.json()["power_budget_w"] == 700
                assert policy.json()["schema"] == 1

            await link.stop()
            assert not link.connected
            offline = await sub.wait_for(t.status, is_status("offline", "shutdown"))
            assert StatusPayload.model_validate_json(offline.payload).model == "tiny-llama"
            stats = link.stats()
            assert stats.connects == 1 and stats.published["telemetry"] >= 3
            assert stats.published["event"] == 1 and stats.published["status"] == 2

        # The clean disconnect discarded the Will: the retained status stays "shutdown".
        async with Recorder(broker, t.status) as after:
            retained = await after.wait_for(t.status)
            assert retained.json()["offline_reason"] == "shutdown"

    run(body)


def test_policy_set_applies_valid_and_rejects_invalid_with_an_event(broker) -> None:
    node = "policy"

    async def body() -> None:
        store = PolicyStore()
        link = MqttLink(config(broker, node, **ANONYMOUS_POLICY), policy_handler=store)
        store.report = link.publish_event
        t = link.topics
        link.set_policy(store.policy)
        async with Recorder(broker, f"wattserve/{node}/#") as sub:
            await link.start()
            await sub.wait_for(t.status, is_status("online"))
            await sub.wait_for(t.policy)

            new = {"schema": 1, "power_budget_w": 450.0, "ttft_slo_ms": 800.0}
            new |= {"tpot_slo_ms": 90.0, "mode": "auto"}
            await sub.publish(t.policy_set, json.dumps(new))
            changed = await sub.wait_for(t.events, lambda p: p["kind"] == "policy_changed")
            assert changed.json()["data"]["changed_by"] == "mqtt"
            assert changed.json()["data"]["policy"]["power_budget_w"] == 450.0
            in_force = await sub.wait_for(t.policy, lambda p: p["power_budget_w"] == 450.0)
            assert in_force.json()["mode"] == "auto"
            assert store.policy.power_budget_w == 450.0 and len(store.applied) == 1

            bad = [
                (json.dumps({**new, "power_budget_w": -5}).encode(), "power_budget_w"),
                (b"{not json", "not JSON"),
                (json.dumps({**new, "power_budget": 1}).encode(), "power_budget"),
                (json.dumps({**new, "schema": 2}).encode(), "unsupported schema"),
                (json.dumps([1, 2]).encode(), "JSON object"),
            ]
            for payload, _ in bad:
                await sub.publish(t.policy_set, payload)
            rejected = await sub.count(t.events, 1 + len(bad))
            reasons = [m.json() for m in rejected if m.json()["kind"] == "policy_rejected"]
            assert len(reasons) == len(bad)
            for event, (_, why) in zip(reasons, bad, strict=True):
                assert why in event["message"] and "nothing changed" in event["message"]
            assert reasons[0]["data"]["errors"][0]["loc"] == "power_budget_w"

            # Nothing changed: same policy applied, no further `policy` publication.
            assert store.policy.power_budget_w == 450.0 and len(store.applied) == 1
            assert [m.json()["power_budget_w"] for m in sub.on(t.policy)] == [700, 450.0]
            stats = link.stats()
            assert (stats.policy_set_accepted, stats.policy_set_rejected) == (1, len(bad))
            await link.stop()

    run(body)


def test_without_accept_policy_policy_set_is_not_even_subscribed(broker, caplog) -> None:
    caplog.set_level(logging.INFO, logger="wattserve.mqtt")
    node = "policy-off"

    async def body() -> None:
        off_store, on_store = PolicyStore(), PolicyStore()
        off = MqttLink(config(broker, node, client_id="off"), policy_handler=off_store)
        # A second node on the same topics that does take policy/set: once it has applied
        # the message, the broker has handed it to every subscriber of the topic.
        on_cfg = config(broker, node, client_id="on", **ANONYMOUS_POLICY)
        on = MqttLink(on_cfg, policy_handler=on_store)
        t = off.topics
        assert not off.accepts_policy and on.accepts_policy
        async with Recorder(broker, t.status) as sub:
            await off.start()
            await on.start()
            assert await off.wait_connected(WAIT_S) and await on.wait_connected(WAIT_S)
            await sub.count(t.status, 2)  # both subscribed (or not) before going online
            policy = {"power_budget_w": 123, "ttft_slo_ms": 1, "tpot_slo_ms": 1, "mode": "auto"}
            await sub.publish(t.policy_set, json.dumps(policy))
            await wait_until(lambda: len(on_store.applied) == 1)
            assert off_store.applied == []
            s = off.stats()
            assert (s.policy_set_accepted, s.policy_set_rejected) == (0, 0)
            await off.stop()
            await on.stop()

    run(body)
    said = [r.getMessage() for r in caplog.records]
    assert any("remote policy off (mqtt.accept_policy = false)" in m for m in said), said


def test_a_retained_policy_set_is_ignored_at_connect_and_reconnect_live_ones_apply(
    broker,
) -> None:
    node = "policy-retained"

    async def body() -> None:
        store = PolicyStore()
        link = MqttLink(config(broker, node, **ANONYMOUS_POLICY), policy_handler=store)
        store.report = link.publish_event
        t = link.topics
        link.set_policy(store.policy)
        stale = {"power_budget_w": 111, "ttft_slo_ms": 1, "tpot_slo_ms": 1, "mode": "manual"}
        live = {**stale, "power_budget_w": 222}
        async with Recorder(broker, t.events, t.policy) as sub:
            await sub.publish(t.policy_set, json.dumps(stale), retain=True)
            try:
                await link.start()
                first = await sub.wait_for(t.events, lambda p: p["kind"] == "policy_rejected")
                event = EventPayload.model_validate_json(first.payload)
                assert event.data["retained"] and "retained policy/set ignored" in event.message
                assert store.applied == []

                await sub.publish(t.policy_set, json.dumps(live))  # live: applied
                await sub.wait_for(t.policy, lambda p: p["power_budget_w"] == 222)
                # A client taking over the link's client id drops its connection: the link
                # reconnects, resubscribes, and the broker hands the retained one over again.
                async with aiomqtt.Client("127.0.0.1", broker.port, identifier=link.client_id):
                    pass
                await wait_until(lambda: link.stats().policy_set_retained_ignored == 2)
                assert link.stats().connects >= 2
                assert [p.power_budget_w for p in store.applied] == [222]
                assert store.policy.power_budget_w == 222
            finally:
                await sub.publish(t.policy_set, b"", retain=True)  # clear it on the broker
                await link.stop()

    run(body)


def test_home_assistant_discovery_sensors_read_fields_the_telemetry_has(broker) -> None:
    node = "ha"

    async def body() -> None:
        link = MqttLink(
            config(broker, node, home_assistant_discovery=True),
            telemetry_source=telemetry_counter(),
        )
        t = link.topics
        async with Recorder(broker, f"homeassistant/sensor/{node}/+/config", t.telemetry) as sub:
            await link.start()
            tick = (await sub.count(t.telemetry, 1))[0].json()
            await wait_until(
                lambda: (
                    sum(m.topic.startswith("homeassistant/") for m in sub.messages)
                    >= len(HA_SENSORS)
                )
            )
            configs = [m for m in sub.messages if m.topic.startswith("homeassistant/")]
            assert len({m.json()["unique_id"] for m in configs}) == len(HA_SENSORS)
            for m in configs:
                c = m.json()
                assert c["state_topic"] == t.telemetry and c["availability_topic"] == t.status
                path = re.search(r"value_json\.([\w.]+)", c["value_template"]).group(1)
                node_value: Any = tick
                for part in path.split("."):
                    assert part in node_value, f"{m.topic}: {path} is not in telemetry"
                    node_value = node_value[part]
            power = next(m.json() for m in configs if m.topic.endswith("/power/config"))
            assert (power["unit_of_measurement"], power["device_class"]) == ("W", "power")
            await link.stop()

    run(body)


# ---- reliability -------------------------------------------------------------------------


def test_broker_killed_then_back_reconnects_republishes_and_resubscribes(own_broker) -> None:
    broker = own_broker
    node = "restart"

    async def body() -> None:
        store = PolicyStore()
        cfg = config(broker, node, telemetry_queue_max=4, event_queue_max=8, **ANONYMOUS_POLICY)
        link = MqttLink(cfg, policy_handler=store)
        t = link.topics
        link.set_policy(store.policy)
        broker.start()
        await link.start()
        assert await link.wait_connected(WAIT_S)

        broker.kill()
        await wait_until(lambda: not link.connected)
        # Serving goes on: feeding never blocks; telemetry beyond its bound is dropped.
        for i in range(20):
            link.publish_telemetry(TelemetryPayload(device=DeviceFigures(power_w=float(i))))
        link.publish_event(EventPayload(kind="device_fault", message="queued while down"))
        stats = link.stats()
        assert (stats.queued_telemetry, stats.dropped_telemetry) == (4, 16)
        assert stats.queued_events == 1

        broker.start()  # a fresh broker: nothing retained survives
        assert await link.wait_connected(WAIT_S)
        await wait_until(lambda: link.stats().queued_events == 0)
        async with Recorder(broker, f"wattserve/{node}/#") as sub:
            status = await sub.wait_for(t.status, is_status("online"))
            assert status.retain  # republished after the reconnect
            policy = await sub.wait_for(t.policy)
            assert policy.retain and policy.json()["power_budget_w"] == 700
            # Resubscribed: policy/set reaches the handler again.
            await sub.publish(
                t.policy_set,
                json.dumps(
                    {"power_budget_w": 333, "ttft_slo_ms": 1, "tpot_slo_ms": 1, "mode": "manual"}
                ),
            )
            await sub.wait_for(t.policy, lambda p: p["power_budget_w"] == 333)
        stats = link.stats()
        assert stats.connects == 2 and stats.connection_losses == 1
        assert stats.published["event"] >= 1  # the queued event went out after reconnecting
        assert stats.published["telemetry"] == 4
        await link.stop()

    run(body)


def test_broker_absent_at_start_one_log_line_then_connects(own_broker, caplog) -> None:
    broker = own_broker
    caplog.set_level(logging.DEBUG, logger="wattserve.mqtt")

    async def body() -> None:
        link = MqttLink(config(broker, "late", reconnect_max_ms=100, telemetry_queue_max=2))
        await link.start()
        await wait_until(lambda: link.stats().connect_failures >= 4)
        for _ in range(5):
            link.publish_telemetry(TelemetryPayload())
        assert link.stats().dropped_telemetry == 3
        link.publish_event(EventPayload(kind="start", message="serving"))
        broker.start()
        assert await link.wait_connected(WAIT_S)
        await wait_until(lambda: link.stats().published["event"] == 1)
        await link.stop()

    run(body)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "cannot connect" in warnings[0].getMessage()
    assert any(
        re.search(r"connected to .* after [\d.]+ s down \(\d+ failed", r.getMessage())
        for r in caplog.records
    )


# ---- the process dies / stops ------------------------------------------------------------

CHILD = """
import asyncio, signal, sys
from wattserve.daemon.config import MqttConfig
from wattserve.daemon.mqtt import EventPayload, MqttLink

async def main() -> None:
    link = MqttLink(MqttConfig.model_validate_json(sys.argv[1]))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    link.set_status(phase="ready")
    await link.start()
    if not await link.wait_connected(10):
        sys.exit(3)
    print("up", flush=True)
    await stop.wait()
    link.publish_event(EventPayload(kind="stop", message="SIGTERM received"))
    await link.stop()

asyncio.run(main())
"""


async def _spawn(cfg: MqttConfig) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        cfg.model_dump_json(),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), WAIT_S)
    assert line == b"up\n", line
    return proc


def test_sigkill_of_the_process_makes_the_will_report_offline(broker) -> None:
    node = "killed"

    async def body() -> None:
        t = MqttLink(config(broker, node)).topics
        async with Recorder(broker, t.status) as sub:
            proc = await _spawn(config(broker, node))
            online = await sub.wait_for(t.status, is_status("online"))
            assert online.json()["phase"] == "ready"
            proc.kill()
            await proc.wait()
            await expect_will(broker, sub, t.status, node)

    run(body)


def test_sigterm_publishes_offline_before_exit_and_no_will(broker) -> None:
    node = "stopped"

    async def body() -> None:
        t = MqttLink(config(broker, node)).topics
        marker = f"test/{node}/marker"
        async with Recorder(broker, t.status, t.events, marker) as sub:
            proc = await _spawn(config(broker, node))
            await sub.wait_for(t.status, is_status("online"))
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0
            await sub.wait_for(t.status, is_status("offline", "shutdown"))
            # The event queued at SIGTERM was flushed before `offline`.
            order = [(m.topic, m.json().get("kind") or m.json().get("state")) for m in sub.messages]
            assert order.index((t.events, "stop")) < order.index((t.status, "offline"))
            # A round trip through the broker after the exit: no Will came after "shutdown".
            await sub.publish(marker, b"{}")
            await sub.wait_for(marker)
            assert [m.json()["state"] for m in sub.on(t.status)] == ["online", "offline"]
        async with Recorder(broker, t.status) as late:
            retained = await late.wait_for(t.status)
            assert retained.json()["offline_reason"] == "shutdown"

    run(body)


# ---- authentication, ACL and TLS ---------------------------------------------------------


def _password_file(tmp_path: Path, password: str) -> Path:
    path = tmp_path / "mqtt-password"
    path.write_text(password + "\n")
    return path


def test_password_auth_and_acl_only_the_fleet_user_may_set_policy(auth_broker, tmp_path) -> None:
    broker = auth_broker
    node = "acl"

    async def body() -> None:
        store = PolicyStore()
        cfg = config(
            broker,
            node,
            username=node,  # one broker user per node (the ACL's %u)
            password_file=_password_file(tmp_path, USERS[node]),
            accept_policy=True,
        )
        link = MqttLink(cfg, policy_handler=store)
        t = link.topics
        link.set_policy(store.policy)
        viewer = {"username": "viewer", "password": USERS["viewer"]}
        fleet = {"username": "fleet", "password": USERS["fleet"]}
        async with Recorder(broker, f"wattserve/{node}/#", **viewer) as sub:
            await link.start()
            await sub.wait_for(t.status, is_status("online"))
            policy = {"ttft_slo_ms": 500, "tpot_slo_ms": 50, "mode": "auto"}
            # The broker acknowledges the viewer's publish but drops it (ACL).
            await sub.publish(t.policy_set, json.dumps({**policy, "power_budget_w": 111}))
            async with Recorder(broker, **fleet) as admin:
                await admin.publish(t.policy_set, json.dumps({**policy, "power_budget_w": 222}))
            await sub.wait_for(t.policy, lambda p: p["power_budget_w"] == 222)
            assert [p.power_budget_w for p in store.applied] == [222]
            await link.stop()

    run(body)


def test_wrong_password_is_refused(auth_broker, tmp_path, caplog) -> None:
    broker = auth_broker
    caplog.set_level(logging.DEBUG, logger="wattserve.mqtt")

    async def body() -> None:
        for args in (
            {"username": "viewer", "password": "wrong"},
            {"username": "nobody", "password": "x"},
            {},  # anonymous
        ):
            with pytest.raises(aiomqtt.MqttCodeError) as refused:
                async with Recorder(broker, "wattserve/#", **args):
                    pass
            assert "authori" in str(refused.value).lower() or "password" in str(refused.value)

        cfg = config(
            broker,
            "intruder",
            username="intruder",
            password_file=_password_file(tmp_path, "not-the-password"),
            reconnect_max_ms=100,
        )
        link = MqttLink(cfg)
        await link.start()
        await wait_until(lambda: link.stats().connect_failures >= 3)
        assert link.stats().connects == 0 and not link.connected
        await link.stop()

    run(body)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot connect" in warnings[0], warnings


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_tls_files(root: Path) -> TlsFiles:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed: run `make test-services`")
    f = {n: root / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem", "ext")}
    f |= {n: root / n for n in ("cli.key", "cli.csr", "cli.pem")}
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", str(f["ca.key"]), "-out", str(f["ca.pem"]),
             "-days", "2", "-subj", "/CN=wattserve test CA")  # fmt: skip
    f["ext"].write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who, cn in (("srv", "127.0.0.1"), ("cli", "wattserve")):
        _openssl("req", "-new", *ec, "-keyout", str(f[f"{who}.key"]),
                 "-out", str(f[f"{who}.csr"]), "-subj", f"/CN={cn}")  # fmt: skip
        _openssl("x509", "-req", "-in", str(f[f"{who}.csr"]), "-CA", str(f["ca.pem"]),
                 "-CAkey", str(f["ca.key"]), "-CAcreateserial", "-days", "2",
                 "-extfile", str(f["ext"]), "-out", str(f[f"{who}.pem"]))  # fmt: skip
    return TlsFiles(f["ca.pem"], f["srv.pem"], f["srv.key"], f["cli.pem"], f["cli.key"])


def test_tls_with_client_certificate(tmp_path) -> None:
    tls = make_tls_files(tmp_path)
    broker = Broker(tmp_path, tls=tls)
    broker.start()
    node = "tls"

    async def body() -> None:
        cfg = config(
            broker,
            node,
            tls_enabled=True,
            tls_ca_file=tls.ca,
            tls_cert_file=tls.client_cert,
            tls_key_file=tls.client_key,
        )
        link = MqttLink(cfg)
        ctx = ssl.create_default_context(cafile=str(tls.ca))
        ctx.load_cert_chain(tls.client_cert, tls.client_key)
        async with Recorder(broker, link.topics.status, tls_context=ctx) as sub:
            await link.start()
            await sub.wait_for(link.topics.status, is_status("online"))
            await link.stop()
            await sub.wait_for(link.topics.status, is_status("offline", "shutdown"))
        # Without a client certificate the broker refuses the handshake. (TLS 1.2: with
        # 1.3 the refusal arrives after the client's handshake, as a late alert.)
        bare = ssl.create_default_context(cafile=str(tls.ca))
        bare.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(aiomqtt.MqttError) as refused:
            async with Recorder(broker, link.topics.status, tls_context=bare, timeout=WAIT_S):
                pass
        assert "handshake" in str(refused.value).lower() or "certificate" in str(refused.value)

    try:
        run(body)
    finally:
        broker.stop()
