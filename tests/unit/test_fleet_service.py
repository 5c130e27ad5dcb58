"""The allocator process's config, message handling and status, without a broker."""

from __future__ import annotations

import json
import random

import pytest

from wattserve.daemon.cli import main
from wattserve.daemon.config import ConfigError
from wattserve.daemon.mqtt.payloads import DemandPayload, GrantPayload
from wattserve.fleet.service import FleetService, load_fleet_config

CONFIG = """
[allocator]
site_budget_w = {budget}
period_s = 2.0
lease_s = 10.0

[[nodes]]
node_id = "a"
floor_w = 200.0
ceiling_w = 700.0
band = 1

[[nodes]]
node_id = "b"
floor_w = 200.0
ceiling_w = 700.0
"""


def write(tmp_path, budget=1000.0, extra=""):
    path = tmp_path / "fleet.toml"
    path.write_text(CONFIG.format(budget=budget) + extra)
    return path


def test_floors_over_the_site_budget_refuse_to_start(tmp_path, capsys):
    with pytest.raises(ConfigError, match="fail closed"):
        load_fleet_config(write(tmp_path, budget=399.0))
    assert main(["fleet", "--config", str(write(tmp_path, budget=399.0))]) == 2
    assert "floors sum to 400 W" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("[[nodes]]\nnode_id = 'a'\nfloor_w = 1.0\nceiling_w = 2.0\n", "twice"),
        ("[oops]\n", "oops"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, extra, key):
    with pytest.raises(ConfigError, match=key):
        load_fleet_config(write(tmp_path, extra=extra))


def test_demands_become_grants_and_status(tmp_path):
    now = [1_767_000_000.0]
    svc = FleetService(
        load_fleet_config(write(tmp_path)), clock=lambda: now[0], rng=random.Random(0)
    )
    for node, need in (("a", 650.0), ("b", 650.0)):
        d = DemandPayload(
            node_id=node,
            time_unix_s=now[0],
            need_w=need,
            goodput_per_w=2.0,
            floor_w=150.0,
            ceiling_w=700.0,
            power_w=300.0,
        )
        svc.on_message(f"wattserve/{node}/demand", d.to_json_bytes())
    svc.on_message("wattserve/x/demand", b"not json")  # ignored, logged
    svc.on_message("wattserve/b/telemetry", json.dumps({"device": {"power_w": 310}}).encode())
    messages = svc.round_messages()
    grants = {t: GrantPayload.model_validate_json(p) for t, p, _ in messages}
    assert set(grants) == {"wattserve/a/grant", "wattserve/b/grant"}
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
    now = [1_767_000_000.0]
    svc = FleetService(load_fleet_config(path), clock=lambda: now[0], rng=random.Random(0))
    for node in ("a", "b"):
        d = DemandPayload(
            node_id=node,
            time_unix_s=now[0],
            need_w=700.0,
            goodput_per_w=2.0,
            floor_w=200.0,
            ceiling_w=700.0,
            power_w=450.0,
        )
        svc.on_message(f"wattserve/{node}/demand", d.to_json_bytes())
    svc.round_messages()
    assert not svc.last_round.emergency
    svc.on_message("site/power", b"not a number")  # ignored
    svc.on_message("site/power", json.dumps({"power_w": 1000.0}).encode())
    messages = svc.round_messages()
    assert svc.last_round.emergency
    total = sum(GrantPayload.model_validate_json(p).budget_w for _, p, _ in messages)
    assert total <= 1000.0 * 800 * 0.95 / 1000 + 1e-6
    assert svc.status()["emergency"] is True
