"""This node's side of a fleet power budget: publish `demand`, apply `grant` (docs/fleet.md).

GrantGate decides which grant is in force (never an expired one, never an older epoch;
the safe floor once the lease runs out); node_demand turns the live telemetry snapshot into
the demand; FleetNodeLink is the MQTT 5 connection that carries both. A grant reaches the
controller only through `apply_budget`, which the daemon wires to ServingState.apply_policy
(changed_by "fleet"), the same path as an HTTP PUT. It must not touch the device, the
engine or the controller itself, and holds no policy of its own. Every grant is verified
(its node's HMAC, its epoch, its issue and expiry times) before it counts, and every
demand is signed (wattserve.fleet.signing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiomqtt

from wattserve.daemon.config import (
    ConfigError,
    FleetConfig,
    MqttConfig,
    fleet_transport_problems,
)
from wattserve.daemon.mqtt.link import Backoff, read_password_file, tls_context
from wattserve.daemon.mqtt.payloads import (
    DemandPayload,
    GrantInForce,
    GrantPayload,
    TelemetryPayload,
    Topics,
    parse_grant,
    resolve_node_id,
)
from wattserve.fleet.keys import read_key_ring
from wattserve.fleet.signing import KeyRing, freshness_error, sign, verify

log = logging.getLogger("wattserve.fleet")

# The SLO pressure that asks for more power is clamped: one bad window must not ask for
# the whole device, and an idle node keeps a useful minimum.
_PRESSURE_MIN, _PRESSURE_MAX = 0.5, 2.0
# A demand is taken for a few of its intervals at most (the allocator refuses it after).
_DEMAND_VALID_INTERVALS = 3


@dataclass(frozen=True)
class GrantVerdict:
    applied: bool
    # "applied", "renewed", "expired", "older_epoch", "other_node", "invalid", "bad_signature",
    # "stale"
    reason: str


class GrantGate:
    """Which grant is in force. Clocks are passed in: wall time (to read expires_at) and
    a monotonic time (to run the lease, bounded by max_lease_s against clock skew)."""

    def __init__(self, node_id: str, safe_floor_w: float, max_lease_s: float) -> None:
        self.node_id = node_id
        self.safe_floor_w = safe_floor_w
        self.max_lease_s = max_lease_s
        self._grant: GrantPayload | None = None
        self._lease_end_mono_s = -math.inf
        self._last_epoch = -1  # survives lease expiry: an older grant never applies again

    @property
    def in_force(self) -> GrantPayload | None:
        return self._grant

    def budget_w(self) -> float:
        """The budget to run under: the grant's, or the safe floor without one."""
        return self._grant.budget_w if self._grant is not None else self.safe_floor_w

    def offer(self, grant: GrantPayload, now_unix_s: float, now_mono_s: float) -> GrantVerdict:
        if grant.node_id != self.node_id:
            return GrantVerdict(False, "other_node")
        if grant.expires_at_unix_s <= now_unix_s:
            return GrantVerdict(False, "expired")
        if grant.epoch <= self._last_epoch:
            return GrantVerdict(False, "older_epoch")
        renewed = self._grant is not None and self._grant.budget_w == grant.budget_w
        self._grant = grant
        self._last_epoch = grant.epoch
        # Held no longer than the lease as issued, counted from its issue where this clock
        # says it is already past (a retained copy delivered late) and from its arrival
        # where this clock runs behind the allocator's: the allocator gives the watts away
        # after its own expiry plus its grace, whichever clock is right.
        issued_lease_s = grant.expires_at_unix_s - grant.issued_at_unix_s
        self._lease_end_mono_s = now_mono_s + min(
            grant.expires_at_unix_s - now_unix_s, issued_lease_s, self.max_lease_s
        )
        return GrantVerdict(True, "renewed" if renewed else "applied")

    def expire(self, now_mono_s: float) -> bool:
        """True once, when the grant in force runs out: the caller applies the safe floor."""
        if self._grant is not None and now_mono_s >= self._lease_end_mono_s:
            self._grant = None
            return True
        return False

    def lease_left_s(self, now_mono_s: float) -> float | None:
        if self._grant is None:
            return None
        return max(0.0, self._lease_end_mono_s - now_mono_s)


def node_demand(
    node_id: str,
    snapshot: TelemetryPayload,
    *,
    safe_floor_w: float,
    device_min_w: float | None,
    device_max_w: float | None,
    grant: GrantPayload | None,
    margin_ratio: float,
    epoch: int = 0,
    issued_at_unix_s: float | None = None,
    valid_s: float = 3.0,
) -> DemandPayload:
    """The demand from one telemetry snapshot.

    NOTE: deliberately simple, from what the node measures rather than the controller's
    internals. Latency scales roughly inversely and power roughly linearly with the work
    done per second near the operating point, so the power that meets the SLOs is about
    the measured power times the SLO pressure (the worse of TTFT p99 / its SLO and TPOT
    p99 / its SLO; 1 when nothing finished, or the node is idle), plus a margin; a queue of
    waiting requests counts as pressure of at least 1.25. goodput_per_w is the window's
    goodput (tokens/s x SLO attainment) over its power: the average, as the allocator's
    proxy for the marginal value of a watt here. Unsigned: epoch and issued_at_unix_s
    (default: the snapshot's time) are the caller's, valid_s its life.
    """
    dev, lat, serving = snapshot.device, snapshot.latency, snapshot.serving
    policy = snapshot.policy or {}
    power_w = dev.power_avg_w if dev.power_avg_w is not None else dev.power_w
    floor_w = max(safe_floor_w, device_min_w or 0.0)
    ceiling_w = max(floor_w, device_max_w if device_max_w is not None else floor_w)
    ratios = []
    for p99, slo in (
        (lat.ttft_p99_ms, policy.get("ttft_slo_ms")),
        (lat.tpot_p99_ms, policy.get("tpot_slo_ms")),
    ):
        if p99 is not None and isinstance(slo, (int, float)) and slo > 0:
            ratios.append(p99 / slo)
    pressure = max(ratios) if ratios else None
    effective = pressure if pressure is not None else 1.0
    if serving.requests_waiting:
        effective = max(effective, 1.25)
    effective = min(max(effective, _PRESSURE_MIN), _PRESSURE_MAX)
    if power_w is None:
        need_w = ceiling_w  # nothing measured: ask for all, the allocator bounds it
    else:
        need_w = power_w * effective * (1 + margin_ratio)
    need_w = min(max(need_w, floor_w), ceiling_w)
    tokens_per_s = serving.generation_tokens_per_s or 0.0
    attainment = lat.slo_attainment_ratio if lat.slo_attainment_ratio is not None else 1.0
    goodput_per_w = tokens_per_s * attainment / power_w if power_w else 0.0
    in_force = (
        GrantInForce(
            epoch=grant.epoch, budget_w=grant.budget_w, expires_at_unix_s=grant.expires_at_unix_s
        )
        if grant is not None
        else None
    )
    issued_s = snapshot.time_unix_s if issued_at_unix_s is None else issued_at_unix_s
    return DemandPayload(
        node_id=node_id,
        epoch=epoch,
        issued_at_unix_s=issued_s,
        expires_at_unix_s=issued_s + valid_s,
        need_w=need_w,
        goodput_per_w=goodput_per_w,
        floor_w=floor_w,
        ceiling_w=ceiling_w,
        power_w=power_w,
        slo_pressure_ratio=pressure,
        grant=in_force,
    )


# The demand's inputs from the daemon: a snapshot and the device's power-limit range.
DemandSource = Callable[[], tuple[TelemetryPayload, float | None, float | None] | None]
BudgetSink = Callable[[float, str], None]  # (power_budget_w, why)


class FleetNodeLink:
    """The node's fleet connection (MQTT 5, its own client id `<client_id>-fleet`):
    subscribes to its retained `grant`, publishes `demand` every fleet.demand_interval_ms,
    and runs the lease. Start and stop on the daemon's loop; apply_budget is called there.
    """

    def __init__(
        self,
        mqtt: MqttConfig,
        fleet: FleetConfig,
        *,
        demand_source: DemandSource,
        apply_budget: BudgetSink,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        # FleetConfig checks these when enabled.
        assert fleet.safe_floor_w is not None and fleet.key_file is not None
        self.mqtt_cfg, self.cfg = mqtt, fleet
        self.node_id = resolve_node_id(mqtt)
        if mqtt.username is not None and mqtt.username != self.node_id:
            # The ACL keys a node's topics on its username: another node's id cannot work.
            raise ConfigError(
                f"config error: mqtt.username: {mqtt.username!r} is not this node's id "
                f"{self.node_id!r} (fleet nodes log in as their node id)"
            )
        self.keys: KeyRing = read_key_ring(
            fleet.key_file, fleet.previous_key_file, "fleet.key_file"
        )
        problems = fleet_transport_problems(mqtt)
        if problems and not fleet.insecure_lab_waiver:
            raise ConfigError(
                f"config error: fleet.enabled with {'; '.join(problems)}: configure them, or "
                "set fleet.insecure_lab_waiver = true for a lab"
            )
        self._waived = problems
        self.topics = Topics.for_node(mqtt.topic_prefix, self.node_id)
        self.client_id = f"{mqtt.client_id or f'wattserve-{self.node_id}'}-fleet"
        self.gate = GrantGate(self.node_id, fleet.safe_floor_w, fleet.max_lease_s)
        self._password = (
            read_password_file(mqtt.password_file) if mqtt.password_file is not None else None
        )
        self._tls = tls_context(mqtt)
        self._demand_source = demand_source
        self._apply_budget = apply_budget
        self._clock, self._monotonic = clock, monotonic
        self._backoff = Backoff(
            mqtt.reconnect_initial_ms / 1000, mqtt.reconnect_max_ms / 1000, rng or random.Random()
        )
        self.counts = {"applied": 0, "renewed": 0, "rejected": 0, "lease_expired": 0}
        self._demand_epoch = 0
        self._floor_source = "safe_floor_no_grant_yet"  # why the node runs at its floor
        self.connected = False
        self._client: aiomqtt.Client | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def status(self) -> dict:
        """For /v1/status: the budget the fleet sets and where it comes from (`source`:
        "grant", or the safe floor with "safe_floor_no_grant_yet" or
        "safe_floor_lease_expired"), the grant in force (its epoch, expiry, seconds left)."""
        grant = self.gate.in_force
        return {
            "enabled": True,
            "connected": self.connected,
            "budget_w": self.gate.budget_w(),
            "source": "grant" if grant is not None else self._floor_source,
            "epoch": None if grant is None else grant.epoch,
            "expires_at_unix_s": None if grant is None else grant.expires_at_unix_s,
            "grant": None if grant is None else grant.model_dump(mode="json", by_alias=True),
            "lease_left_s": self.gate.lease_left_s(self._monotonic()),
            "safe_floor_w": self.gate.safe_floor_w,
            "counts": dict(self.counts),
        }

    async def start(self) -> None:
        if self._waived:
            log.warning(
                "fleet: insecure_lab_waiver: running with %s; anyone who can reach the "
                "broker can read and delay this node's grants (signatures still checked)",
                " and ".join(self._waived),
            )
        # Until a live grant arrives the node runs at its safe floor: it cannot know the
        # budget it had before (a restart), and the allocator charges it no more.
        self._apply_budget(self.gate.safe_floor_w, "fleet: no grant yet, safe floor")
        self._tasks = [
            asyncio.create_task(self._run(), name="wattserve-fleet"),
            asyncio.create_task(self._keep_lease(), name="wattserve-fleet-lease"),
            asyncio.create_task(self._tick(), name="wattserve-fleet-demand"),
        ]

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Cancel the connection and the demand ticks; a cancelled connection still tries a
        graceful DISCONNECT, which is not waited on past timeout_s."""
        for _ in range(2):  # a second cancel ends a DISCONNECT that hangs
            pending = [t for t in self._tasks if not t.done()]
            if not pending:
                break
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=timeout_s)
        self._tasks = []

    def on_grant(self, payload: bytes) -> GrantVerdict:
        """One `grant` message (retained or live): applied only if it is signed with this
        node's key for this topic, fresh, and of a newer epoch. Every grant applied is
        applied again, renewals too, so that a budget set by other means (an HTTP PUT)
        never stays above the grant for longer than a period."""
        try:
            grant = parse_grant(payload)
        except ValueError as e:
            return self._refuse(GrantVerdict(False, "invalid"), str(e).splitlines()[0])
        if not verify(grant, self.topics.grant, self.keys):
            return self._refuse(
                GrantVerdict(False, "bad_signature"), f"epoch {grant.epoch}: bad signature"
            )
        now_s = self._clock()
        stale = freshness_error(
            grant.issued_at_unix_s,
            grant.expires_at_unix_s,
            now_s,
            skew_s=self.cfg.max_clock_skew_s,
            max_life_s=self.cfg.max_lease_s,
        )
        if stale is not None:
            return self._refuse(GrantVerdict(False, "stale"), f"epoch {grant.epoch}: {stale}")
        verdict = self.gate.offer(grant, now_s, self._monotonic())
        if not verdict.applied:
            return self._refuse(verdict, f"epoch {grant.epoch}: {verdict.reason}")
        self.counts[verdict.reason] += 1
        self._apply_budget(grant.budget_w, f"fleet: grant epoch {grant.epoch}")
        return verdict

    def _refuse(self, verdict: GrantVerdict, why: str) -> GrantVerdict:
        self.counts["rejected"] += 1
        log.warning("fleet: grant refused: %s", why)
        return verdict

    def check_lease(self) -> bool:
        """Drop to the safe floor if the lease ran out; True if it just did."""
        if not self.gate.expire(self._monotonic()):
            return False
        self.counts["lease_expired"] += 1
        self._floor_source = "safe_floor_lease_expired"
        log.warning(
            "fleet: lease expired with no new grant: safe floor %.0f W", self.gate.safe_floor_w
        )
        self._apply_budget(self.gate.safe_floor_w, "fleet: lease expired, safe floor")
        return True

    def demand(self) -> DemandPayload | None:
        got = self._demand_source()
        if got is None:
            return None
        snapshot, device_min_w, device_max_w = got
        now_s = self._clock()
        # Epochs only rise: the allocator refuses a demand that is not newer than the last.
        self._demand_epoch = max(self._demand_epoch + 1, int(now_s * 1000))
        demand = node_demand(
            self.node_id,
            snapshot,
            safe_floor_w=self.gate.safe_floor_w,
            device_min_w=device_min_w,
            device_max_w=device_max_w,
            grant=self.gate.in_force,
            margin_ratio=self.cfg.need_margin_ratio,
            epoch=self._demand_epoch,
            issued_at_unix_s=now_s,
            valid_s=_DEMAND_VALID_INTERVALS * self.cfg.demand_interval_ms / 1000,
        )
        return sign(demand, self.topics.demand, self.keys)

    async def _keep_lease(self) -> None:
        """The lease, on its own task: nothing the link waits on (a publish into a dead
        connection waits for aiomqtt's timeout) may hold the node above its floor after
        its lease ends, since the allocator gives those watts away after lease + grace."""
        interval_s = self.cfg.demand_interval_ms / 1000
        while True:
            left_s = self.gate.lease_left_s(self._monotonic())
            await asyncio.sleep(interval_s if left_s is None else min(interval_s, left_s))
            self.check_lease()

    async def _tick(self) -> None:
        interval_s = self.cfg.demand_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            try:
                demand = self.demand()
            except Exception:  # noqa: BLE001 - a broken source must not end the demands
                log.exception("fleet: computing the demand failed")
                continue
            client = self._client
            if demand is not None and client is not None and self.connected:
                # A dead connection does not confirm a publish: give up on this demand
                # after one interval (the next one carries newer figures anyway).
                with contextlib.suppress(aiomqtt.MqttError):
                    await client.publish(
                        self.topics.demand, demand.to_json_bytes(), qos=0, timeout=interval_s
                    )

    async def _run(self) -> None:
        while True:
            try:
                client = aiomqtt.Client(
                    self.mqtt_cfg.host,
                    self.mqtt_cfg.port,
                    username=self.mqtt_cfg.username,
                    password=self._password,
                    identifier=self.client_id,
                    protocol=aiomqtt.ProtocolVersion.V5,
                    keepalive=self.mqtt_cfg.keepalive_s,
                    tls_context=self._tls,
                    max_queued_incoming_messages=64,
                )
                async with client:
                    self._client, self.connected = client, True
                    self._backoff.reset()
                    await client.subscribe(self.topics.grant, qos=1)
                    async for message in client.messages:
                        payload = message.payload
                        if isinstance(payload, bytes) and payload:
                            self.on_grant(payload)
            except aiomqtt.MqttError as e:
                log.debug("fleet: connection lost or refused (%s); retrying", e)
            except Exception:  # noqa: BLE001 - a bug here must not end the lease keeping
                log.exception("fleet: the fleet connection failed; reconnecting")
            finally:
                self._client, self.connected = None, False
            await asyncio.sleep(self._backoff.next_delay_s())
