"""`wattserve fleet`: the allocator process that shares one site budget (docs/fleet.md).

It reads its own TOML file ([allocator], [mqtt], [[nodes]]), connects to the broker over
MQTT 5, listens to every node's `demand` and `telemetry`, the leader claim and the optional
site meter, and once per period, while it is the leader (wattserve.fleet.leader), runs one
allocation round (wattserve.fleet.allocator) and publishes each grant retained with a message expiry
equal to the lease; it writes the round to a JSON status file. The decisions are the pure
core's; this module only wires them to the broker, the clock and the file system. Every
message is bounded (bytes, nesting, numbers) and a demand counts only if signed with its
node's key, fresh and newer than the last (docs/fleet.md, *Trust*); each refusal is one
log line. It pings the systemd watchdog from its loop. It must not talk to a node any
other way than through the broker.
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

from wattserve.daemon.config import ConfigError, MqttConfig, fleet_transport_problems
from wattserve.daemon.mqtt.link import Backoff, read_password_file, tls_context
from wattserve.daemon.mqtt.payloads import (
    MAX_FLEET_BYTES,
    MAX_TELEMETRY_BYTES,
    MAX_TELEMETRY_DEPTH,
    GrantPayload,
    Topics,
    parse_demand,
    parse_json,
)
from wattserve.daemon.sdnotify import Notifier
from wattserve.fleet.allocator import (
    Allocator,
    AllocatorParams,
    Demand,
    FleetConfigError,
    NodeSpec,
    Round,
)
from wattserve.fleet.keys import read_key_ring
from wattserve.fleet.leader import Leadership, Role
from wattserve.fleet.ratelimit import RateLimiter
from wattserve.fleet.signing import KeyRing, freshness_error, sign, verify

log = logging.getLogger("wattserve.fleet")

FLEET_LEVEL = "_fleet"  # a topic level no node id can take (node ids start alphanumeric)
MAX_SITE_W = 1e9  # a site meter reading beyond this is not one


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
    max_clock_skew_s: float = Field(
        5.0, gt=0, le=60, description="A demand issued further ahead of this clock is refused."
    )
    max_messages_per_node_per_s: float = Field(
        20.0, gt=0, description="Demands and telemetry a node may send; bursts of twice this."
    )
    insecure_lab_waiver: bool = Field(
        False, description="Lab only: run without broker credentials or TLS (logged at start)."
    )

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
    key_file: Path = Field(..., description="The node's HMAC key (mode 0600), as on the node.")
    previous_key_file: Path | None = Field(None, description="During a rotation: the old key.")

    @model_validator(mode="after")
    def _check(self) -> NodeSection:
        if self.ceiling_w < self.floor_w:
            raise ValueError(f"node {self.node_id}: ceiling_w must be >= floor_w")
        return self


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
        problems = fleet_transport_problems(self.mqtt)
        if problems and not self.allocator.insecure_lab_waiver:
            raise ValueError(
                f"{'; '.join(problems)}: the allocator needs both, or "
                "allocator.insecure_lab_waiver = true for a lab"
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
        self._keys: dict[str, KeyRing] = {
            n.node_id: read_key_ring(n.key_file, n.previous_key_file, f"nodes.{n.node_id}.key_file")
            for n in cfg.nodes
        }
        self._specs = {n.node_id: n for n in cfg.nodes}
        self._last_demand_epoch: dict[str, int] = {}
        self._rate = RateLimiter(a.max_messages_per_node_per_s, 2 * a.max_messages_per_node_per_s)
        self._unknown_logged: set[str] = set()
        self._clamps: dict[tuple[str, str], float] = {}  # the last clamp logged per field
        self.refusals = 0
        self.notifier = Notifier.from_environ()
        self._backoff = Backoff(
            cfg.mqtt.reconnect_initial_ms / 1000, cfg.mqtt.reconnect_max_ms / 1000, self._rng
        )
        self.last_round: Round | None = None
        self.rounds = 0

    # ---- message handling (pure but for the clock) -----------------------------------------

    def on_message(self, topic: str, payload: bytes) -> None:
        now_s = self._clock()
        if topic == self.leader_topic:
            claim = self._bounded_json(topic, payload, MAX_FLEET_BYTES, 2)
            instance = claim.get("instance_id") if isinstance(claim, dict) else None
            self.leadership.on_claim(instance if isinstance(instance, str) else None, now_s)
            return
        meter = self.cfg.allocator.site_meter_topic
        if meter is not None and topic == meter:
            power_w = _site_power(self._bounded_json(topic, payload, MAX_FLEET_BYTES, 2))
            if power_w is not None:
                self.allocator.observe_site_power(power_w, now_s)
            return
        levels = topic.split("/")
        if len(levels) < 3 or levels[-2] == FLEET_LEVEL:
            return
        node, kind = levels[-2], levels[-1]
        if node not in self._specs:
            # Logged once per id (and at most for a hundred ids): a stranger is no news.
            if len(self._unknown_logged) < 100 and node not in self._unknown_logged:
                self._unknown_logged.add(node)
                log.warning("fleet: %s ignored: node %r is not in the site config", topic, node)
            return
        if not self._rate.allow(node, now_s):
            return  # counted; one line per round says how many (_log_drops)
        if kind == "demand":
            self._on_demand(node, topic, payload, now_s)
        elif kind == "telemetry":
            data = self._bounded_json(topic, payload, MAX_TELEMETRY_BYTES, MAX_TELEMETRY_DEPTH)
            device = data.get("device") if isinstance(data, dict) else None
            power = device.get("power_w") if isinstance(device, dict) else None
            if isinstance(power, (int, float)) and not isinstance(power, bool):
                self._clamp(node, "telemetry power_w", float(power), self._specs[node].ceiling_w)
                self.allocator.observe_power(node, float(power))

    def _on_demand(self, node: str, topic: str, payload: bytes, now_s: float) -> None:
        """A demand counts only if well-formed, for this topic, signed with the node's key,
        fresh, of a newer epoch than the last, and reporting a grant epoch that one of our
        rounds could have issued (a runaway epoch would outgrow every later grant)."""
        try:
            d = parse_demand(payload)
        except ValueError as e:
            self._refuse(topic, f"invalid: {str(e).splitlines()[0]}")
            return
        if d.node_id != node:
            self._refuse(topic, f"node_id {d.node_id!r} is not the topic's {node!r}")
            return
        if not verify(d, topic, self._keys[node]):
            self._refuse(topic, f"epoch {d.epoch}: bad signature")
            return
        a = self.cfg.allocator
        params = self.allocator.params
        stale = freshness_error(
            d.issued_at_unix_s,
            d.expires_at_unix_s,
            now_s,
            skew_s=a.max_clock_skew_s,
            max_life_s=params.demand_timeout_s,
        )
        if stale is not None:
            self._refuse(topic, f"epoch {d.epoch}: {stale}")
            return
        last = self._last_demand_epoch.get(node, -1)
        if d.epoch <= last:
            self._refuse(topic, f"epoch {d.epoch} is not above {last} (a replay)")
            return
        grant = d.grant
        epoch_bound = int((now_s + params.lease_s + a.max_clock_skew_s) * 1000)
        if grant is not None and grant.epoch > epoch_bound:
            self._refuse(topic, f"its grant's epoch {grant.epoch} is ahead of any round")
            return
        self._last_demand_epoch[node] = d.epoch
        spec = self._specs[node]
        # The site's floor and ceiling, not the node's: it may report less, never more.
        self._clamp(node, "floor_w", d.floor_w, spec.floor_w)
        self._clamp(node, "ceiling_w", d.ceiling_w, spec.ceiling_w)
        if d.power_w is not None:
            self._clamp(node, "power_w", d.power_w, spec.ceiling_w)
        self.allocator.observe_demand(
            node,
            Demand(
                need_w=d.need_w,
                goodput_per_w=d.goodput_per_w,
                device_min_w=min(d.floor_w, spec.floor_w),
                device_max_w=min(d.ceiling_w, spec.ceiling_w),
                power_w=d.power_w,
                grant_epoch=grant.epoch if grant else None,
                received_s=now_s,  # our clock, not the node's
                grant_w=grant.budget_w if grant else None,
                grant_expires_s=grant.expires_at_unix_s if grant else None,
            ),
        )

    def _refuse(self, topic: str, why: str) -> None:
        self.refusals += 1
        log.warning("fleet: message on %s refused: %s", topic, why)

    def _bounded_json(self, topic: str, payload: bytes, max_bytes: int, max_depth: int) -> Any:
        try:
            return parse_json(payload, topic, max_bytes, max_depth)
        except ValueError as e:
            self._refuse(topic, str(e).splitlines()[0])
            return None

    def _clamp(self, node: str, what: str, value_w: float, bound_w: float) -> None:
        """Log a reported value above the site's bound: when it first appears or changes."""
        if value_w <= bound_w:
            self._clamps.pop((node, what), None)
            return
        if self._clamps.get((node, what)) != value_w:
            self._clamps[(node, what)] = value_w
            log.warning(
                "fleet: node %s reports %s %.1f W, above the site's %.1f W: clamped",
                node,
                what,
                value_w,
                bound_w,
            )

    def _log_drops(self) -> None:
        for node in self._specs:
            dropped = self._rate.take_dropped(node)
            if dropped:
                self.refusals += dropped
                log.warning(
                    "fleet: node %s over %.0f messages/s: %d message(s) dropped",
                    node,
                    self.cfg.allocator.max_messages_per_node_per_s,
                    dropped,
                )

    def round_messages(self) -> list[tuple[str, bytes, float]]:
        """One round (leader only): (topic, payload, expiry seconds) for each grant."""
        now_s = self._clock()
        result = self.allocator.round(now_s)
        self.last_round, self.rounds = result, self.rounds + 1
        lease_s = self.cfg.allocator.lease_s
        out = []
        for g in result.grants:
            topic = Topics.for_node(self.prefix, g.node_id).grant
            payload = GrantPayload(
                node_id=g.node_id,
                budget_w=g.budget_w,
                epoch=g.epoch,
                expires_at_unix_s=g.expires_s,
                issued_at_unix_s=now_s,
            )
            payload = sign(payload, topic, self._keys[g.node_id])
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
        waived = fleet_transport_problems(self.cfg.mqtt)
        if self.cfg.allocator.insecure_lab_waiver and waived:
            log.warning(
                "fleet: insecure_lab_waiver: running with %s; anyone who can reach the broker "
                "can read demands and delay grants (signatures still checked)",
                " and ".join(waived),
            )
        self.notifier.ready("allocating")
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
            await self._wait(stop, self._backoff.next_delay_s())

    async def _wait(self, stop: asyncio.Event, seconds: float) -> None:
        """Wait until stop or for seconds, pinging the watchdog at least every period."""
        deadline_s = time.monotonic() + seconds
        while not stop.is_set():
            self.notifier.ping_watchdog()
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(left_s, self.cfg.allocator.period_s))

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
                await self._rounds(client, stop, reader)
            finally:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            if self.leadership.role is Role.LEADER:
                # A clean stop hands over at once: clear the claim.
                await client.publish(self.leader_topic, b"", qos=1, retain=True)

    async def _read(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            payload = message.payload if isinstance(message.payload, bytes) else b""
            try:
                self.on_message(str(message.topic), payload)
            except Exception:  # noqa: BLE001 - one bad message must not deafen the leader
                log.exception("fleet: message on %s failed; reading on", message.topic)

    async def _rounds(
        self, client: aiomqtt.Client, stop: asyncio.Event, reader: asyncio.Task[None]
    ) -> None:
        period_s = self.cfg.allocator.period_s
        while not stop.is_set():
            if reader.done():
                # Deaf, it would lead on stale demands: reconnect (and hear again) instead.
                log.warning("fleet: the message reader ended; reconnecting")
                return
            self.notifier.ping_watchdog()
            self._log_drops()
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


def _site_power(data: Any) -> float | None:
    if isinstance(data, dict):
        data = data.get("power_w")
    if isinstance(data, (int, float)) and not isinstance(data, bool) and math.isfinite(data):
        return float(data) if 0 <= data <= MAX_SITE_W else None
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
