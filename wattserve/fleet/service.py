"""`wattserve fleet`: the allocator process that shares one site budget (docs/fleet.md).

It reads its own TOML file ([allocator], [mqtt], [[nodes]]), connects to the broker over
MQTT 5, listens to every node's `demand` and `telemetry`, the leader claim and the optional
site meter, and once per period, while it is the leader (wattserve.fleet.leader), runs one
allocation round (wattserve.fleet.allocator) and publishes each grant retained with a message expiry
equal to the lease; it writes the round to a JSON status file. The decisions are the pure
core's; this module only wires them to the broker, the clock and the file system. It must
not talk to a node any other way than through the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import socket
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from wattserve.daemon.config import ConfigError, MqttConfig
from wattserve.daemon.mqtt.link import Backoff, read_password_file, tls_context
from wattserve.daemon.mqtt.payloads import DemandPayload, GrantPayload, Topics
from wattserve.fleet.allocator import (
    Allocator,
    AllocatorParams,
    Demand,
    FleetConfigError,
    NodeSpec,
    Round,
)
from wattserve.fleet.leader import Leadership, Role

log = logging.getLogger("wattserve.fleet")

FLEET_LEVEL = "_fleet"  # a topic level no node id can take (node ids start alphanumeric)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AllocatorSection(_Section):
    """[allocator]: the site budget and the pace. Watts and seconds."""

    site_budget_w: float = Field(..., gt=0)
    period_s: float = Field(2.0, ge=1.0, le=5.0)
    lease_s: float = Field(10.0, gt=0)
    grace_s: float = Field(5.0, ge=0)
    demand_timeout_s: float | None = Field(None, description="Unset: 3 periods.")
    hysteresis_w: float = Field(10.0, ge=0)
    raise_step_w: float = Field(50.0, gt=0)
    raise_jitter_ratio: float = Field(0.5, ge=0, lt=1)
    fair_share_ratio: float = Field(
        1.0, ge=0, le=1, description="x site_budget_w / nodes: owed before water-filling."
    )
    site_meter_topic: str | None = Field(
        None, description='Measured site power: {"power_w": x} or a bare number.'
    )
    site_meter_threshold_w: float | None = Field(None, gt=0)
    emergency_margin_ratio: float = Field(0.05, ge=0, lt=1)
    emergency_hold_s: float = Field(10.0, ge=0)
    instance_id: str | None = Field(None, description="Unset: the hostname and the pid.")
    status_file: Path | None = Field(None, description="The JSON status, rewritten each round.")

    @model_validator(mode="after")
    def _check(self) -> AllocatorSection:
        if self.lease_s <= self.period_s:
            raise ValueError("lease_s must exceed period_s")
        if (self.site_meter_topic is None) != (self.site_meter_threshold_w is None):
            raise ValueError("site_meter_topic and site_meter_threshold_w go together")
        return self


class NodeSection(_Section):
    node_id: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    floor_w: float = Field(..., gt=0, description="At least the node's fleet.safe_floor_w.")
    ceiling_w: float = Field(..., gt=0)
    band: int = Field(0, ge=0, le=9, description="Priority band: higher is cut last.")


class FleetServiceConfig(_Section):
    allocator: AllocatorSection
    mqtt: MqttConfig = MqttConfig()
    nodes: list[NodeSection] = Field(..., min_length=1)

    @model_validator(mode="after")
    def _check_nodes(self) -> FleetServiceConfig:
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError("nodes: a node_id appears twice")
        floors_w = sum(n.floor_w for n in self.nodes)
        if floors_w > self.allocator.site_budget_w:
            raise ValueError(
                f"node floors sum to {floors_w:g} W, over allocator.site_budget_w "
                f"{self.allocator.site_budget_w:g} W: refusing to start (fail closed)"
            )
        return self

    def params(self) -> AllocatorParams:
        a = self.allocator
        return AllocatorParams(
            site_budget_w=a.site_budget_w,
            period_s=a.period_s,
            lease_s=a.lease_s,
            grace_s=a.grace_s,
            demand_timeout_s=a.demand_timeout_s or 3 * a.period_s,
            hysteresis_w=a.hysteresis_w,
            raise_step_w=a.raise_step_w,
            raise_jitter_ratio=a.raise_jitter_ratio,
            fair_share_ratio=a.fair_share_ratio,
            site_meter_threshold_w=a.site_meter_threshold_w,
            site_meter_timeout_s=3 * a.period_s,
            emergency_margin_ratio=a.emergency_margin_ratio,
            emergency_hold_s=a.emergency_hold_s,
        )

    def specs(self) -> list[NodeSpec]:
        return [NodeSpec(n.node_id, n.floor_w, n.ceiling_w, n.band) for n in self.nodes]


def load_fleet_config(path: str | Path) -> FleetServiceConfig:
    """The allocator's config file; ConfigError (one line naming the key) when it is bad."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config error: {path}: file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config error: {path}: invalid TOML: {e}") from None
    try:
        return FleetServiceConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "(top level)"
        msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        raise ConfigError(f"config error: {key}: {msg} (in {path})") from None


def status_document(result: Round | None, role: Role, instance_id: str, budget_w: float) -> dict:
    """The JSON status: role, site budget and headroom, and per node its grant and demand."""
    doc: dict[str, Any] = {
        "schema": 1,
        "instance_id": instance_id,
        "role": role.value,
        "site_budget_w": budget_w,
        "time_unix_s": None,
        "nodes": {},
    }
    if result is None:
        return doc
    doc.update(
        time_unix_s=result.time_s,
        epoch=result.epoch,
        committed_w=round(result.committed_w, 3),
        headroom_w=round(result.headroom_w, 3),
        granted_w=round(sum(g.budget_w for g in result.grants), 3),
        emergency=result.emergency,
        infeasible=result.infeasible,
    )
    for node, line in result.nodes.items():
        d = line.demand
        doc["nodes"][node] = {
            "state": line.state,
            "grant_w": line.grant_w,
            "target_w": line.target_w,
            "charge_w": line.charge_w,
            "demand": None
            if d is None
            else {
                "need_w": d.need_w,
                "goodput_per_w": d.goodput_per_w,
                "power_w": d.power_w,
                "grant_epoch": d.grant_epoch,
                "age_s": round(result.time_s - d.received_s, 3),
            },
        }
    return doc


def write_status(path: Path, doc: dict) -> None:
    """Atomically: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def _expiry(seconds: float) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    props.MessageExpiryInterval = max(1, math.ceil(seconds))
    return props


class FleetService:
    """One allocator instance. `await run(stop)` until stop is set."""

    def __init__(
        self,
        cfg: FleetServiceConfig,
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        a = cfg.allocator
        self.instance_id = a.instance_id or f"{socket.gethostname()}-{os.getpid()}"
        self.prefix = cfg.mqtt.topic_prefix
        self.leader_topic = f"{self.prefix}/{FLEET_LEVEL}/leader"
        self.status_topic = f"{self.prefix}/{FLEET_LEVEL}/status"
        self._clock = clock
        self._rng = rng or random.Random()
        try:
            self.allocator = Allocator(cfg.specs(), cfg.params(), self._rng)
        except FleetConfigError as e:
            raise ConfigError(f"config error: {e}") from None
        self.leadership = Leadership(
            self.instance_id, claim_ttl_s=3 * a.period_s, confirm_s=a.period_s
        )
        self._password = (
            read_password_file(cfg.mqtt.password_file) if cfg.mqtt.password_file else None
        )
        self._tls = tls_context(cfg.mqtt)
        self._backoff = Backoff(
            cfg.mqtt.reconnect_initial_ms / 1000, cfg.mqtt.reconnect_max_ms / 1000, self._rng
        )
        self.last_round: Round | None = None
        self.rounds = 0

    # ---- message handling (pure but for the clock) -----------------------------------------

    def on_message(self, topic: str, payload: bytes) -> None:
        now_s = self._clock()
        levels = topic.split("/")
        if topic == self.leader_topic:
            claim = _json(payload)
            instance = claim.get("instance_id") if isinstance(claim, dict) else None
            self.leadership.on_claim(instance if isinstance(instance, str) else None, now_s)
            return
        meter = self.cfg.allocator.site_meter_topic
        if meter is not None and topic == meter:
            power_w = _site_power(payload)
            if power_w is not None:
                self.allocator.observe_site_power(power_w, now_s)
            return
        if len(levels) < 3 or levels[-2] == FLEET_LEVEL:
            return
        node, kind = levels[-2], levels[-1]
        if kind == "demand":
            try:
                d = DemandPayload.model_validate_json(payload)
            except ValueError:
                log.warning("fleet: invalid demand on %s ignored", topic)
                return
            if d.node_id != node:
                return
            grant = d.grant
            self.allocator.observe_demand(
                node,
                Demand(
                    need_w=d.need_w,
                    goodput_per_w=d.goodput_per_w,
                    device_min_w=d.floor_w,
                    device_max_w=d.ceiling_w,
                    power_w=d.power_w,
                    grant_epoch=grant.epoch if grant else None,
                    received_s=now_s,  # our clock, not the node's
                    grant_w=grant.budget_w if grant else None,
                    grant_expires_s=grant.expires_at_unix_s if grant else None,
                ),
            )
        elif kind == "telemetry":
            data = _json(payload)
            device = data.get("device") if isinstance(data, dict) else None
            power = device.get("power_w") if isinstance(device, dict) else None
            if isinstance(power, (int, float)):
                self.allocator.observe_power(node, float(power))

    def round_messages(self) -> list[tuple[str, bytes, float]]:
        """One round (leader only): (topic, payload, expiry seconds) for each grant."""
        now_s = self._clock()
        result = self.allocator.round(now_s)
        self.last_round, self.rounds = result, self.rounds + 1
        lease_s = self.cfg.allocator.lease_s
        out = []
        for g in result.grants:
            payload = GrantPayload(
                node_id=g.node_id,
                budget_w=g.budget_w,
                epoch=g.epoch,
                expires_at_unix_s=g.expires_s,
                issued_at_unix_s=now_s,
            )
            topic = Topics.for_node(self.prefix, g.node_id).grant
            out.append((topic, payload.to_json_bytes(), lease_s))
        return out

    def status(self) -> dict:
        return status_document(
            self.last_round,
            self.leadership.role,
            self.instance_id,
            self.cfg.allocator.site_budget_w,
        )

    # ---- the process ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        log.info(
            "fleet: instance %s, site budget %.0f W over %d node(s), period %.1f s, lease %.1f s",
            self.instance_id,
            self.cfg.allocator.site_budget_w,
            len(self.cfg.nodes),
            self.cfg.allocator.period_s,
            self.cfg.allocator.lease_s,
        )
        while not stop.is_set():
            try:
                await self._session(stop)
            except aiomqtt.MqttError as e:
                log.warning("fleet: broker connection lost or refused (%s); retrying", e)
            # Without the broker no grant can go out: the nodes run out their leases.
            self.leadership.on_claim(None, self._clock())
            if self.leadership.role is not Role.STANDBY:
                self.leadership = Leadership(
                    self.instance_id, self.leadership.claim_ttl_s, self.leadership.confirm_s
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._backoff.next_delay_s())

    async def _session(self, stop: asyncio.Event) -> None:
        m = self.cfg.mqtt
        client = aiomqtt.Client(
            m.host,
            m.port,
            username=m.username,
            password=self._password,
            identifier=m.client_id or f"wattserve-fleet-{self.instance_id}",
            protocol=aiomqtt.ProtocolVersion.V5,
            keepalive=m.keepalive_s,
            tls_context=self._tls,
            max_queued_incoming_messages=10_000,
        )
        async with client:
            self._backoff.reset()
            log.info("fleet: connected to %s:%d", m.host, m.port)
            self.leadership.on_connect(self._clock())
            topics = [
                self.leader_topic,
                f"{self.prefix}/+/demand",
                f"{self.prefix}/+/telemetry",
            ]
            if self.cfg.allocator.site_meter_topic:
                topics.append(self.cfg.allocator.site_meter_topic)
            for topic in topics:
                await client.subscribe(topic, qos=1 if topic == self.leader_topic else 0)
            reader = asyncio.create_task(self._read(client))
            try:
                await self._rounds(client, stop)
            finally:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            if self.leadership.role is Role.LEADER:
                # A clean stop hands over at once: clear the claim.
                await client.publish(self.leader_topic, b"", qos=1, retain=True)

    async def _read(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            payload = message.payload if isinstance(message.payload, bytes) else b""
            self.on_message(str(message.topic), payload)

    async def _rounds(self, client: aiomqtt.Client, stop: asyncio.Event) -> None:
        period_s = self.cfg.allocator.period_s
        while not stop.is_set():
            now_s = self._clock()
            action = self.leadership.tick(now_s)
            if action.publish_claim:
                claim = {"schema": 1, "instance_id": self.instance_id, "time_unix_s": now_s}
                await client.publish(
                    self.leader_topic,
                    json.dumps(claim).encode(),
                    qos=1,
                    retain=True,
                    properties=_expiry(self.leadership.claim_ttl_s),
                )
            if action.role is Role.LEADER:
                for topic, payload, lease_s in self.round_messages():
                    await client.publish(
                        topic, payload, qos=1, retain=True, properties=_expiry(lease_s)
                    )
            doc = self.status()
            await client.publish(self.status_topic, json.dumps(doc).encode(), qos=0)
            if self.cfg.allocator.status_file is not None:
                try:
                    write_status(self.cfg.allocator.status_file, doc)
                except OSError as e:
                    log.warning("fleet: cannot write the status file: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)


def _json(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return None


def _site_power(payload: bytes) -> float | None:
    data = _json(payload)
    if isinstance(data, dict):
        data = data.get("power_w")
    if isinstance(data, (int, float)) and not isinstance(data, bool) and math.isfinite(data):
        return float(data)
    return None


def main(config_path: str | Path) -> int:
    """`wattserve fleet`: run until SIGTERM or SIGINT; 0 after a clean stop."""
    import signal

    cfg = load_fleet_config(config_path)
    service = FleetService(cfg)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await service.run(stop)

    asyncio.run(run())
    log.info("fleet: stopped")
    return 0
