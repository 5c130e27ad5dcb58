"""Two real daemons (tiny random Llama, virtual GPUs) and the fleet allocator on a real
Mosquitto: grants become each node's power budget through the policy path, an HTTP PUT
above the grant is put back at the next renewal, a stale retained grant is never applied,
and with the allocator gone every node drops to its safe floor at lease expiry. Every wait
is on a condition with a bounded timeout; nothing is timed.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiomqtt
import httpx

from tests.fleet_keys import signed_grant, write_key
from tests.integration.test_mqtt_daemon import AUTH, daemon_config, serving
from tests.mqtt_broker import Recorder, run, wait_until
from wattserve.daemon.config import Config
from wattserve.fleet.leader import Role
from wattserve.fleet.service import FleetService, FleetServiceConfig

BUDGET_W = 900.0
SAFE_FLOOR_W = 250.0
STALE_W = 690.0
WAIT_S = 30.0


def fleet_daemon_config(port, node, tmp_path):
    cfg = daemon_config(port, node, tmp_path / node)
    fleet = {
        "enabled": True,
        "safe_floor_w": SAFE_FLOOR_W,
        "demand_interval_ms": 200,
        "key_file": write_key(tmp_path / "keys", node),
        "insecure_lab_waiver": True,  # an anonymous broker without TLS
    }
    # Validated as a whole, as the daemon's start does (control and auto modes).
    return Config.model_validate({**cfg.model_dump(), "fleet": fleet})


def allocator(port: int, tmp_path) -> FleetService:
    cfg = FleetServiceConfig.model_validate(
        {
            "allocator": {
                "site_budget_w": BUDGET_W,
                "period_s": 1.0,
                "lease_s": 3.0,
                "grace_s": 1.0,
                "raise_step_w": 500.0,
                "instance_id": "test",
                "insecure_lab_waiver": True,
            },
            "mqtt": {"host": "127.0.0.1", "port": port, "reconnect_initial_ms": 50},
            "nodes": [
                {
                    "node_id": node,
                    "floor_w": 250,
                    "ceiling_w": 700,
                    "band": band,
                    "key_file": str(tmp_path / "keys" / f"{node}.key"),
                }
                for node, band in (("fa", 1), ("fb", 0))
            ],
        }
    )
    return FleetService(cfg, rng=random.Random(0))


def fleet_status(srv) -> dict:
    r = httpx.get(f"{srv.base_url}/v1/status")
    return r.json()["server"]["fleet"]


def test_daemons_run_under_their_grants_and_fall_to_the_floor(broker, tmp_path, tiny_llama):
    async def body() -> None:
        stale = signed_grant(
            "fa",
            budget_w=STALE_W,
            epoch=10**15,
            expires_at_unix_s=time.time() - 1,
            issued_at_unix_s=time.time() - 11,
        )
        async with aiomqtt.Client("127.0.0.1", broker.port) as c:
            await c.publish("wattserve/fa/grant", stale.to_json_bytes(), qos=1, retain=True)
        async with (
            Recorder(broker, "wattserve/+/events") as sub,
            serving(fleet_daemon_config(broker.port, "fa", tmp_path), tiny_llama) as a,
            serving(fleet_daemon_config(broker.port, "fb", tmp_path), tiny_llama) as b,
        ):
            links = {"fa": a.daemon.fleet, "fb": b.daemon.fleet}
            assert all(link is not None for link in links.values())
            await wait_until(lambda: links["fa"].counts["rejected"] >= 1, WAIT_S)
            alloc = allocator(broker.port, tmp_path)
            stop = asyncio.Event()
            task = asyncio.create_task(alloc.run(stop))
            await wait_until(lambda: all(x.gate.in_force for x in links.values()), WAIT_S)
            assert alloc.leadership.role is Role.LEADER
            for srv, node in ((a, "fa"), (b, "fb")):
                link = links[node]
                await wait_until(
                    lambda s=srv, x=link: (
                        x.gate.in_force is not None
                        and s.daemon.state.policy.power_budget_w == x.gate.in_force.budget_w
                    ),
                    WAIT_S,
                )
                status = await asyncio.to_thread(fleet_status, srv)
                assert status["enabled"] and status["safe_floor_w"] == SAFE_FLOOR_W
                loop = srv.daemon.state.control_loop
                assert (
                    loop.controller.policy.power_budget_w == srv.daemon.state.policy.power_budget_w
                )
            # An HTTP PUT above the grant is in force until the next renewal puts it back.
            policy = await asyncio.to_thread(
                lambda: httpx.get(f"{a.base_url}/v1/control/policy", headers=AUTH).json()
            )
            r = await asyncio.to_thread(
                lambda: httpx.put(
                    f"{a.base_url}/v1/control/policy",
                    json={**policy, "power_budget_w": 699.0},
                    headers=AUTH,
                )
            )
            assert r.status_code == 200 and a.daemon.state.policy.power_budget_w == 699.0
            await wait_until(
                lambda: (
                    links["fa"].gate.in_force is not None
                    and a.daemon.state.policy.power_budget_w == links["fa"].gate.in_force.budget_w
                ),
                WAIT_S,
            )
            granted = {n: x.gate.budget_w() for n, x in links.items()}
            assert sum(granted.values()) <= BUDGET_W + 1e-6
            # Both idle at their floors' need: the surplus goes to fa's higher band first.
            assert granted["fa"] > granted["fb"] >= SAFE_FLOOR_W
            # The allocator stops: both nodes fall to the safe floor when their leases end.
            stop.set()
            await task
            # (fb's grant may equal the floor: wait for the leases to lapse, not the budget.)
            await wait_until(lambda: all(x.gate.in_force is None for x in links.values()), WAIT_S)
            assert all(x.counts["lease_expired"] >= 1 for x in links.values())
            await wait_until(
                lambda: all(s.daemon.state.policy.power_budget_w == SAFE_FLOOR_W for s in (a, b)),
                WAIT_S,
            )
            changes = [
                m.json()
                for m in sub.messages
                if m.json().get("kind") == "policy_changed"
                and m.json()["data"].get("changed_by") == "fleet"
            ]
            budgets = {c["data"]["policy"]["power_budget_w"] for c in changes}
            assert STALE_W not in budgets and SAFE_FLOOR_W in budgets
            assert max(budgets) <= 700.0  # the PUT's 699 W is "http", not "fleet"

    run(body, 180)
