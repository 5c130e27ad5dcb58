"""The node's side of the fleet: which grant is in force, the demand, the [fleet] config."""

from __future__ import annotations

import asyncio
import time

import pytest

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

NOW_S = 1_767_000_000.0


def grant(epoch: int, budget_w: float = 400.0, lease_s: float = 10.0, node: str = "gpu-01"):
    return GrantPayload(
        node_id=node,
        budget_w=budget_w,
        epoch=epoch,
        expires_at_unix_s=NOW_S + lease_s,
        issued_at_unix_s=NOW_S,
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


def test_fleet_link_applies_grants_through_its_budget_sink_only_when_they_change():
    applied: list[tuple[float, str]] = []
    now = {"unix": NOW_S, "mono": 0.0}
    link = FleetNodeLink(
        MqttConfig(node_id="gpu-01"),
        FleetConfig(enabled=True, safe_floor_w=150.0),
        demand_source=lambda: None,
        apply_budget=lambda w, why: applied.append((w, why)),
        clock=lambda: now["unix"],
        monotonic=lambda: now["mono"],
    )
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
    assert [w for w, _ in applied] == [400.0, 150.0]
    assert link.counts == {"applied": 1, "renewed": 1, "rejected": 2, "lease_expired": 1}
    status = link.status()
    assert status["budget_w"] == 150.0 and status["grant"] is None
    assert status["source"] == "safe_floor_lease_expired" and status["lease_left_s"] is None


def test_the_lease_runs_out_while_a_demand_publish_into_a_dead_link_hangs():
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
            FleetConfig(enabled=True, safe_floor_w=150.0, demand_interval_ms=100),
            demand_source=lambda: (snapshot(), 100.0, 700.0),
            apply_budget=lambda w, why: applied.append(w),
        )

        async def connected_to_a_dead_link() -> None:
            link._client, link.connected = DeadLinkClient(), True  # type: ignore[assignment]
            await asyncio.Event().wait()

        link._run = connected_to_a_dead_link  # type: ignore[method-assign]
        await link.start()
        now_s = time.time()
        lease = GrantPayload(
            node_id="gpu-01",
            budget_w=400.0,
            epoch=1,
            expires_at_unix_s=now_s + 0.5,
            issued_at_unix_s=now_s,
        )
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


def test_fleet_config_is_off_by_default_and_needs_a_floor_and_mqtt():
    assert Config().fleet.enabled is False
    with pytest.raises(ConfigError, match="safe_floor_w"):
        load_config(overrides={"fleet": {"enabled": True}})
    with pytest.raises(ConfigError, match="mqtt"):
        load_config(
            overrides={"fleet": {"enabled": True, "safe_floor_w": 150}, "mqtt": {"enabled": False}}
        )
    cfg = load_config(overrides={"fleet": {"enabled": True, "safe_floor_w": 150}})
    assert cfg.fleet.safe_floor_w == 150
