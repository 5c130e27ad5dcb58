"""The fleet over a real Mosquitto: the allocator service and node links (docs/fleet.md).

Real FleetService instances and FleetNodeLinks (the daemon's fleet connection) on a private
broker on a random loopback port; each node's demand comes from a fixed fake snapshot and
its budget sink records what it would apply. The hostile tests run on a broker with the
shipped ACL and one user per node, with a second client that tries to steer or starve the
fleet. Every wait is on a condition with a bounded timeout; nothing is timed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import time
from pathlib import Path

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.fleet_keys import key_of, signed_demand, signed_grant, write_key
from tests.mqtt_broker import USERS, Broker, run, wait_until
from wattserve.daemon.config import FleetConfig, MqttConfig
from wattserve.daemon.mqtt.payloads import (
    DeviceFigures,
    GrantPayload,
    LatencyFigures,
    TelemetryPayload,
)
from wattserve.fleet.leader import Role
from wattserve.fleet.node import FleetNodeLink
from wattserve.fleet.service import FleetService, FleetServiceConfig

SAFE_FLOOR_W = 150.0
BUDGET_W = 900.0
WAIT_S = 20.0


class FakeNode:
    """A node link whose demand is `power_w` at SLO pressure `pressure` (p99 / SLO).

    It draws `power_w` or its budget, whichever is lower, as a GPU under a power limit
    does; capped=False: it draws `power_w` whatever its budget (a limit not enforced)."""

    def __init__(
        self,
        root: Path,
        broker: Broker,
        node_id: str,
        power_w: float,
        pressure: float,
        port: int | None = None,  # another way to the broker (a relay), else the broker's
        capped: bool = True,
    ) -> None:
        self.node_id = node_id
        self.power_w, self.pressure = power_w, pressure
        self.capped = capped
        self.applied: list[float] = []
        self.link = FleetNodeLink(
            MqttConfig(
                host="127.0.0.1",
                port=port or broker.port,
                node_id=node_id,
                reconnect_initial_ms=50,
                reconnect_max_ms=300,
                **broker_login(root, broker, node_id),
            ),
            FleetConfig(
                enabled=True,
                safe_floor_w=SAFE_FLOOR_W,
                demand_interval_ms=200,
                key_file=write_key(root / "node-keys", node_id),
                insecure_lab_waiver=True,  # no TLS on the test brokers
            ),
            demand_source=self.demand,
            apply_budget=lambda w, why: self.applied.append(w),
            rng=random.Random(0),
        )

    def demand(self):
        drawn_w = self.power_w
        if self.capped:
            drawn_w = min(drawn_w, self.applied[-1] if self.applied else SAFE_FLOOR_W)
        snap = TelemetryPayload(
            device=DeviceFigures(power_w=drawn_w, power_avg_w=drawn_w),
            latency=LatencyFigures(tpot_p99_ms=100.0 * self.pressure, slo_attainment_ratio=1.0),
            policy={"ttft_slo_ms": 1000.0, "tpot_slo_ms": 100.0},
        )
        return snap, 100.0, 700.0

    @property
    def budget_w(self) -> float:
        return self.applied[-1]


def broker_login(root: Path, broker: Broker, user: str) -> dict:
    """mqtt.username and mqtt.password_file for user on a broker with passwords, else {}."""
    if broker.users is None:
        return {}
    path = root / f"{user}.password"
    path.write_text(USERS[user] + "\n")
    return {"username": user, "password_file": str(path)}


def service(broker: Broker, tmp_path: Path, instance: str, **allocator) -> FleetService:
    keys = tmp_path / "site-keys"
    cfg = FleetServiceConfig.model_validate(
        {
            "allocator": {
                "site_budget_w": BUDGET_W,
                "period_s": 1.0,
                "lease_s": 3.0,
                "grace_s": 1.0,
                "raise_step_w": 200.0,
                "instance_id": instance,
                "status_file": str(tmp_path / f"{instance}.json"),
                "insecure_lab_waiver": True,  # no TLS on the test brokers
                **allocator,
            },
            "mqtt": {
                "host": "127.0.0.1",
                "port": broker.port,
                "reconnect_initial_ms": 50,
                **broker_login(tmp_path, broker, "fleet"),
            },
            "nodes": [
                {
                    "node_id": node,
                    "floor_w": 150,
                    "ceiling_w": 700,
                    "band": band,
                    "key_file": str(write_key(keys, node)),
                }
                for node, band in (("web", 1), ("batch", 0))
            ],
        }
    )
    return FleetService(cfg, rng=random.Random(1))


class LinkCutter:
    """A loopback TCP relay to the broker that the test can cut, as a failed switch port or
    a dead uplink would: every connection through it is aborted and new ones are refused,
    while the process at the node's end (its lease keeping) runs on."""

    def __init__(self, broker_port: int) -> None:
        self.broker_port = broker_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._transports: list[asyncio.BaseTransport] = []
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.broker_port)
        except OSError:
            writer.transport.abort()
            return
        self._transports += [writer.transport, up_writer.transport]
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ]
        self._pipes.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while chunk := await src.read(65536):
                dst.write(chunk)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.transport.abort()

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()  # no new connections
        for transport in self._transports:
            transport.abort()
        for task in self._pipes:
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)


def site_sums(nodes: list[FakeNode]) -> list[float]:
    """The sum of the budgets in force after every change, whichever node changed."""
    events = sorted((t, n.node_id, w) for n in nodes for t, w in getattr(n, "timeline", []))
    now: dict[str, float] = {}
    sums = []
    for _, node, w in events:
        now[node] = w
        sums.append(sum(now.values()))
    return sums


def timed(node: FakeNode) -> None:
    node.timeline = []  # type: ignore[attr-defined]
    sink = node.link._apply_budget

    def record(w: float, why: str) -> None:
        node.timeline.append((time.monotonic(), w))  # type: ignore[attr-defined]
        sink(w, why)

    node.link._apply_budget = record


def test_grants_follow_load_within_the_budget_and_leases_expire_to_the_floor(broker, tmp_path):
    async def body() -> None:
        web = FakeNode(tmp_path, broker, "web", power_w=400.0, pressure=1.4)  # needs ~616 W
        batch = FakeNode(tmp_path, broker, "batch", power_w=400.0, pressure=1.4)
        for n in (web, batch):
            timed(n)
            await n.link.start()
        alloc = service(broker, tmp_path, "a")
        stop = asyncio.Event()
        task = asyncio.create_task(alloc.run(stop))
        # web (band 1) gets its need; batch the rest of the 900 W.
        await wait_until(lambda: web.applied and web.budget_w > 600, WAIT_S)
        await wait_until(lambda: batch.applied and 250 < batch.budget_w <= 300, WAIT_S)
        assert alloc.leadership.role is Role.LEADER
        # web's load falls: its grant is cut and batch's grows into the freed watts.
        web.power_w, web.pressure = 150.0, 0.8
        await wait_until(lambda: web.budget_w < 300, WAIT_S)
        await wait_until(lambda: batch.budget_w > 550, WAIT_S)
        status = (tmp_path / "a.json").read_text()
        assert '"role": "leader"' in status and '"web"' in status
        # The allocator stops: every node drops to its safe floor when its lease runs out.
        stop.set()
        await task
        await wait_until(lambda: web.budget_w == batch.budget_w == SAFE_FLOOR_W, WAIT_S)
        for n in (web, batch):
            await n.link.stop()
            # At least once: on a loaded machine a late round may let a lease lapse earlier.
            assert n.link.counts["lease_expired"] >= 1
        assert max(site_sums([web, batch])) <= BUDGET_W + 1e-6

    run(body, 120)


def test_a_stale_retained_grant_is_never_applied(broker, tmp_path):
    async def body() -> None:
        # An expired grant, signed, left retained by a publisher that set no message expiry.
        stale = signed_grant(
            "stale",
            budget_w=690.0,
            epoch=10**15,
            expires_at_unix_s=time.time() - 5,
            issued_at_unix_s=time.time() - 15,
        )
        async with aiomqtt.Client(
            "127.0.0.1", broker.port, protocol=aiomqtt.ProtocolVersion.V5
        ) as c:
            await c.publish("wattserve/stale/grant", stale.to_json_bytes(), qos=1, retain=True)
            # And one with a message expiry that has passed by the time the node connects.
            props = Properties(PacketTypes.PUBLISH)
            props.MessageExpiryInterval = 1
            await c.publish(
                "wattserve/other/grant",
                stale.to_json_bytes(),
                qos=1,
                retain=True,
                properties=props,
            )
        node = FakeNode(tmp_path, broker, "stale", 300.0, 1.0)
        await node.link.start()
        await wait_until(lambda: node.link.counts["rejected"] >= 1, WAIT_S)
        assert node.applied == [SAFE_FLOOR_W]  # the start's safe floor, nothing else
        await node.link.stop()

    run(body, 60)


def test_a_standby_stays_passive_and_takes_over_when_the_leader_stops(broker, tmp_path):
    async def body() -> None:
        nodes = [
            FakeNode(tmp_path, broker, "web", 300.0, 1.0),
            FakeNode(tmp_path, broker, "batch", 300.0, 1.0),
        ]
        for n in nodes:
            await n.link.start()
        first, second = service(broker, tmp_path, "one"), service(broker, tmp_path, "two")
        stop_first, stop_second = asyncio.Event(), asyncio.Event()
        t1 = asyncio.create_task(first.run(stop_first))
        await wait_until(lambda: first.leadership.role is Role.LEADER, WAIT_S)
        t2 = asyncio.create_task(second.run(stop_second))
        await wait_until(lambda: second.leadership.role is Role.STANDBY and first.rounds > 3)
        rounds_before = first.rounds
        await wait_until(lambda: first.rounds > rounds_before + 3, WAIT_S)
        assert second.rounds == 0 and second.leadership.role is Role.STANDBY
        stop_first.set()
        await t1
        await wait_until(lambda: second.leadership.role is Role.LEADER, WAIT_S)
        await wait_until(lambda: second.rounds > 2, WAIT_S)
        stop_second.set()
        await t2
        for n in nodes:
            await n.link.stop()

    run(body, 120)


def test_a_broker_restart_is_survived(own_broker, tmp_path):
    async def body() -> None:
        own_broker.start()
        web = FakeNode(tmp_path, own_broker, "web", power_w=400.0, pressure=1.4)
        batch = FakeNode(tmp_path, own_broker, "batch", power_w=400.0, pressure=1.4)
        for n in (web, batch):
            await n.link.start()
        alloc = service(own_broker, tmp_path, "a")
        stop = asyncio.Event()
        task = asyncio.create_task(alloc.run(stop))
        await wait_until(lambda: web.link.counts["applied"] >= 1, WAIT_S)
        await asyncio.to_thread(own_broker.kill)  # state lost: no retained grant survives
        await wait_until(lambda: not web.link.connected, WAIT_S)
        # No broker, no grants: every node runs out its lease to the safe floor.
        await wait_until(lambda: web.budget_w == batch.budget_w == SAFE_FLOOR_W, WAIT_S)
        await asyncio.to_thread(own_broker.start)
        # Everyone reconnects; the allocator claims again and grants come back.
        await wait_until(lambda: web.budget_w > 600 and batch.budget_w > SAFE_FLOOR_W, WAIT_S)
        assert alloc.leadership.role is Role.LEADER
        stop.set()
        await task
        for n in (web, batch):
            await n.link.stop()

    run(body, 120)


def test_a_cut_node_falls_to_its_floor_and_is_charged_until_lease_and_grace(broker, tmp_path):
    """The link between one node and the broker dies (the node runs on). The node drops to
    its safe floor when its lease runs out; the allocator charges it max(last grant, last
    seen power) from when it goes silent until its last lease plus the grace, so the other
    node is held below the budget less that charge; then it is released to its floor and
    the other node grows into the freed watts."""
    lease_s, grace_s, measured_w = 3.0, 4.0, 650.0

    async def body() -> None:
        relay = LinkCutter(broker.port)
        await relay.start()
        # web draws 650 W at low pressure, whatever its grant (its limit is not enforced): it
        # needs 650 x 0.5 x 1.1 = 357.5 W, less than it draws. batch asks for its ceiling.
        web = FakeNode(
            tmp_path, broker, "web", measured_w, pressure=0.5, port=relay.port, capped=False
        )
        batch = FakeNode(tmp_path, broker, "batch", power_w=400.0, pressure=2.0)
        for n in (web, batch):
            timed(n)
            await n.link.start()
        alloc = service(broker, tmp_path, "cut", lease_s=lease_s, grace_s=grace_s)
        rounds = []
        inner = alloc.allocator.round

        def recording(now_s: float):
            result = inner(now_s)
            rounds.append(result)
            return result

        alloc.allocator.round = recording  # type: ignore[method-assign]
        stop = asyncio.Event()
        task = asyncio.create_task(alloc.run(stop))
        # web (band 1) gets its need; it is charged what it draws, and batch has the rest.
        await wait_until(lambda: web.applied and 340 <= web.budget_w <= 380, WAIT_S)
        await wait_until(lambda: batch.applied and len(rounds) >= 5, WAIT_S)
        assert rounds[-1].nodes["web"].charge_w == measured_w
        assert batch.budget_w <= BUDGET_W - measured_w + 1e-6

        await relay.cut()
        cut_round = len(rounds)
        # The node: no grant reaches it any more; its lease runs out to the safe floor.
        await wait_until(lambda: not web.link.connected, WAIT_S)
        await wait_until(lambda: web.link.gate.in_force is None, WAIT_S)
        assert web.budget_w == SAFE_FLOOR_W and web.link.counts["lease_expired"] >= 1
        # The allocator: web goes silent, stays charged, and is released after lease + grace.
        await wait_until(lambda: rounds[-1].nodes["web"].state == "released", 3 * WAIT_S)
        await wait_until(lambda: batch.budget_w > 600, WAIT_S)  # into the freed watts
        stop.set()
        await task
        for n in (web, batch):
            await n.link.stop()

        after = rounds[cut_round:]
        issued = [g for r in rounds for g in r.grants if g.node_id == "web"]
        last = issued[-1]  # the last grant issued to web, whether or not it arrived
        silent = [r for r in after if r.nodes["web"].state == "silent"]
        released = [r for r in after if r.nodes["web"].state == "released"]
        assert silent and released
        for r in silent:
            assert r.nodes["web"].charge_w == max(last.budget_w, measured_w) == measured_w
            assert r.nodes["web"].grant_w is None  # no grant for a silent node
            # The hard partition holds the silent node's charge: batch gets at most the rest.
            assert r.nodes["batch"].grant_w <= BUDGET_W - measured_w + 1e-6
            assert r.time_s < last.expires_s + grace_s
        first_released = released[0]
        assert first_released.time_s >= last.expires_s + grace_s
        assert max(r.time_s for r in silent) < first_released.time_s
        for r in released:
            assert r.nodes["web"].charge_w == 150.0  # its floor
        # Whatever the order of the changes, the limits in force never summed above it.
        assert max(site_sums([web, batch])) <= BUDGET_W + 1e-6

    run(body, 120)


# ---- a hostile client of the broker, the shipped ACL ---------------------------------------


async def as_user(broker: Broker, user: str, publish: list[tuple[str, bytes, bool]]) -> None:
    """Publish as one broker user (QoS 1: the broker acknowledges even what its ACL drops)."""
    async with aiomqtt.Client(
        "127.0.0.1",
        broker.port,
        username=user,
        password=USERS[user],
        protocol=aiomqtt.ProtocolVersion.V5,
    ) as c:
        for topic, payload, retain in publish:
            await c.publish(topic, payload, qos=1, retain=retain)


def test_a_hostile_client_can_neither_steer_nor_starve_the_fleet(auth_broker, tmp_path, caplog):
    """With the shipped ACL (one broker user per node) and signed messages: another broker
    user cannot write a node's grant or demand; a node cannot write another node's; a
    client with the allocator's own broker login cannot forge a grant a node accepts; and
    one node's runaway epoch, deeply nested telemetry and flood of demands do not deafen
    or derail the allocator: grants keep coming within the budget."""
    caplog.set_level(logging.WARNING, logger="wattserve.fleet")
    broker = auth_broker

    async def body() -> None:
        web = FakeNode(tmp_path, broker, "web", power_w=400.0, pressure=1.4)  # needs ~616 W
        batch = FakeNode(tmp_path, broker, "batch", power_w=400.0, pressure=1.4)
        for n in (web, batch):
            timed(n)
            await n.link.start()
        alloc = service(broker, tmp_path, "guarded")
        stop = asyncio.Event()
        task = asyncio.create_task(alloc.run(stop))
        await wait_until(lambda: web.applied and web.budget_w > 600, WAIT_S)
        await wait_until(lambda: batch.applied and batch.budget_w > SAFE_FLOOR_W, WAIT_S)
        now_s = time.time()
        forged = signed_grant(
            "web",
            key=b"m" * 64,
            budget_w=690.0,
            epoch=10**15,
            expires_at_unix_s=now_s + 3600,
            issued_at_unix_s=now_s,
        ).to_json_bytes()
        starve_web = signed_demand("web", now_s, 10**14, key=key_of("batch"), need_w=0.0)
        # Another user of the broker: neither web's grant nor its demand (ACL).
        await as_user(
            broker,
            "mallory",
            [
                ("wattserve/web/grant", forged, True),
                ("wattserve/web/demand", starve_web.to_json_bytes(), False),
            ],
        )
        # A node, batch, lying: about web (ACL), and about itself (refused by the allocator).
        runaway = signed_demand("batch", now_s, 1).to_json_bytes()
        runaway = runaway.replace(b'"epoch":1,', b'"epoch":' + b"9" * 3000 + b",")
        nested = b"[" * 2000 + b"]" * 2000
        flood = [
            ("wattserve/batch/demand", signed_demand("batch", now_s, 20 + i).to_json_bytes(), False)
            for i in range(300)
        ]
        await as_user(
            broker,
            "batch",
            [
                ("wattserve/web/grant", forged, True),
                ("wattserve/web/demand", starve_web.to_json_bytes(), False),
                ("wattserve/batch/demand", runaway, False),
                ("wattserve/batch/telemetry", nested, False),
                *flood,
            ],
        )
        # The allocator's own broker login (a broker admin, a leaked password) may write
        # grants: a grant it cannot sign with web's key is still refused by web.
        rejected_before = web.link.counts["rejected"]
        unsigned = GrantPayload.model_validate_json(forged).model_copy(update={"sig": ""})
        await as_user(broker, "fleet", [("wattserve/web/grant", forged, False)])
        await as_user(broker, "fleet", [("wattserve/web/grant", unsigned.to_json_bytes(), False)])
        await wait_until(lambda: web.link.counts["rejected"] >= rejected_before + 2, WAIT_S)
        # The allocator still hears and leads: fresh grants keep reaching both nodes.
        applied_before = {n.node_id: len(n.applied) for n in (web, batch)}
        await wait_until(
            lambda: all(len(n.applied) >= applied_before[n.node_id] + 3 for n in (web, batch)),
            WAIT_S,
        )
        assert alloc.leadership.role is Role.LEADER
        assert 690.0 not in web.applied
        assert web.budget_w > 600  # not starved by the demand spoofed for it
        stop.set()
        await task
        for n in (web, batch):
            await n.link.stop()
        assert max(site_sums([web, batch])) <= BUDGET_W + 1e-6

    run(body, 120)
    lines = [r.getMessage() for r in caplog.records]
    assert any("levels deep" in m for m in lines)  # the nested telemetry, refused
    assert any("wattserve/batch/demand refused: invalid" in m for m in lines)  # runaway
    assert any("dropped" in m and "batch" in m for m in lines)  # the flood, rate-limited
    assert any("grant refused" in m and "bad signature" in m for m in lines)
    assert not any("/web/demand refused" in m for m in lines)  # the ACL kept those out


def test_only_the_site_meter_writes_its_topic_and_the_allocator_hears_it(auth_broker, tmp_path):
    broker = auth_broker
    meter = "site/rack-a/power"

    async def body() -> None:
        web = FakeNode(tmp_path, broker, "web", power_w=450.0, pressure=2.0)
        batch = FakeNode(tmp_path, broker, "batch", power_w=450.0, pressure=2.0)
        for n in (web, batch):
            await n.link.start()
        alloc = service(
            broker,
            tmp_path,
            "metered",
            site_meter_topic=meter,
            site_meter_threshold_w=800.0,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(alloc.run(stop))
        await wait_until(lambda: alloc.rounds >= 3 and web.applied and web.budget_w > 450)
        reading = json.dumps({"power_w": 5000.0}).encode()
        for user in ("mallory", "web", "viewer"):
            await as_user(broker, user, [(meter, reading, False)])
        rounds = alloc.rounds
        await wait_until(lambda: alloc.rounds >= rounds + 3, WAIT_S)
        assert alloc.last_round is not None and not alloc.last_round.emergency
        await as_user(broker, "site-meter", [(meter, reading, False)])
        await wait_until(lambda: alloc.last_round.emergency, WAIT_S)
        granted = sum(g.budget_w for g in alloc.last_round.grants)
        assert granted <= BUDGET_W * 800 * 0.95 / 5000 + 2 * 150 + 1e-6  # cut, to the floors
        stop.set()
        await task
        for n in (web, batch):
            await n.link.stop()

    run(body, 120)


def test_the_allocator_pings_the_watchdog_and_reads_on_after_a_failing_message(
    broker, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.ERROR, logger="wattserve.fleet")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    received: list[bytes] = []

    def drain() -> list[bytes]:
        while True:
            try:
                received.append(notify.recv(4096))
            except BlockingIOError:
                return received

    async def body() -> None:
        web = FakeNode(tmp_path, broker, "web", 300.0, 1.0)
        await web.link.start()
        alloc = service(broker, tmp_path, "dog")
        failures = []
        observe_power = alloc.allocator.observe_power

        def failing_power(node_id: str, power_w: float) -> None:
            if power_w != 301.0:  # the test's telemetry only, not the node's demands
                return observe_power(node_id, power_w)
            failures.append(node_id)
            raise RuntimeError("a bug in handling one message")

        alloc.allocator.observe_power = failing_power  # type: ignore[method-assign]
        stop = asyncio.Event()
        task = asyncio.create_task(alloc.run(stop))
        await wait_until(lambda: alloc.leadership.role is Role.LEADER, WAIT_S)
        telemetry = json.dumps({"device": {"power_w": 301.0}}).encode()
        async with aiomqtt.Client("127.0.0.1", broker.port) as c:
            await c.publish("wattserve/web/telemetry", telemetry, qos=1)
            await wait_until(lambda: failures, WAIT_S)
            await c.publish("wattserve/web/telemetry", telemetry, qos=1)
        await wait_until(lambda: len(failures) >= 2, WAIT_S)  # the reader read on
        applied = web.link.counts["applied"] + web.link.counts["renewed"]
        await wait_until(
            lambda: web.link.counts["applied"] + web.link.counts["renewed"] >= applied + 2
        )
        await wait_until(lambda: drain().count(b"WATCHDOG=1") >= 3, WAIT_S)
        stop.set()
        await task
        await web.link.stop()

    try:
        run(body, 60)
    finally:
        notify.close()
    assert any(m.startswith(b"READY=1") for m in received)
    failed = [r for r in caplog.records if "failed; reading on" in r.getMessage()]
    assert len(failed) == 2
