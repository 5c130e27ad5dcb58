"""MQTT parts that need no broker: backoff, outbox bounds, payloads, policy/set parsing,
the telemetry window, config checks, the metrics view, and the publisher's put-back."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiomqtt
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from wattserve.daemon.config import ConfigError, MqttConfig, load_config
from wattserve.daemon.device.protocol import Telemetry
from wattserve.daemon.mqtt import (
    Backoff,
    DeviceFigures,
    EventPayload,
    MqttLink,
    StatusPayload,
    TelemetryPayload,
    TelemetryWindow,
)
from wattserve.daemon.mqtt.link import read_password_file, tls_context
from wattserve.daemon.mqtt.metrics import MqttCollector
from wattserve.daemon.mqtt.outbox import Outbox, Outgoing
from wattserve.daemon.mqtt.payloads import (
    PolicySetRejected,
    Topics,
    describe_rejection,
    parse_policy_set,
    policy_payload,
    resolve_node_id,
)
from wattserve.daemon.mqtt.window import percentile

# ---- backoff -----------------------------------------------------------------------------


def test_backoff_doubles_with_jitter_up_to_the_cap_and_resets() -> None:
    b = Backoff(0.5, 4.0, random.Random(7))
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    delays = [b.next_delay_s() for _ in ceilings]
    for d, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= d <= ceiling
    assert len(set(delays)) == len(delays)  # jittered, not a fixed ladder
    for _ in range(2000):  # no overflow however long the outage
        assert b.next_delay_s() <= 4.0
    b.reset()
    assert b.next_delay_s() <= 0.5


def test_backoff_rejects_nonsense_bounds() -> None:
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0, random.Random())
    with pytest.raises(ValueError):
        Backoff(0.0, 1.0, random.Random())


# ---- outbox ------------------------------------------------------------------------------


def _tel(i: int) -> Outgoing:
    return Outgoing("telemetry", "t", str(i).encode(), 0)


def _ev(i: int) -> Outgoing:
    return Outgoing("event", "e", str(i).encode(), 1)


def _drain(box: Outbox) -> list[bytes]:
    out = []
    while (m := box.pop()) is not None:
        out.append(m.payload)
    return out


def test_outbox_keeps_arrival_order_and_drops_oldest_telemetry_first() -> None:
    box = Outbox(telemetry_max=2, event_max=3)
    for m in (_tel(1), _ev(1), _tel(2), _tel(3), _ev(2)):
        box.put(m)
    c = box.counts()
    assert (c.queued_telemetry, c.dropped_telemetry, c.queued_events) == (2, 1, 2)
    assert _drain(box) == [b"1", b"2", b"3", b"2"]  # ev1, tel2, tel3, ev2


def test_outbox_events_have_their_own_larger_bound() -> None:
    box = Outbox(telemetry_max=1, event_max=4)
    for i in range(6):
        box.put(_ev(i))
        box.put(_tel(i))
    c = box.counts()
    assert (c.queued_events, c.dropped_events) == (4, 2)
    assert (c.queued_telemetry, c.dropped_telemetry) == (1, 5)
    assert _drain(box) == [b"2", b"3", b"4", b"5", b"5"]


def test_outbox_put_back_goes_first_and_is_dropped_if_the_queue_refilled() -> None:
    box = Outbox(telemetry_max=2, event_max=2)
    box.put(_ev(1))
    box.put(_tel(1))
    failed = box.pop()
    assert failed == _ev(1)
    box.put_back(failed)
    assert box.pop() == _ev(1)  # before the telemetry queued after it
    box.put(_ev(2))
    box.put(_ev(3))
    box.put_back(_ev(1))  # full: the returned (oldest) event is the one dropped
    assert box.counts().dropped_events == 1
    left = []
    while (m := box.pop()) is not None:
        left.append((m.kind, m.payload))
    assert left == [("telemetry", b"1"), ("event", b"2"), ("event", b"3")]
    with pytest.raises(ValueError):
        Outbox(0, 1)


def test_outbox_is_safe_from_many_threads() -> None:
    box = Outbox(telemetry_max=10, event_max=10_000)

    def feed() -> None:
        for i in range(500):
            box.put(_ev(i))
            box.put(_tel(i))

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = box.counts()
    assert c.queued_events == 2000 and c.dropped_events == 0
    assert c.queued_telemetry == 10 and c.dropped_telemetry == 1990
    assert len(_drain(box)) == 2010


# ---- payloads ----------------------------------------------------------------------------


def test_payloads_carry_schema_1_on_the_wire_and_refuse_other_versions() -> None:
    event = EventPayload(kind="decision", message="lower clock: over budget", data={"x": 1})
    wire = json.loads(event.to_json_bytes())
    assert wire["schema"] == 1 and "schema_version" not in wire
    assert EventPayload.model_validate_json(event.to_json_bytes()) == event
    with pytest.raises(ValidationError):
        EventPayload.model_validate({**wire, "schema": 2})
    with pytest.raises(ValidationError):
        EventPayload.model_validate({**wire, "kind": "gossip"})
    with pytest.raises(ValidationError):
        TelemetryPayload(device=DeviceFigures(power_w=math.nan))
    status = StatusPayload(state="online", node_id="n", version="1", started_unix_s=1.0)
    assert json.loads(status.to_json_bytes())["offline_reason"] is None


def test_device_figures_from_device_telemetry() -> None:
    t = Telemetry(
        timestamp_s=3.0,
        power_w=412.5,
        energy_j=1.5e6,
        gpu_temp_c=61.0,
        sm_clock_mhz=1755,
        clock_event_reasons=("SwPowerCap",),
        sm_clock_lock_mhz=(1200, 1500),
        power_avg_w=math.inf,
        stale=False,
        device_lost=True,
    )
    f = DeviceFigures.from_telemetry(t)
    assert (f.power_w, f.energy_j, f.sm_clock_mhz) == (412.5, 1.5e6, 1755)
    assert f.clock_event_reasons == ("SwPowerCap",) and f.sm_clock_lock_mhz == (1200, 1500)
    assert f.power_avg_w is None  # not finite: not a measurement
    assert f.stale  # a lost device's reading is not current
    wire = json.loads(TelemetryPayload(device=f).to_json_bytes())
    assert wire["device"]["sm_clock_lock_mhz"] == [1200, 1500]


class _Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    power_budget_w: float = Field(gt=0)
    mode: Literal["auto", "manual", "observe"]


def test_policy_payload_is_flat_from_a_model_a_dataclass_or_a_dict() -> None:
    from wattserve.controller.policy import Policy

    assert json.loads(policy_payload(_Policy(power_budget_w=5, mode="auto"))) == {
        "schema": 1,
        "power_budget_w": 5.0,
        "mode": "auto",
    }
    wire = json.loads(policy_payload(Policy(power_budget_w=600, ttft_slo_ms=1, tpot_slo_ms=2)))
    assert wire["schema"] == 1 and wire["mode"] == "observe" and wire["power_budget_w"] == 600
    assert json.loads(policy_payload({"power_budget_w": 1}))["power_budget_w"] == 1
    with pytest.raises(TypeError):
        policy_payload(42)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"{oops", "not JSON"),
        (b'{"power_budget_w": NaN}', "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"schema": 2, "mode": "auto"}', "unsupported schema 2"),
        (b" " * 20_000, "bytes"),
    ],
)
def test_policy_set_parsing_rejects_with_a_reason(payload: bytes, why: str) -> None:
    with pytest.raises(PolicySetRejected, match=why):
        parse_policy_set(payload)


def test_policy_set_parsing_accepts_with_or_without_schema() -> None:
    assert parse_policy_set(b'{"schema": 1, "mode": "auto"}') == {"mode": "auto"}
    assert parse_policy_set(b'{"mode": "auto"}') == {"mode": "auto"}


def test_rejection_reason_names_each_bad_field() -> None:
    with pytest.raises(ValidationError) as e:
        _Policy.model_validate({"power_budget_w": -1, "mode": "turbo", "extra": 1})
    r = describe_rejection(e.value)
    assert str(r).startswith("invalid policy: ")
    assert {x["loc"] for x in r.errors} == {"power_budget_w", "mode", "extra"}
    assert "power_budget_w: Input should be greater than 0" in str(r)
    assert str(describe_rejection(ValueError("tpot_slo_ms must be > 0"))).endswith("must be > 0")


def test_topics_and_node_id() -> None:
    t = Topics.for_node("lab/wattserve", "gpu-01")
    assert (t.status, t.policy_set) == (
        "lab/wattserve/gpu-01/status",
        "lab/wattserve/gpu-01/policy/set",
    )
    cfg = MqttConfig()
    assert resolve_node_id(cfg, hostname="box.lab+1/#") == "box.lab-1"
    assert resolve_node_id(cfg, hostname="+++") == "node"
    assert resolve_node_id(MqttConfig(node_id="n1"), hostname="ignored") == "n1"


# ---- telemetry window --------------------------------------------------------------------


def test_window_energy_per_token_rates_and_counter_reset() -> None:
    w = TelemetryWindow()
    first = w.close(now_s=10.0, generation_tokens=100, prompt_tokens=50, energy_j=5000.0)
    assert first.window_s is None and first.energy_per_token_j is None
    second = w.close(now_s=12.0, generation_tokens=300, prompt_tokens=90, energy_j=5600.0)
    assert second.window_s == 2.0
    assert second.generation_tokens_per_s == 100.0 and second.prompt_tokens_per_s == 20.0
    assert second.energy_window_j == 600.0 and second.energy_per_token_j == 3.0
    idle = w.close(now_s=13.0, generation_tokens=300, prompt_tokens=90, energy_j=5700.0)
    assert idle.energy_window_j == 100.0 and idle.energy_per_token_j is None  # no tokens
    reset = w.close(now_s=14.0, generation_tokens=310, prompt_tokens=90, energy_j=10.0)
    assert reset.energy_window_j is None and reset.energy_per_token_j is None
    assert w.close(now_s=15.0, generation_tokens=320, prompt_tokens=90, energy_j=None).window_s == 1


def test_window_latency_percentiles_and_slo_attainment() -> None:
    w = TelemetryWindow()
    for i in range(1, 101):
        w.record_request(ttft_ms=float(i * 10), tpot_ms=None if i == 100 else float(i))
    fig = w.close(
        now_s=1.0,
        generation_tokens=0,
        prompt_tokens=0,
        energy_j=None,
        ttft_slo_ms=500,
        tpot_slo_ms=40,
    )
    lat = fig.latency
    assert fig.requests_finished == 100
    assert (lat.ttft_p50_ms, lat.ttft_p99_ms) == (500.0, 990.0)
    assert (lat.tpot_p50_ms, lat.tpot_p99_ms) == (50.0, 99.0)  # rank ceil(.99 * 99) = 99
    assert lat.slo_attainment_ratio == 0.40  # ttft <= 500 and tpot <= 40: i = 1..40
    empty = w.close(now_s=2.0, generation_tokens=0, prompt_tokens=0, energy_j=None).latency
    assert empty.ttft_p99_ms is None and empty.slo_attainment_ratio is None
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


# ---- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mqtt", "message"),
    [
        ({"tls_ca_file": "/ca.pem"}, "tls_ca_file is set but tls_enabled is false"),
        ({"tls_enabled": True, "tls_key_file": "/k"}, "tls_key_file is set but tls_cert_file"),
        ({"password_file": "/pw"}, "password_file is set but username is not"),
        ({"topic_prefix": "a/#"}, "no wildcard"),
        ({"topic_prefix": "a//b"}, "no empty level"),
        ({"telemetry_queue_max": 50, "event_queue_max": 10}, "event_queue_max must be >="),
        ({"reconnect_initial_ms": 900, "reconnect_max_ms": 100}, "reconnect_max_ms"),
        ({"node_id": "a/b"}, "mqtt.node_id"),
        ({"keepalive_s": 1}, "mqtt.keepalive_s"),
        ({"accept_policy": True}, "accept_policy = true over an unauthenticated connection"),
        (
            {"accept_policy": True, "username": "wattserve"},  # a name alone proves nothing
            "accept_policy_unauthenticated = true",
        ),
        ({"accept_policy_unauthenticated": True}, "but accept_policy is not"),
    ],
)
def test_mqtt_config_errors_name_the_key(mqtt: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"mqtt": mqtt})


def test_remote_policy_is_opt_in_and_needs_credentials_or_an_explicit_waiver() -> None:
    assert MqttConfig().remote_policy == "off"  # the default: policy/set is not taken
    password = {"username": "wattserve", "password_file": "/pw"}
    assert MqttConfig(accept_policy=True, **password).remote_policy == "authenticated"
    cert = {"tls_enabled": True, "tls_cert_file": "/c.pem"}
    assert MqttConfig(accept_policy=True, **cert).remote_policy == "authenticated"
    waived = MqttConfig(accept_policy=True, accept_policy_unauthenticated=True)
    assert waived.remote_policy == "unauthenticated"
    assert MqttConfig(enabled=False, **password, accept_policy=True).remote_policy == "off"
    # The link takes the config's word, whatever handler the daemon hands it.
    off = MqttLink(MqttConfig(node_id="n"), policy_handler=lambda f: f)
    assert not off.accepts_policy
    assert MqttLink(
        waived.model_copy(update={"node_id": "n"}), policy_handler=lambda f: f
    ).accepts_policy


def test_mqtt_config_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("WATTSERVE_MQTT__NODE_ID", "rack3-gpu1")
    monkeypatch.setenv("WATTSERVE_MQTT__HOME_ASSISTANT_DISCOVERY", "true")
    cfg = load_config().mqtt
    assert cfg.node_id == "rack3-gpu1" and cfg.home_assistant_discovery and cfg.enabled


def test_password_file_and_tls_files_are_checked_at_construction(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret with spaces\n")
    assert read_password_file(pw) == "s3cret with spaces"
    pw.write_text("\n")
    with pytest.raises(ConfigError, match="mqtt.password_file: .* is empty"):
        read_password_file(pw)
    with pytest.raises(ConfigError, match="mqtt.password_file: cannot read"):
        MqttLink(MqttConfig(username="u", password_file=tmp_path / "missing"))
    with pytest.raises(ConfigError, match="mqtt.tls_ca_file"):
        tls_context(MqttConfig(tls_enabled=True, tls_ca_file=tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="mqtt.tls_cert_file"):
        tls_context(MqttConfig(tls_enabled=True, tls_cert_file=tmp_path / "junk.pem"))
    assert tls_context(MqttConfig()) is None


# ---- the link without a broker -----------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_feeding_before_start_and_metrics_view() -> None:
    link = MqttLink(MqttConfig(node_id="n", telemetry_queue_max=2), version="0")
    for _ in range(5):
        link.publish_telemetry(TelemetryPayload())
    link.publish_event(EventPayload(kind="start", message="up"))
    link.set_policy({"power_budget_w": 1.0}, changed_by="http")  # + a policy_changed event
    s = link.stats()
    assert (s.queued_telemetry, s.dropped_telemetry, s.queued_events) == (2, 3, 2)
    assert not s.connected and s.connects == 0
    registry = CollectorRegistry()
    registry.register(MqttCollector(link))
    text = generate_latest(registry).decode()
    assert 'wattserve_mqtt_messages_dropped_total{kind="telemetry"} 3.0' in text
    assert 'wattserve_mqtt_messages_queued{kind="event"} 2.0' in text
    assert "wattserve_mqtt_connected 0.0" in text


def test_policy_set_events_rejections_to_the_sink_changes_to_the_handler() -> None:
    sunk: list[EventPayload] = []
    applied: list[dict[str, Any]] = []

    def handler(fields: dict[str, Any]) -> dict[str, Any]:
        if fields.get("power_budget_w", 0) <= 0:
            raise ValueError("power_budget_w must be > 0")
        applied.append(fields)
        return fields

    cfg = MqttConfig(node_id="n", accept_policy=True, accept_policy_unauthenticated=True)
    link = MqttLink(cfg, policy_handler=handler, event_sink=sunk.append)
    link._on_policy_set(b'{"power_budget_w": -1}')
    link._on_policy_set(b"[1]")
    assert [e.kind for e in sunk] == ["policy_rejected", "policy_rejected"]
    assert "nothing changed" in sunk[0].message and not applied
    link._on_policy_set(b'{"schema": 1, "power_budget_w": 5}')
    # Accepted: the handler reports the change (the daemon, through its live feed); the
    # link only republishes the retained policy, so the event is not doubled.
    assert applied == [{"power_budget_w": 5}] and len(sunk) == 2
    s = link.stats()
    assert (s.queued_events, s.policy_set_accepted, s.policy_set_rejected) == (0, 1, 2)
    assert json.loads(link._retained("policy")[0][1]) == {"schema": 1, "power_budget_w": 5}


@dataclass
class _FlakyClient:
    """Publishes into a list; the n-th publish fails as a lost connection does."""

    fail_at: int
    sent: list[tuple[str, bytes]]

    async def publish(self, topic: str, payload: bytes, **kw: Any) -> None:
        if len(self.sent) == self.fail_at:
            self.fail_at = -1
            raise aiomqtt.MqttError("Disconnected")
        self.sent.append((topic, payload))


def test_an_event_whose_publish_failed_is_kept_for_the_next_connection() -> None:
    async def body() -> None:
        link = MqttLink(MqttConfig(node_id="n", port=_free_port(), reconnect_initial_ms=5000))
        await link.start()  # nothing listens: it stays disconnected
        link.publish_event(EventPayload(kind="drain", message="first"))
        link.publish_event(EventPayload(kind="drain", message="second"))
        client = _FlakyClient(fail_at=0, sent=[])  # publishing "first" fails
        with pytest.raises(aiomqtt.MqttError):
            await link._publish_loop(client)  # type: ignore[arg-type]
        assert link.stats().queued_events == 2
        link._stopping.set()  # type: ignore[union-attr]  # flush everything, then return
        await link._publish_loop(client)  # type: ignore[arg-type]
        events = [json.loads(p)["message"] for t, p in client.sent if t.endswith("/events")]
        assert events == ["first", "second"]
        await link.stop()

    asyncio.run(asyncio.wait_for(body(), 20))


class _SilentClient:
    """A connection whose PUBACK never comes."""

    async def publish(self, topic: str, payload: bytes, **kw: Any) -> None:
        await asyncio.Event().wait()


def test_an_event_in_flight_when_the_connection_drops_is_kept() -> None:
    async def body() -> None:
        link = MqttLink(MqttConfig(node_id="n", port=_free_port(), reconnect_initial_ms=5000))
        await link.start()
        link.publish_event(EventPayload(kind="drain", message="in flight"))
        publisher = asyncio.create_task(link._publish_loop(_SilentClient()))  # type: ignore[arg-type]
        while link.stats().queued_events:
            await asyncio.sleep(0.01)
        publisher.cancel()  # what the session does when the receiver sees the connection drop
        await asyncio.gather(publisher, return_exceptions=True)
        assert link.stats().queued_events == 1
        await link.stop()

    asyncio.run(asyncio.wait_for(body(), 20))


def test_telemetry_ticker_survives_a_failing_source() -> None:
    calls = 0

    def source() -> TelemetryPayload | None:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError("sensor glitch")
        return None if calls == 3 else TelemetryPayload()

    async def body() -> None:
        cfg = MqttConfig(node_id="n", port=_free_port(), telemetry_interval_ms=50)
        link = MqttLink(cfg, telemetry_source=source)
        await link.start()
        while link.stats().queued_telemetry < 2:
            await asyncio.sleep(0.02)
        s = link.stats()
        assert s.telemetry_source_errors == 2 and calls >= 5
        await link.stop()

    asyncio.run(asyncio.wait_for(body(), 20))
