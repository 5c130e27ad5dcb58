"""The MQTT link: one asyncio task that keeps a broker connection and publishes the feed.

The daemon hands it write-only snapshots (telemetry, events, the policy in force, the
status summary) from any thread; they wait in a bounded outbox, so a slow or absent
broker never blocks serving. While connected it publishes `status` (retained, with a
Last Will `offline`), `policy` (retained), telemetry (QoS 0), events (QoS 1), optional
Home Assistant discovery, and, only with mqtt.accept_policy, it hands live `policy/set`
messages to the daemon's policy handler, answering rejections with an event (the handler
reports accepted changes); a retained `policy/set` is never applied (docs/mqtt.md). On
a lost connection it reconnects with capped exponential backoff and jitter, then
republishes the retained topics and resubscribes. A clean stop flushes queued events,
publishes `offline` and disconnects. It must not read serving state back, decide policy,
or block the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import random
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiomqtt

from wattserve.daemon.config import ConfigError, MqttConfig
from wattserve.daemon.mqtt.outbox import Outbox, Outgoing
from wattserve.daemon.mqtt.payloads import (
    DeviceSummary,
    EventPayload,
    PolicyLike,
    PolicySetRejected,
    StatusPayload,
    TelemetryPayload,
    Topics,
    describe_rejection,
    home_assistant_configs,
    parse_policy_set,
    policy_fields,
    policy_payload,
    resolve_node_id,
)

log = logging.getLogger("wattserve.mqtt")

# Validates and applies a policy/set body (a dict of policy fields), reports the change
# (a `policy_changed` event, as any other policy change of the daemon) and returns the
# policy now in force; raises pydantic.ValidationError or ValueError to reject it.
PolicyHandler = Callable[[dict[str, Any]], PolicyLike]
# Where the events the link itself raises (`policy_rejected`) go: by default straight to
# its `events` topic; the daemon routes them through its live feed, which hands them back.
EventSink = Callable[[EventPayload], None]
# Builds one telemetry snapshot; None skips this tick. Runs on the event loop: be quick.
TelemetrySource = Callable[[], TelemetryPayload | None]

# Incoming messages waiting for the receive loop (only policy/set arrives).
_INCOMING_MAX = 64
_RETAINED_ORDER = ("status", "policy", "discovery")


def _package_version() -> str:
    try:
        return importlib.metadata.version("wattserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Backoff:
    """Capped exponential backoff with jitter: the n-th delay is uniform in
    [d/2, d] with d = min(max_s, initial_s * 2**n). reset() after a success."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError("backoff needs 0 < initial_s <= max_s")
        self.initial_s = initial_s
        self.max_s = max_s
        self._rng = rng
        self._attempt = 0

    def next_delay_s(self) -> float:
        # Cap the exponent too: 2**n overflows a float long before anyone waits that long.
        ceiling = min(self.max_s, self.initial_s * 2.0 ** min(self._attempt, 60))
        self._attempt += 1
        return self._rng.uniform(ceiling / 2.0, ceiling)

    def reset(self) -> None:
        self._attempt = 0


@dataclass(frozen=True)
class LinkStats:
    """Counters since the link was built (for /metrics and status)."""

    connected: bool
    connects: int
    connect_failures: int
    connection_losses: int
    published: dict[str, int]  # by kind: status, policy, discovery, telemetry, event
    queued_telemetry: int
    queued_events: int
    dropped_telemetry: int
    dropped_events: int
    policy_set_accepted: int
    policy_set_rejected: int
    policy_set_retained_ignored: int
    telemetry_source_errors: int


def read_password_file(path: Path) -> str:
    """The broker password: the file's content without its trailing newline."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config error: mqtt.password_file: cannot read {p}: {e}") from None
    password = text.rstrip("\r\n")
    if not password:
        raise ConfigError(f"config error: mqtt.password_file: {p} is empty")
    return password


def tls_context(cfg: MqttConfig) -> ssl.SSLContext | None:
    """The TLS context for mqtt.tls_*; None when TLS is off. Bad files raise ConfigError."""
    if not cfg.tls_enabled:
        return None
    ca = str(Path(cfg.tls_ca_file).expanduser()) if cfg.tls_ca_file is not None else None
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"config error: mqtt.tls_ca_file: cannot load {ca}: {e}") from None
    if cfg.tls_cert_file is not None:
        cert = Path(cfg.tls_cert_file).expanduser()
        key = Path(cfg.tls_key_file).expanduser() if cfg.tls_key_file is not None else None
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"config error: mqtt.tls_cert_file: cannot load {cert} (key {key}): {e}"
            ) from None
    return ctx


class MqttLink:
    """The daemon's MQTT feed. Build it, `await start()` on the daemon's loop, feed it,
    `await stop()` at shutdown. Feeding methods are safe from any thread and never block.

    policy_handler: called on the loop with each live `policy/set` body; the link
    subscribes only with one and with mqtt.accept_policy (accepts_policy).
    telemetry_source: called every mqtt.telemetry_interval_ms; without one, telemetry
    goes out only when publish_telemetry() is called.
    event_sink: receives the link's own `policy_rejected` events; default publish_event.
    """

    def __init__(
        self,
        cfg: MqttConfig,
        *,
        policy_handler: PolicyHandler | None = None,
        telemetry_source: TelemetrySource | None = None,
        event_sink: EventSink | None = None,
        version: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self.node_id = resolve_node_id(cfg)
        self.topics = Topics.for_node(cfg.topic_prefix, self.node_id)
        self.client_id = cfg.client_id or f"wattserve-{self.node_id}"
        self.version = version or _package_version()
        self._password = (
            read_password_file(cfg.password_file) if cfg.password_file is not None else None
        )
        self._tls = tls_context(cfg)
        self._policy_handler = policy_handler if cfg.accept_policy else None
        self._telemetry_source = telemetry_source
        self._event_sink = event_sink or self.publish_event
        self._backoff = Backoff(
            cfg.reconnect_initial_ms / 1000.0, cfg.reconnect_max_ms / 1000.0, rng or random.Random()
        )
        self._outbox = Outbox(cfg.telemetry_queue_max, cfg.event_queue_max)
        self._started_unix_s = time.time()

        # Shared with feeding threads; everything below is guarded by _lock.
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._model: str | None = None
        self._device: DeviceSummary | None = None
        self._policy_bytes: bytes | None = None
        self._dirty: set[str] = set()
        self._connected = False
        self._counts: dict[str, int] = {
            "connects": 0,
            "connect_failures": 0,
            "connection_losses": 0,
            "policy_set_accepted": 0,
            "policy_set_rejected": 0,
            "policy_set_retained_ignored": 0,
            "telemetry_source_errors": 0,
        }
        self._published: dict[str, int] = dict.fromkeys(
            ("status", "policy", "discovery", "telemetry", "event"), 0
        )

        # Loop-side state, created by start().
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._up: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None

    # ---- feeding (any thread) -------------------------------------------------------------

    def publish_telemetry(self, snapshot: TelemetryPayload) -> None:
        """Queue one telemetry snapshot (QoS 0); the oldest is dropped when the queue is full."""
        self._outbox.put(
            Outgoing("telemetry", self.topics.telemetry, snapshot.to_json_bytes(), qos=0)
        )
        self._poke()

    def publish_event(self, event: EventPayload) -> None:
        """Queue one event (QoS 1); kept while disconnected, up to mqtt.event_queue_max."""
        self._outbox.put(Outgoing("event", self.topics.events, event.to_json_bytes(), qos=1))
        self._poke()

    def set_policy(self, policy: PolicyLike, *, changed_by: str | None = None) -> None:
        """The policy in force, for the retained `policy` topic.

        With changed_by ("http", "controller", ...) a `policy_changed` event goes out
        too; leave it None for the initial policy at start, and where the caller reports
        changes itself (the daemon's live feed does). A change arriving over `policy/set`
        is republished here; its event is the policy handler's to report.
        """
        payload = policy_payload(policy)
        with self._lock:
            self._policy_bytes = payload
            self._dirty.add("policy")
        if changed_by is not None:
            fields = policy_fields(policy)
            self.publish_event(
                EventPayload(
                    kind="policy_changed",
                    message=f"policy changed by {changed_by}",
                    data={"changed_by": changed_by, "policy": fields},
                )
            )
        self._poke()

    def set_status(
        self,
        *,
        phase: str | None = None,
        model: str | None = None,
        device: DeviceSummary | None = None,
    ) -> None:
        """What the retained `online` status says; republished when it changes."""
        with self._lock:
            if (phase, model, device) == (self._phase, self._model, self._device):
                return
            self._phase, self._model, self._device = phase, model, device
            self._dirty.add("status")
        self._poke()

    # ---- observation ------------------------------------------------------------------------

    @property
    def accepts_policy(self) -> bool:
        """Subscribed to `policy/set` (mqtt.accept_policy, and a handler to apply it)."""
        return self._policy_handler is not None

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._connected

    def stats(self) -> LinkStats:
        counts = self._outbox.counts()
        with self._lock:
            return LinkStats(
                connected=self._connected,
                connects=self._counts["connects"],
                connect_failures=self._counts["connect_failures"],
                connection_losses=self._counts["connection_losses"],
                published=dict(self._published),
                queued_telemetry=counts.queued_telemetry,
                queued_events=counts.queued_events,
                dropped_telemetry=counts.dropped_telemetry,
                dropped_events=counts.dropped_events,
                policy_set_accepted=self._counts["policy_set_accepted"],
                policy_set_rejected=self._counts["policy_set_rejected"],
                policy_set_retained_ignored=self._counts["policy_set_retained_ignored"],
                telemetry_source_errors=self._counts["telemetry_source_errors"],
            )

    async def wait_connected(self, timeout_s: float) -> bool:
        """True once connected (now or within timeout_s), else False."""
        if self._up is None:
            raise RuntimeError("MqttLink.start() has not been called")
        try:
            await asyncio.wait_for(self._up.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # ---- life -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the connection task (and the telemetry ticker); returns at once."""
        if self._task is not None:
            raise RuntimeError("MqttLink already started")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._up = asyncio.Event()
        if self.accepts_policy:
            log.info(
                "mqtt: remote policy on: live messages on %s set the policy (%s connection)%s",
                self.topics.policy_set,
                self.cfg.remote_policy,
                "" if self.cfg.authenticated else "; anyone who reaches the broker may set it",
            )
        else:
            log.info(
                "mqtt: remote policy off (mqtt.accept_policy = false): %s is not subscribed",
                self.topics.policy_set,
            )
        self._task = asyncio.create_task(self._run(), name="wattserve-mqtt")
        if self._telemetry_source is not None:
            self._ticker = asyncio.create_task(self._tick(), name="wattserve-mqtt-telemetry")

    async def stop(self) -> None:
        """Flush queued events, publish `offline` (retained) and disconnect.

        Bounded by mqtt.shutdown_timeout_ms; past it the connection is dropped and the
        broker's Last Will reports `offline` instead. Idempotent.
        """
        if self._task is None or self._stopping is None or self._wake is None:
            return
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        self._stopping.set()
        self._wake.set()
        try:
            await asyncio.wait_for(
                asyncio.shield(self._task), self.cfg.shutdown_timeout_ms / 1000.0
            )
        except TimeoutError:
            log.warning(
                "mqtt: no clean disconnect within %d ms; the broker's Last Will reports offline",
                self.cfg.shutdown_timeout_ms,
            )
            # A cancelled session still tries a graceful DISCONNECT; do not wait on it long.
            for _ in range(2):
                self._task.cancel()
                done, _ = await asyncio.wait({self._task}, timeout=1.0)
                if done:
                    break

    def _poke(self) -> None:
        """Wake the publisher, from whichever thread this runs on."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return  # not started: the first connection publishes what is queued
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            wake.set()
        else:
            with contextlib.suppress(RuntimeError):  # loop closed: nobody to wake
                loop.call_soon_threadsafe(wake.set)

    # ---- the connection loop --------------------------------------------------------------

    async def _run(self) -> None:
        assert self._stopping is not None
        down_since: float | None = None
        failures = 0  # failed attempts in the current outage
        announced = False  # the outage's one log line is out
        while not self._stopping.is_set():
            try:
                await self._session(down_since, failures)
                return  # only a requested stop ends a session without an error
            except Exception as e:  # noqa: BLE001 - whatever ends a session, the link retries
                error = _unwrap(e)
            if not isinstance(error, aiomqtt.MqttError):
                log.error("mqtt: unexpected error, reconnecting", exc_info=error)
            if self._mark_down():
                down_since, failures, announced = time.monotonic(), 0, True
                log.warning(
                    "mqtt: connection to %s:%d lost (%s); serving goes on, reconnecting quietly",
                    self.cfg.host,
                    self.cfg.port,
                    error,
                )
            else:
                with self._lock:
                    self._counts["connect_failures"] += 1
                failures += 1
                if down_since is None:
                    down_since = time.monotonic()
                log.log(
                    logging.DEBUG if announced else logging.WARNING,
                    "mqtt: cannot connect to %s:%d (%s); serving goes on, retrying quietly "
                    "with backoff up to %.1f s",
                    self.cfg.host,
                    self.cfg.port,
                    error,
                    self._backoff.max_s,
                )
                announced = True
            delay_s = self._backoff.next_delay_s()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay_s)

    async def _session(self, down_since: float | None, failures: int) -> None:
        """One connection; returns after a clean stop, raises MqttError when it ends otherwise."""
        assert self._wake is not None and self._up is not None
        client = aiomqtt.Client(
            self.cfg.host,
            self.cfg.port,
            username=self.cfg.username,
            password=self._password,
            identifier=self.client_id,
            logger=logging.getLogger("wattserve.mqtt.client"),
            will=aiomqtt.Will(
                self.topics.status,
                self._status("offline", "connection_lost").to_json_bytes(),
                qos=1,
                retain=True,
            ),
            clean_session=True,
            keepalive=self.cfg.keepalive_s,
            tls_context=self._tls,
            max_queued_incoming_messages=_INCOMING_MAX,
        )
        _mark_disconnect_error_retrieved(client)
        async with client:
            self._mark_up(down_since, failures)
            if self._policy_handler is not None:
                await client.subscribe(self.topics.policy_set, qos=1)
            with self._lock:
                self._dirty.update(_RETAINED_ORDER)
            self._wake.set()
            publisher = asyncio.create_task(self._publish_loop(client))
            receiver = asyncio.create_task(self._receive_loop(client))
            try:
                done, _ = await asyncio.wait(
                    {publisher, receiver}, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for task in (publisher, receiver):
                    task.cancel()
                await asyncio.gather(publisher, receiver, return_exceptions=True)
            errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
            if errors:
                raise ExceptionGroup("mqtt session ended", errors)  # type: ignore[type-var]
            # The publisher returned: stop was requested and the outbox is flushed.
            await client.publish(
                self.topics.status,
                self._status("offline", "shutdown").to_json_bytes(),
                qos=1,
                retain=True,
            )
            self._count("status")
            with self._lock:
                self._connected = False
            self._up.clear()
        log.info("mqtt: published offline and disconnected")

    async def _publish_loop(self, client: aiomqtt.Client) -> None:
        assert self._wake is not None and self._stopping is not None
        while True:
            self._wake.clear()  # before looking: a later poke wakes the next wait
            await self._publish_retained(client)
            while (message := self._outbox.pop()) is not None:
                try:
                    await client.publish(message.topic, message.payload, qos=message.qos)
                except BaseException:
                    # Failed, or cancelled while awaiting the PUBACK because the connection
                    # dropped: keep the event for the next connection (at least once).
                    if message.kind == "event":
                        self._outbox.put_back(message)
                    raise
                self._count(message.kind)
            if self._stopping.is_set():
                return
            await self._wake.wait()

    async def _publish_retained(self, client: aiomqtt.Client) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        pending = [name for name in _RETAINED_ORDER if name in dirty]
        for i, name in enumerate(pending):
            try:
                for topic, payload in self._retained(name):
                    await client.publish(topic, payload, qos=1, retain=True)
                    self._count(name)
            except aiomqtt.MqttError:
                with self._lock:
                    self._dirty.update(pending[i:])
                raise

    def _retained(self, name: str) -> list[tuple[str, bytes]]:
        if name == "status":
            return [(self.topics.status, self._status("online", None).to_json_bytes())]
        if name == "policy":
            with self._lock:
                policy = self._policy_bytes
            return [] if policy is None else [(self.topics.policy, policy)]
        if not self.cfg.home_assistant_discovery:
            return []
        return home_assistant_configs(self.topics, self.cfg.home_assistant_prefix, self.version)

    async def _receive_loop(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            if not message.topic.matches(self.topics.policy_set):
                continue
            if message.retain:
                # The broker flags what it stored earlier and hands over at (re)subscription.
                # MQTT 3.1.1 says nothing of when it was published, so it could undo any
                # later change (an HTTP PUT): only live messages apply.
                self._ignore_retained()
                continue
            payload = message.payload
            raw = payload if isinstance(payload, bytes) else str(payload).encode()
            self._on_policy_set(raw)

    def _ignore_retained(self) -> None:
        with self._lock:
            self._counts["policy_set_retained_ignored"] += 1
        message = (
            "retained policy/set ignored, nothing changed: only live messages set the policy "
            "(publish without retain; clear the retained one with an empty retained message)"
        )
        log.warning("mqtt: %s", message)
        self._event_sink(
            EventPayload(
                kind="policy_rejected", message=message, data={"errors": [], "retained": True}
            )
        )

    def _on_policy_set(self, payload: bytes) -> None:
        assert self._policy_handler is not None
        try:
            applied = self._policy_handler(parse_policy_set(payload))
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            self._reject(describe_rejection(e))
            return
        except Exception as e:  # noqa: BLE001 - a handler bug must not end the feed
            log.exception("mqtt: the policy handler failed on a policy/set message")
            self._reject(PolicySetRejected(f"policy handler failed: {type(e).__name__}"))
            return
        with self._lock:
            self._counts["policy_set_accepted"] += 1
        log.info("mqtt: policy set over MQTT")
        self.set_policy(applied)

    def _reject(self, rejection: PolicySetRejected) -> None:
        with self._lock:
            self._counts["policy_set_rejected"] += 1
        log.warning("mqtt: policy/set rejected, nothing changed: %s", rejection)
        self._event_sink(
            EventPayload(
                kind="policy_rejected",
                message=f"policy/set rejected, nothing changed: {rejection}"[:2000],
                data={"errors": rejection.errors},
            )
        )

    async def _tick(self) -> None:
        assert self._loop is not None and self._telemetry_source is not None
        interval_s = self.cfg.telemetry_interval_ms / 1000.0
        due = self._loop.time() + interval_s
        failing = False
        while True:
            await asyncio.sleep(max(0.0, due - self._loop.time()))
            # Fixed cadence without drift; ticks missed while the loop was busy are skipped.
            due = max(due + interval_s, self._loop.time())
            try:
                snapshot = self._telemetry_source()
            except Exception:  # noqa: BLE001 - a broken source must not end the feed
                with self._lock:
                    self._counts["telemetry_source_errors"] += 1
                if not failing:
                    log.exception("mqtt: the telemetry source failed (logged once until it works)")
                failing = True
                continue
            failing = False
            if snapshot is not None:
                self.publish_telemetry(snapshot)

    # ---- helpers ----------------------------------------------------------------------------

    def _status(
        self,
        state: Literal["online", "offline"],
        offline_reason: Literal["shutdown", "connection_lost"] | None,
    ) -> StatusPayload:
        with self._lock:
            phase, model, device = self._phase, self._model, self._device
        return StatusPayload(
            state=state,
            offline_reason=offline_reason,
            node_id=self.node_id,
            version=self.version,
            started_unix_s=self._started_unix_s,
            phase=phase if state == "online" else None,  # a stopped process has no phase
            model=model,
            device=device,
        )

    def _count(self, kind: str) -> None:
        with self._lock:
            self._published[kind] += 1

    def _mark_up(self, down_since: float | None, failures: int) -> None:
        assert self._up is not None
        with self._lock:
            first = self._counts["connects"] == 0
            self._counts["connects"] += 1
            self._connected = True
        self._backoff.reset()
        self._up.set()
        where = f"{self.cfg.host}:{self.cfg.port}"
        down = ""
        if down_since is not None:
            down = (
                f" after {time.monotonic() - down_since:.1f} s down ({failures} failed attempt(s))"
            )
        log.info(
            "mqtt: %s to %s as %s (topics under %s/)%s",
            "connected" if first else "reconnected",
            where,
            self.client_id,
            self.topics.base,
            down,
        )

    def _mark_down(self) -> bool:
        """Note a lost or failed connection; True if it had been up."""
        assert self._up is not None
        self._up.clear()
        with self._lock:
            was_up, self._connected = self._connected, False
            if was_up:
                self._counts["connection_losses"] += 1
        return was_up


def _mark_disconnect_error_retrieved(client: aiomqtt.Client) -> None:
    """aiomqtt may set an exception on its disconnect future when the broker refuses or
    drops a connection that nothing awaits any more (a race in its connect path); asyncio
    then logs "Future exception was never retrieved" at garbage collection, a second,
    alarming line for one refused connection. A done-callback reads the exception whenever
    it is set, which marks it retrieved; the session's own error is what the link reports."""
    fut = getattr(client, "_disconnected", None)
    if isinstance(fut, asyncio.Future):
        fut.add_done_callback(lambda f: None if f.cancelled() else f.exception())


def _unwrap(error: Exception) -> Exception:
    """The first leaf of an exception group (the session's task group), else the error."""
    while isinstance(error, ExceptionGroup) and error.exceptions:
        first = error.exceptions[0]
        if not isinstance(first, Exception):
            break
        error = first
    return error
