"""The allocator process's config, message handling and status, without a broker: what a
message must be to count (signed, fresh, newer, bounded, within its node's rate) and what
a lying node can and cannot do."""

from __future__ import annotations

import json
import logging
import random

import pytest

from tests.fleet_keys import signed_demand, write_key
from wattserve.daemon.cli import main
from wattserve.daemon.config import ConfigError
from wattserve.daemon.mqtt.payloads import MAX_FLEET_BYTES, GrantPayload, parse_grant
from wattserve.fleet.service import FleetService, load_fleet_config
from wattserve.fleet.signing import KeyRing, verify

CONFIG = """
[allocator]
site_budget_w = {budget}
period_s = 2.0
lease_s = 10.0
insecure_lab_waiver = true

[[nodes]]
node_id = "a"
floor_w = 200.0
ceiling_w = 700.0
band = 1
key_file = "{keys}/a.key"

[[nodes]]
node_id = "b"
floor_w = 200.0
ceiling_w = 700.0
key_file = "{keys}/b.key"
"""
NODE = """
[[nodes]]
node_id = "{node}"
floor_w = 150.0
ceiling_w = 700.0
key_file = "{keys}/{node}.key"
"""
NOW_S = 1_767_000_000.0


def write(tmp_path, budget=1000.0, extra=""):
    keys = tmp_path / "keys"
    for node in ("a", "b", "c", "d"):
        write_key(keys, node)
    path = tmp_path / "fleet.toml"
    path.write_text(CONFIG.format(budget=budget, keys=keys) + extra)
    return path


def make(tmp_path, now, text_edit=lambda t: t, **kw) -> FleetService:
    path = write(tmp_path, **kw)
    path.write_text(text_edit(path.read_text()))
    return FleetService(load_fleet_config(path), clock=lambda: now[0], rng=random.Random(0))


def send_demand(svc, node, now_s, epoch, **fields) -> None:
    d = signed_demand(node, now_s, epoch, **fields)
    svc.on_message(f"wattserve/{node}/demand", d.to_json_bytes())


def test_floors_over_the_site_budget_refuse_to_start(tmp_path, capsys):
    with pytest.raises(ConfigError, match="fail closed"):
        load_fleet_config(write(tmp_path, budget=399.0))
    assert main(["fleet", "--config", str(write(tmp_path, budget=399.0))]) == 2
    assert "floors sum to 400 W" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("[[nodes]]\nnode_id = 'a'\nfloor_w = 1.0\nceiling_w = 2.0\nkey_file = 'k'\n", "twice"),
        ("[oops]\n", "oops"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, extra, key):
    with pytest.raises(ConfigError, match=key):
        load_fleet_config(write(tmp_path, extra=extra))


def test_demands_become_grants_and_status(tmp_path):
    now = [NOW_S]
    svc = make(tmp_path, now)
    for node, need in (("a", 650.0), ("b", 650.0)):
        send_demand(svc, node, now[0], 1, need_w=need, goodput_per_w=2.0)
    svc.on_message("wattserve/x/demand", b"not json")  # ignored, logged
    svc.on_message("wattserve/b/telemetry", json.dumps({"device": {"power_w": 310}}).encode())
    messages = svc.round_messages()
    grants = {t: GrantPayload.model_validate_json(p) for t, p, _ in messages}
    assert set(grants) == {"wattserve/a/grant", "wattserve/b/grant"}
    # Each grant is signed with its own node's key, for its own topic.
    ring = {n: KeyRing((tmp_path / "keys" / f"{n}.key").read_bytes().strip()) for n in "ab"}
    assert verify(grants["wattserve/a/grant"], "wattserve/a/grant", ring["a"])
    assert not verify(grants["wattserve/a/grant"], "wattserve/a/grant", ring["b"])
    assert all(lease == 10.0 for *_, lease in messages)
    total = sum(g.budget_w for g in grants.values())
    assert total <= 1000.0
    assert grants["wattserve/a/grant"].expires_at_unix_s == now[0] + 10.0
    doc = svc.status()
    assert doc["nodes"]["a"]["state"] == "active"
    assert doc["nodes"]["a"]["demand"]["need_w"] == 650.0
    assert doc["headroom_w"] >= 0 and doc["role"] == "standby"


def test_the_site_meter_topic_triggers_an_emergency_cut(tmp_path):
    path = write(tmp_path)
    text = path.read_text().replace(
        "lease_s = 10.0",
        'lease_s = 10.0\nsite_meter_topic = "site/power"\nsite_meter_threshold_w = 800.0',
    )
    path.write_text(text)
    now = [NOW_S]
    svc = FleetService(load_fleet_config(path), clock=lambda: now[0], rng=random.Random(0))
    for node in ("a", "b"):
        send_demand(svc, node, now[0], 1, need_w=700.0, goodput_per_w=2.0, power_w=450.0)
    svc.round_messages()
    assert not svc.last_round.emergency
    svc.on_message("site/power", b"not a number")  # ignored
    svc.on_message("site/power", json.dumps({"power_w": 1000.0}).encode())
    messages = svc.round_messages()
    assert svc.last_round.emergency
    total = sum(GrantPayload.model_validate_json(p).budget_w for _, p, _ in messages)
    assert total <= 1000.0 * 800 * 0.95 / 1000 + 1e-6
    assert svc.status()["emergency"] is True


def test_the_allocator_refuses_to_start_without_credentials_and_tls(tmp_path):
    path = write(tmp_path)
    path.write_text(path.read_text().replace("insecure_lab_waiver = true\n", ""))
    with pytest.raises(ConfigError, match="no broker credentials.*no TLS.*insecure_lab_waiver"):
        load_fleet_config(path)
    secure = path.read_text().replace(
        "[[nodes]]",
        '[mqtt]\nusername = "fleet"\npassword_file = "/p"\ntls_enabled = true\n\n[[nodes]]',
        1,
    )
    path.write_text(secure)
    assert load_fleet_config(path).mqtt.tls_enabled


def test_a_node_key_file_others_may_read_refuses_the_start(tmp_path):
    path = write(tmp_path)
    (tmp_path / "keys" / "b.key").chmod(0o644)
    with pytest.raises(ConfigError, match=r"nodes\.b\.key_file: .*b\.key has mode 0644"):
        FleetService(load_fleet_config(path))


def test_forged_replayed_and_stale_demands_are_refused_one_line_each(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="wattserve.fleet")
    now = [NOW_S]
    svc = make(tmp_path, now)
    good = signed_demand("a", NOW_S, 5, need_w=600.0)
    svc.on_message("wattserve/a/demand", good.to_json_bytes())
    assert svc.allocator._ledgers["a"].demand.need_w == 600.0
    forged = [
        signed_demand("a", NOW_S, 6, key=b"m" * 64, need_w=700.0),  # not a's key
        signed_demand("b", NOW_S, 7, need_w=700.0).model_copy(update={"node_id": "a"}),
        signed_demand("a", NOW_S, 8, need_w=300.0).model_copy(update={"need_w": 700.0}),
        good,  # a replay: its epoch is not above the last
        signed_demand("a", NOW_S, 4, need_w=700.0),  # an older epoch
        signed_demand("a", NOW_S - 60, 9, need_w=700.0),  # expired
        signed_demand("a", NOW_S + 30, 10, need_w=700.0),  # ahead of our clock
    ]
    for d in forged:
        svc.on_message("wattserve/a/demand", d.to_json_bytes())
    # b's own demand on a's topic (as a shared broker user could publish it).
    svc.on_message("wattserve/a/demand", signed_demand("b", NOW_S, 11).to_json_bytes())
    assert svc.allocator._ledgers["a"].demand.need_w == 600.0
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == len(forged) + 1 == svc.refusals


def test_a_runaway_epoch_is_refused_and_grants_stay_parseable(tmp_path):
    """A demand whose epoch (or its grant's) has thousands of digits once raised the
    allocator's epoch above it: every later grant outgrew the nodes' 4,096-byte limit."""
    now = [NOW_S]
    svc = make(tmp_path, now)
    huge = (
        signed_demand("a", NOW_S, 1)
        .to_json_bytes()
        .replace(b'"epoch":1,', b'"epoch":' + b"9" * 5000 + b",")
    )
    svc.on_message("wattserve/a/demand", huge)
    ahead = {"epoch": 2**53 - 1, "budget_w": 400.0, "expires_at_unix_s": NOW_S + 5}
    svc.on_message("wattserve/a/demand", signed_demand("a", NOW_S, 2, grant=ahead).to_json_bytes())
    assert svc.refusals == 2
    send_demand(svc, "a", NOW_S, 3)
    send_demand(svc, "b", NOW_S, 3)
    for _, payload, _ in svc.round_messages():
        assert len(payload) < MAX_FLEET_BYTES
        assert parse_grant(payload).epoch < (NOW_S + 60) * 1000


def test_reported_floors_above_the_sites_are_clamped_and_never_overbook(tmp_path, caplog):
    """Four nodes report their floor at their ceiling (700 W) on a 1,200 W site: once they
    were all granted 700 W (2,800 W). The site's floors (150 W) hold; it is logged."""
    caplog.set_level(logging.WARNING, logger="wattserve.fleet")
    now = [NOW_S]
    four = "".join(NODE.format(node=n, keys=tmp_path / "keys") for n in ("c", "d"))
    svc = make(tmp_path, now, budget=1200.0, extra=four)
    for node in ("a", "b", "c", "d"):
        send_demand(svc, node, NOW_S, 1, floor_w=700.0, ceiling_w=700.0, need_w=700.0)
        send_demand(svc, node, NOW_S, 2, floor_w=700.0, ceiling_w=700.0, need_w=700.0)
    for _ in range(10):
        now[0] += 2.0
        for node in ("a", "b", "c", "d"):
            send_demand(svc, node, now[0], int(now[0]), floor_w=700.0, need_w=700.0)
        messages = svc.round_messages()
        assert sum(GrantPayload.model_validate_json(p).budget_w for _, p, _ in messages) <= 1200.0
        assert svc.last_round.committed_w <= 1200.0 + 1e-6
    clamps = [r.getMessage() for r in caplog.records if "clamped" in r.getMessage()]
    assert len(clamps) == 4  # once per node: the value did not change
    assert "floor_w 700.0 W" in clamps[0]


def test_a_flood_is_cut_to_the_nodes_rate_with_one_line_per_round(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="wattserve.fleet")
    now = [NOW_S]
    svc = make(tmp_path, now)
    for epoch in range(1, 201):  # 200 demands in one instant; the rate is 20/s, bursts 40
        send_demand(svc, "a", NOW_S, epoch)
    assert svc.allocator._ledgers["a"].demand is not None
    assert svc._last_demand_epoch["a"] == 40
    svc.round_messages()
    svc._log_drops()
    drops = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1 and "160 message(s) dropped" in drops[0]
    # b, a different sender, is not held back by a's flood.
    send_demand(svc, "b", NOW_S, 1)
    assert svc._last_demand_epoch["b"] == 1


@pytest.mark.parametrize(
    "topic",
    ["wattserve/a/demand", "wattserve/a/telemetry", "wattserve/_fleet/leader", "site/power"],
)
def test_deeply_nested_or_oversized_messages_are_refused_not_raised(tmp_path, topic, caplog):
    caplog.set_level(logging.WARNING, logger="wattserve.fleet")
    now = [NOW_S]
    svc = make(
        tmp_path,
        now,
        lambda t: t.replace(
            "lease_s = 10.0",
            'lease_s = 10.0\nsite_meter_topic = "site/power"\nsite_meter_threshold_w = 800.0',
        ),
    )
    svc.on_message(topic, b"[" * 2000 + b"]" * 2000)  # once a RecursionError in the reader
    svc.on_message(topic, b'{"device": {"power_w": 1}, "pad": "' + b"x" * 70_000 + b'"}')
    assert svc.refusals == 2
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 2 and ("levels deep" in lines[0]) and ("bytes" in lines[1])


def test_unknown_nodes_are_ignored_and_logged_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="wattserve.fleet")
    now = [NOW_S]
    svc = make(tmp_path, now)
    for epoch in (1, 2, 3):
        svc.on_message("wattserve/x/demand", signed_demand("x", NOW_S, epoch).to_json_bytes())
    assert "x" not in svc.allocator._ledgers
    assert [g for g in svc.round_messages() if "/x/" in g[0]] == []
    lines = [r.getMessage() for r in caplog.records if "'x'" in r.getMessage()]
    assert len(lines) == 1
