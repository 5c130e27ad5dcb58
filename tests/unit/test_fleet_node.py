"""The node's side of the fleet: which grant is in force, the demand, the [fleet] config,
and what a grant must be to count (signed with the node's key, fresh, newer)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tests.fleet_keys import key_of, signed_grant, write_key
from wattserve.daemon.config import Config, ConfigError, FleetConfig, MqttConfig, load_config
from wattserve.daemon.mqtt.payloads import (
    DemandPayload,
    DeviceFigures,
    GrantPayload,
    LatencyFigures,
    ServingFigures,
    TelemetryPayload,
)
from wattserve.fleet.node import FleetNodeLink, GrantGate, node_demand
from wattserve.fleet.signing import KeyRing, verify

NOW_S = 1_767_000_000.0


def grant(
    epoch: int,
    budget_w: float = 400.0,
    lease_s: float = 10.0,
    node: str = "gpu-01",
    issued_s: float = NOW_S,
    key: bytes | None = None,
) -> GrantPayload:
    """A grant for node, signed for gpu-01's grant topic (with gpu-01's key unless key)."""
    return signed_grant(
        "gpu-01",
        key=key,
        node_id=node,
        budget_w=budget_w,
        epoch=epoch,
        expires_at_unix_s=issued_s + lease_s,
        issued_at_unix_s=issued_s,
    )


def fleet_cfg(tmp_path, **kw) -> FleetConfig:
    args = dict(
        enabled=True,
        safe_floor_w=150.0,
        key_file=write_key(tmp_path / "keys", "gpu-01"),
        insecure_lab_waiver=True,
    )
    return FleetConfig(**{**args, **kw})


def link_for(tmp_path, now, applied, **fleet) -> FleetNodeLink:
    return FleetNodeLink(
        MqttConfig(node_id="gpu-01"),
        fleet_cfg(tmp_path, **fleet),
        demand_source=lambda: (snapshot(), 100.0, 700.0),
        apply_budget=lambda w, why: applied.append(w),
        clock=lambda: now["unix"],
        monotonic=lambda: now["mono"],
    )


def test_a_live_newer_grant_applies_and_a_renewal_changes_nothing():
    gate = GrantGate("gpu-01", safe_floor_w=150.0, max_lease_s=60.0)
    assert gate.budget_w() == 150.0
    assert gate.offer(grant(5), NOW_S, 0.0).reason == "applied"
    assert gate.budget_w() == 400.0
    assert gate.offer(grant(6), NOW_S + 1, 1.0).reason == "renewed"


@pytest.mark.parametrize(
    ("offered", "reason"),
    [
        (grant(4), "older_epoch"),
        (grant(5), "older_epoch"),  # the same grant again (a retained copy)
        (grant(9, lease_s=-1.0), "expired"),
        (grant(9, node="gpu-02"), "other_node"),
    ],
)
def test_stale_or_foreign_grants_are_never_applied(offered, reason):
    gate = GrantGate("gpu-01", safe_floor_w=150.0, max_lease_s=60.0)
    gate.offer(grant(5, budget_w=300.0), NOW_S, 0.0)
    verdict = gate.offer(offered, NOW_S, 0.0)
    assert (verdict.applied, verdict.reason) == (False, reason)
    assert gate.budget_w() == 300.0


def test_the_lease_expires_to_the_safe_floor_once_and_old_epochs_stay_refused():
    gate = GrantGate("gpu-01", safe_floor_w=150.0, max_lease_s=60.0)
    gate.offer(grant(5, lease_s=10.0), NOW_S, 100.0)
    assert not gate.expire(109.9)
    assert gate.expire(110.0)
    assert not gate.expire(111.0)  # once
    assert gate.budget_w() == 150.0
    assert gate.offer(grant(5), NOW_S, 111.0).reason == "older_epoch"


def test_a_clock_skewed_grant_is_held_no_longer_than_max_lease():
    gate = GrantGate("gpu-01", safe_floor_w=150.0, max_lease_s=20.0)
    gate.offer(grant(5, lease_s=3600.0), NOW_S, 0.0)
    assert gate.lease_left_s(0.0) == 20.0
    assert gate.expire(20.0)


def test_a_grant_is_held_no_longer_than_its_lease_as_issued_whichever_clock_is_right():
    gate = GrantGate("gpu-01", safe_floor_w=150.0, max_lease_s=60.0)
    # This node's clock runs 4 s behind the allocator's: expires_at looks 14 s away, but
    # the allocator frees the watts 10 s (plus its grace) after it issued the grant.
    gate.offer(grant(5, lease_s=10.0, issued_s=NOW_S + 4.0), NOW_S, 0.0)
    assert gate.lease_left_s(0.0) == 10.0
    # A retained copy delivered 8 s after its issue: 2 s left, not a fresh 10.
    gate.offer(grant(6, lease_s=10.0, issued_s=NOW_S - 8.0), NOW_S, 0.0)
    assert gate.lease_left_s(0.0) == 2.0


def snapshot(power_w=300.0, ttft_p99=None, tpot_p99=None, waiting=0, tok_s=1000.0, att=1.0):
    return TelemetryPayload(
        time_unix_s=NOW_S,
        device=DeviceFigures(power_w=power_w, power_avg_w=power_w),
        serving=ServingFigures(requests_waiting=waiting, generation_tokens_per_s=tok_s),
        latency=LatencyFigures(
            ttft_p99_ms=ttft_p99, tpot_p99_ms=tpot_p99, slo_attainment_ratio=att
        ),
        policy={"power_budget_w": 400.0, "ttft_slo_ms": 1000.0, "tpot_slo_ms": 100.0},
    )


def demand(snap, **kw) -> DemandPayload:
    """The unsigned demand (node_demand is pure; the link signs)."""
    args = dict(safe_floor_w=150.0, device_min_w=100.0, device_max_w=700.0, grant=None)
    args.update(kw)
    return node_demand("gpu-01", snap, margin_ratio=0.1, **args)


def test_demand_asks_more_when_the_slos_are_missed_and_less_with_headroom():
    missing = demand(snapshot(tpot_p99=150.0))  # 1.5 x its TPOT SLO
    assert missing.need_w == pytest.approx(300 * 1.5 * 1.1)
    assert missing.slo_pressure_ratio == pytest.approx(1.5)
    easy = demand(snapshot(tpot_p99=60.0, ttft_p99=300.0))
    assert easy.need_w == pytest.approx(300 * 0.6 * 1.1)
    queued = demand(snapshot(waiting=5))
    assert queued.need_w == pytest.approx(300 * 1.25 * 1.1)


def test_demand_stays_within_floor_and_ceiling_and_reports_goodput_per_watt():
    d = demand(snapshot(power_w=650.0, tpot_p99=300.0, tok_s=1300.0, att=0.5))
    assert d.need_w == 700.0 and d.ceiling_w == 700.0
    assert d.goodput_per_w == pytest.approx(1300 * 0.5 / 650)
    idle = demand(snapshot(power_w=60.0, tok_s=0.0))
    assert idle.need_w == 150.0 and idle.floor_w == 150.0 and idle.goodput_per_w == 0.0
    assert demand(snapshot(), device_min_w=200.0).floor_w == 200.0


def test_demand_reports_the_grant_in_force():
    d = demand(snapshot(), grant=grant(7))
    assert d.grant is not None and (d.grant.epoch, d.grant.budget_w) == (7, 400.0)
    assert d.model_dump(by_alias=True)["schema"] == 1


def test_fleet_link_applies_every_grant_and_renewal_through_its_budget_sink(tmp_path):
    """Each renewal is applied again, so that a budget set otherwise since (an HTTP PUT
    above the grant) is put back at the next renewal (the daemon's sink skips a budget
    already in force)."""
    applied: list[float] = []
    now = {"unix": NOW_S, "mono": 0.0}
    link = link_for(tmp_path, now, applied)
    status = link.status()
    assert (status["source"], status["budget_w"], status["epoch"]) == (
        "safe_floor_no_grant_yet",
        150.0,
        None,
    )
    assert link.on_grant(grant(5).to_json_bytes()).applied
    status = link.status()
    assert (status["source"], status["budget_w"], status["epoch"]) == ("grant", 400.0, 5)
    assert status["expires_at_unix_s"] == grant(5).expires_at_unix_s
    assert status["lease_left_s"] == pytest.approx(grant(5).expires_at_unix_s - NOW_S)
    assert link.on_grant(grant(6).to_json_bytes()).reason == "renewed"
    assert link.on_grant(b'{"schema": 1, "budget_w": -3}').reason == "invalid"
    assert link.on_grant(grant(4, budget_w=900.0).to_json_bytes()).reason == "older_epoch"
    now["mono"] = 11.0
    assert link.check_lease()
    assert applied == [400.0, 400.0, 150.0]  # the grant, its renewal, the lease's end
    assert link.counts == {"applied": 1, "renewed": 1, "rejected": 2, "lease_expired": 1}
    status = link.status()
    assert status["budget_w"] == 150.0 and status["grant"] is None
    assert status["source"] == "safe_floor_lease_expired" and status["lease_left_s"] is None


def test_only_a_grant_signed_with_this_nodes_key_for_its_topic_counts(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="wattserve.fleet")
    applied: list[float] = []
    now = {"unix": NOW_S, "mono": 0.0}
    link = link_for(tmp_path, now, applied)
    unsigned = grant(7, budget_w=690.0).model_copy(update={"sig": ""})
    mallory = grant(8, budget_w=690.0, key=b"m" * 64)  # someone else's key
    # gpu-02's own valid grant, replayed onto gpu-01's topic: the topic is signed too.
    other = signed_grant(
        "gpu-02",
        budget_w=690.0,
        epoch=9,
        expires_at_unix_s=NOW_S + 10,
        issued_at_unix_s=NOW_S,
    ).model_copy(update={"node_id": "gpu-01"})
    tampered = grant(10, budget_w=300.0).model_copy(update={"budget_w": 690.0})
    for forged in (unsigned, mallory, other, tampered):
        assert link.on_grant(forged.to_json_bytes()).reason == "bad_signature"
    assert applied == [] and link.counts["rejected"] == 4
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 4  # one line per refusal
    assert link.on_grant(grant(11, budget_w=500.0).to_json_bytes()).applied
    assert applied == [500.0]


def test_a_rotation_accepts_the_previous_key_and_signs_with_the_current(tmp_path):
    applied: list[float] = []
    now = {"unix": NOW_S, "mono": 0.0}
    new_key = b"n" * 64
    keys = tmp_path / "rotation"
    link = link_for(
        tmp_path,
        now,
        applied,
        key_file=write_key(keys, "new", new_key),
        previous_key_file=write_key(keys, "old", key_of("gpu-01")),
    )
    assert link.on_grant(grant(5, key=key_of("gpu-01")).to_json_bytes()).applied  # old key
    assert link.on_grant(grant(6, key=new_key).to_json_bytes()).applied  # new key
    assert link.on_grant(grant(7, key=b"x" * 64).to_json_bytes()).reason == "bad_signature"
    signed = link.demand()
    assert signed is not None
    topic = "wattserve/gpu-01/demand"
    assert verify(signed, topic, KeyRing(new_key))
    assert not verify(signed, topic, KeyRing(key_of("gpu-01")))


@pytest.mark.parametrize(
    ("issued_s", "lease_s", "why"),
    [
        (NOW_S + 30.0, 10.0, "future"),  # beyond max_clock_skew_s (5 s)
        (NOW_S - 120.0, 200.0, "ago"),  # older than max_lease_s plus the skew
    ],
)
def test_a_grant_issued_outside_the_clock_window_is_refused(tmp_path, issued_s, lease_s, why):
    applied: list[float] = []
    link = link_for(tmp_path, {"unix": NOW_S, "mono": 0.0}, applied)
    verdict = link.on_grant(grant(5, issued_s=issued_s, lease_s=lease_s).to_json_bytes())
    assert verdict.reason == "stale" and applied == []


def test_demands_are_signed_with_rising_epochs(tmp_path):
    now = {"unix": NOW_S, "mono": 0.0}
    link = link_for(tmp_path, now, [])
    first, second = link.demand(), link.demand()
    assert first is not None and second is not None
    assert second.epoch > first.epoch >= int(NOW_S * 1000)
    assert first.issued_at_unix_s == NOW_S and first.expires_at_unix_s > NOW_S
    assert verify(first, "wattserve/gpu-01/demand", KeyRing(key_of("gpu-01")))
    assert not verify(first, "wattserve/gpu-02/demand", KeyRing(key_of("gpu-01")))


@pytest.mark.parametrize(
    ("mode", "ok"), [(0o600, True), (0o400, True), (0o640, False), (0o644, False)]
)
def test_a_key_file_others_may_read_is_refused_naming_it(tmp_path, mode, ok):
    path = write_key(tmp_path / "mode", "gpu-01", mode=mode)
    cfg = fleet_cfg(tmp_path, key_file=path)
    build = lambda: FleetNodeLink(  # noqa: E731
        MqttConfig(node_id="gpu-01"), cfg, demand_source=lambda: None, apply_budget=print
    )
    if ok:
        assert build().keys.current == key_of("gpu-01")
        return
    with pytest.raises(ConfigError) as refused:
        build()
    message = str(refused.value)
    assert "fleet.key_file" in message and str(path) in message and "\n" not in message


def test_a_link_without_credentials_and_tls_needs_the_waiver(tmp_path):
    with pytest.raises(ConfigError, match="insecure_lab_waiver"):
        FleetNodeLink(
            MqttConfig(node_id="gpu-01"),
            fleet_cfg(tmp_path, insecure_lab_waiver=False),
            demand_source=lambda: None,
            apply_budget=print,
        )
    with pytest.raises(ConfigError, match="mqtt.username"):
        FleetNodeLink(
            MqttConfig(node_id="gpu-01", username="gpu-02"),
            fleet_cfg(tmp_path),
            demand_source=lambda: None,
            apply_budget=print,
        )


def test_the_lease_runs_out_while_a_demand_publish_into_a_dead_link_hangs(tmp_path):
    """A dead connection never confirms a publish (aiomqtt waits for its timeout, 10 s by
    default). The node must still fall to its floor when its lease ends: the allocator gives
    its watts away after lease + grace."""

    class DeadLinkClient:
        publishes = 0

        async def publish(self, *args, **kwargs):
            DeadLinkClient.publishes += 1
            await asyncio.Event().wait()  # never confirmed

    async def body() -> list[float]:
        applied: list[float] = []
        link = FleetNodeLink(
            MqttConfig(node_id="gpu-01"),
            fleet_cfg(tmp_path, demand_interval_ms=100),
            demand_source=lambda: (snapshot(), 100.0, 700.0),
            apply_budget=lambda w, why: applied.append(w),
        )

        async def connected_to_a_dead_link() -> None:
            link._client, link.connected = DeadLinkClient(), True  # type: ignore[assignment]
            await asyncio.Event().wait()

        link._run = connected_to_a_dead_link  # type: ignore[method-assign]
        await link.start()
        now_s = time.time()
        lease = grant(1, lease_s=0.5, issued_s=now_s)
        assert link.on_grant(lease.to_json_bytes()).applied
        for _ in range(200):  # 10 s at most; the lease is 0.5 s
            if DeadLinkClient.publishes >= 1 and applied[-1] == 150.0:
                break
            await asyncio.sleep(0.05)
        await link.stop()
        return applied

    applied = asyncio.run(body())
    assert DeadLinkClient.publishes >= 1  # a demand publish was hanging meanwhile
    assert applied == [150.0, 400.0, 150.0]  # start floor, the grant, its lease's end


FLEET_ON = {"enabled": True, "safe_floor_w": 150, "key_file": "/etc/wattserve/fleet.key"}
ENFORCING = {"device": {"mode": "control"}, "controller": {"mode": "auto"}}
SECURE_MQTT = {
    "node_id": "gpu-01",
    "username": "gpu-01",
    "password_file": "/etc/wattserve/mqtt-password",
    "tls_enabled": True,
}


def test_fleet_config_is_off_by_default_and_needs_a_floor_a_key_and_mqtt():
    assert Config().fleet.enabled is False
    with pytest.raises(ConfigError, match="safe_floor_w"):
        load_config(overrides={"fleet": {"enabled": True}})
    with pytest.raises(ConfigError, match="key_file"):
        load_config(overrides={"fleet": {"enabled": True, "safe_floor_w": 150}})
    with pytest.raises(ConfigError, match="mqtt"):
        load_config(overrides={"fleet": FLEET_ON, "mqtt": {"enabled": False}, **ENFORCING})
    cfg = load_config(overrides={"fleet": FLEET_ON, "mqtt": SECURE_MQTT, **ENFORCING})
    assert cfg.fleet.safe_floor_w == 150


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"device": {"mode": "observe"}}, 'device.mode = "control"'),
        ({"controller": {"mode": "manual"}}, 'controller.mode = "auto"'),
        ({"controller": {"mode": "observe"}}, 'controller.mode = "auto"'),
        ({"mqtt": {**SECURE_MQTT, "tls_enabled": False}}, "mqtt.tls_enabled"),
        ({"mqtt": {"node_id": "gpu-01", "tls_enabled": True}}, "mqtt.password_file"),
        ({"mqtt": {**SECURE_MQTT, "username": "wattserve"}}, "mqtt.username"),
    ],
)
def test_fleet_mode_refuses_to_start_unenforced_or_unauthenticated(overrides, named):
    layers = {"fleet": FLEET_ON, "mqtt": SECURE_MQTT, **ENFORCING, **overrides}
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=layers)
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_the_lab_waiver_allows_a_plain_broker_and_says_so_at_start(tmp_path, caplog):
    cfg = load_config(
        overrides={
            "fleet": {**FLEET_ON, "insecure_lab_waiver": True},
            "mqtt": {"node_id": "gpu-01"},
            **ENFORCING,
        }
    )
    assert cfg.fleet.insecure_lab_waiver
    caplog.set_level(logging.WARNING, logger="wattserve.fleet")

    async def body() -> None:
        link = FleetNodeLink(
            MqttConfig(node_id="gpu-01", port=1, reconnect_initial_ms=10_000),
            fleet_cfg(tmp_path),
            demand_source=lambda: None,
            apply_budget=lambda w, why: None,
        )
        await link.start()
        await link.stop()

    asyncio.run(body())
    waived = [r.getMessage() for r in caplog.records if "insecure_lab_waiver" in r.getMessage()]
    assert len(waived) == 1
    assert "no broker credentials" in waived[0] and "no TLS" in waived[0]
