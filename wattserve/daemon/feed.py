"""The live feed: one telemetry snapshot per period and the stream of events, for every consumer.

Consumers are the dashboard's Server-Sent Events stream, the MQTT link and Prometheus.
A snapshot (wattserve.daemon.mqtt.payloads.TelemetryPayload) is built from the serving state: the
latest device reading, the engine's counters and queues, the knobs and the policy in
force, and window figures (tok/s, J/token, TTFT/TPOT percentiles, SLO attainment) over
the time since that consumer's previous snapshot. Each consumer opens its own window when
it is built (`open_window(name)`) and closes it with `snapshot(window=name)`, so the MQTT
period and the dashboard's one-second tick do not steal requests from each other, and a
request that finishes before a consumer's first tick is still counted by it. Events
(controller decisions, policy changes, start, drain, ...) are published from any thread
and fanned out to listeners on the daemon's event loop; the last few minutes of both are
kept for a page that has just opened.

FeedHub keeps and fans out; LiveFeed is the daemon's snapshot (wattserve attach has its
own, wattserve/attach/feed.py). It reads state and hands payloads on; it must not decide,
apply knobs or do network I/O.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wattserve.controller.schema import to_model
from wattserve.daemon.mqtt.payloads import (
    DeviceFigures,
    EventKind,
    EventPayload,
    KnobFigures,
    ServingFigures,
    TelemetryPayload,
)
from wattserve.daemon.mqtt.window import TelemetryWindow
from wattserve.daemon.request_events import FirstToken, RequestFinished

if TYPE_CHECKING:
    from wattserve.controller.controller import Decision
    from wattserve.daemon.api.state import ServingState

log = logging.getLogger(__name__)

TelemetryListener = Callable[[TelemetryPayload], None]
EventListener = Callable[[EventPayload], None]

# The window the feed's own tick closes (dashboard, SSE); other consumers name their own.
LIVE_WINDOW = "live"


@dataclass(frozen=True)
class FeedItem:
    """One message of a subscription: kind "telemetry" or "event", and its payload."""

    kind: str
    payload: TelemetryPayload | EventPayload


class Subscription:
    """A bounded queue of FeedItems for one reader on the event loop (an SSE client).

    A reader that falls behind loses its oldest telemetry first, never the newest; the
    count of lost items is kept so the stream can say so.
    """

    def __init__(self, max_items: int) -> None:
        self._items: collections.deque[FeedItem] = collections.deque()
        self._max = max(1, max_items)
        self._ready = asyncio.Event()
        self.dropped = 0
        self.closed = False

    def put(self, item: FeedItem) -> None:
        if len(self._items) >= self._max:
            victim = next((i for i in self._items if i.kind == "telemetry"), self._items[0])
            self._items.remove(victim)
            self.dropped += 1
        self._items.append(item)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def get(self, timeout_s: float) -> FeedItem | None:
        """The next item, or None after timeout_s (or once closed and empty)."""
        if not self._items and not self.closed:
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout_s)
        return self._items.popleft() if self._items else None


class FeedHub:
    """Telemetry snapshots each period_s and the events of one process, kept for the last
    few minutes and handed to every listener and subscription on the event loop.

    What a snapshot holds is the subclass's (snapshot()); run() ticks on the event loop;
    publish_event() and on_decision() are safe from any thread.
    """

    def __init__(
        self, *, period_s: float = 1.0, history_s: float = 300.0, events_max: int = 500
    ) -> None:
        if period_s <= 0:
            raise ValueError("feed period_s must be > 0")
        self.period_s = period_s
        self._lock = threading.Lock()
        self._history: collections.deque[TelemetryPayload] = collections.deque(
            maxlen=max(1, int(history_s / period_s))
        )
        self._events: collections.deque[EventPayload] = collections.deque(maxlen=events_max)
        self._telemetry_listeners: list[TelemetryListener] = []
        self._event_listeners: list[EventListener] = []
        self._subscriptions: set[Subscription] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_decision: tuple[str, str] | None = None

    def snapshot(self) -> TelemetryPayload:
        raise NotImplementedError

    def _watch_transitions(self, snap: TelemetryPayload) -> None:
        """Events for what consecutive snapshots show changing (none by default)."""

    def _count_event(self, kind: str) -> None:
        """Count a published event (the daemon's Prometheus counter; nothing by default)."""

    def _count_decision(self, reason_code: str) -> None:
        """Count a published decision (as _count_event)."""

    def publish_event(
        self, kind: EventKind, message: str, data: dict[str, Any] | None = None
    ) -> EventPayload:
        """Record an event and hand it to every listener (on the event loop)."""
        event = EventPayload(kind=kind, message=message[:2000], data=data or {})
        self._count_event(kind)
        with self._lock:
            self._events.append(event)
        self._dispatch(FeedItem("event", event))
        return event

    def on_decision(self, decision: Decision) -> None:
        """Control-loop sink: an event for each decision that changes a knob, or whose mode
        or reason code differs from the last one published (a steady state publishes nothing)."""
        key = (decision.mode.value, decision.reason_code.value)
        if not decision.changed and key == self._last_decision:
            return
        self._last_decision = key
        self._count_decision(decision.reason_code.value)
        prefix = "decision" if decision.apply else "advice (observe mode)"
        self.publish_event("decision", f"{prefix}: {decision.reason}", decision.to_dict())

    # ---- outputs --------------------------------------------------------------------------

    def add_listener(
        self,
        *,
        on_telemetry: TelemetryListener | None = None,
        on_event: EventListener | None = None,
    ) -> None:
        """Called on the event loop with each live snapshot / each event."""
        with self._lock:
            if on_telemetry is not None:
                self._telemetry_listeners.append(on_telemetry)
            if on_event is not None:
                self._event_listeners.append(on_event)

    def history(self) -> list[TelemetryPayload]:
        """The live snapshots of the last history_s, oldest first."""
        with self._lock:
            return list(self._history)

    def recent_events(self) -> list[EventPayload]:
        with self._lock:
            return list(self._events)

    def latest(self) -> TelemetryPayload | None:
        with self._lock:
            return self._history[-1] if self._history else None

    @contextlib.asynccontextmanager
    async def subscribe(self, max_items: int = 256) -> AsyncIterator[Subscription]:
        """A Subscription to live snapshots and events while the context is open."""
        sub = Subscription(max_items)
        with self._lock:
            self._subscriptions.add(sub)
        try:
            yield sub
        finally:
            with self._lock:
                self._subscriptions.discard(sub)

    # ---- the tick ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Snapshot every period_s until cancelled."""
        self._loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    snap = self.snapshot()
                except Exception:  # a broken reading must not end the feed
                    log.exception("live feed: snapshot failed")
                else:
                    with self._lock:
                        self._history.append(snap)
                    self._dispatch(FeedItem("telemetry", snap))
                    self._watch_transitions(snap)
                await asyncio.sleep(self.period_s)
        finally:
            self._loop = None
            with self._lock:
                subs = list(self._subscriptions)
            for sub in subs:
                sub.close()

    # ---- fan-out -------------------------------------------------------------------------------

    def _dispatch(self, item: FeedItem) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # not running: kept in history/recent events only
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._deliver(item)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: FeedItem) -> None:
        with self._lock:
            subs = list(self._subscriptions)
            listeners: list[Callable[[Any], None]] = list(
                self._telemetry_listeners if item.kind == "telemetry" else self._event_listeners
            )
        for sub in subs:
            sub.put(item)
        for listener in listeners:
            try:
                listener(item.payload)
            except Exception:  # one consumer's failure must not starve the others
                log.exception("live feed: listener %r failed", listener)


class LiveFeed(FeedHub):
    """The daemon's feed: snapshots of its serving state, with window figures per consumer.

    record_request() and snapshot() are safe from any thread.
    """

    def __init__(
        self,
        state: ServingState,
        *,
        period_s: float = 1.0,
        history_s: float = 300.0,
        events_max: int = 500,
    ) -> None:
        super().__init__(period_s=period_s, history_s=history_s, events_max=events_max)
        self.state = state
        self._windows: dict[str, TelemetryWindow] = {}
        self._seen_level: str | None = None
        self._seen_stale: bool | None = None
        self.open_window(LIVE_WINDOW)

    def _count_event(self, kind: str) -> None:
        self.state.metrics.events.labels(kind).inc()

    def _count_decision(self, reason_code: str) -> None:
        self.state.metrics.decisions.labels(reason_code).inc()

    def open_window(self, name: str) -> None:
        """Register a consumer's window; from now on every finished request is recorded in it.

        Call it when the consumer is built, not at its first snapshot: a window opened by
        its first snapshot misses the requests that finished before that tick.
        """
        win = TelemetryWindow()
        win.start(now_s=time.monotonic(), **self._counters_now())
        with self._lock:
            if name in self._windows:
                raise ValueError(f"feed window {name!r} is already open")
            self._windows[name] = win

    # ---- inputs (any thread) ---------------------------------------------------------------

    def record_request(self, ttft_s: float, tpot_s: float | None) -> None:
        """One finished request's latencies, into every consumer's window."""
        with self._lock:
            windows = list(self._windows.values())
        for w in windows:
            w.record_request(ttft_s * 1000.0, None if tpot_s is None else tpot_s * 1000.0)

    def on_request_finished(self, event: RequestFinished) -> None:
        """Request-event subscriber: a request whose end the API saw, with a first token,
        is a latency sample of every window."""
        if event.e2e_s is not None and event.ttft_s is not None:
            self.record_request(event.ttft_s, event.tpot_s)

    def on_first_token(self, event: FirstToken) -> None:
        pass  # TTFT is taken with the finished request, as one sample

    def _watch_transitions(self, snap: TelemetryPayload) -> None:
        """Events for what the snapshots show changing: the quantization level in use (by
        the controller or PUT knobs alike) and the device's reading going stale or back."""
        level, stale = snap.knobs.quant_level, snap.device.stale
        if self._seen_level is not None and level is not None and level != self._seen_level:
            self.publish_event(
                "quantization_switch",
                f"quantization {self._seen_level} -> {level}",
                {"from": self._seen_level, "to": level},
            )
        if stale != self._seen_stale and (stale or self._seen_stale is not None):
            sampler = self.state.device_sampler
            reading = sampler.latest() if sampler is not None else None
            lost = bool(reading is not None and reading.device_lost)
            what = "lost" if lost else "stale" if stale else "fresh again"
            self.publish_event(
                "device_fault", f"device telemetry {what}", {"stale": stale, "device_lost": lost}
            )
        self._seen_level = level or self._seen_level
        self._seen_stale = stale

    def snapshot(self, window: str = LIVE_WINDOW) -> TelemetryPayload:
        """A telemetry payload now, with window figures since `window`'s previous snapshot.

        Raises KeyError for a window that open_window() did not register.
        """
        with self._lock:
            win = self._windows[window]
        state = self.state
        engine = state.engine
        sampler = state.device_sampler
        reading = sampler.latest() if sampler is not None else None
        policy = state.policy
        figures = win.close(
            now_s=time.monotonic(),
            **self._counters_now(),
            ttft_slo_ms=policy.ttft_slo_ms,
            tpot_slo_ms=policy.tpot_slo_ms,
        )
        serving = ServingFigures(
            requests_in_flight=state.in_flight,
            requests_finished=figures.requests_finished,
            generation_tokens_per_s=figures.generation_tokens_per_s,
            prompt_tokens_per_s=figures.prompt_tokens_per_s,
            energy_window_j=figures.energy_window_j,
            energy_per_token_j=figures.energy_per_token_j,
        )
        knobs = KnobFigures()
        if engine is not None:
            serving = serving.model_copy(
                update={
                    "requests_running": engine.num_running,
                    "requests_waiting": engine.num_waiting,
                    "kv_cache_usage_ratio": engine.kv.usage,
                }
            )
            knobs = KnobFigures(
                max_num_seqs=engine.limits.max_num_seqs,
                max_num_batched_tokens=engine.limits.max_num_batched_tokens,
                decode_interval_ms=engine.limits.decode_interval_ms,
                quant_level=engine.quant_level,
                sm_clock_lock_mhz=reading.sm_clock_lock_mhz if reading is not None else None,
                power_limit_w=reading.power_limit_w if reading is not None else None,
            )
        return TelemetryPayload(
            window_s=figures.window_s,
            phase=state.phase.value,
            device=DeviceFigures.from_telemetry(reading)
            if reading is not None
            else DeviceFigures(),
            serving=serving,
            latency=figures.latency,
            knobs=knobs,
            policy=to_model(policy).model_dump(mode="json"),
        )

    def _counters_now(self) -> dict[str, Any]:
        """The cumulative counters a window's rates come from (an engine not yet built has
        generated nothing; a device not yet read has no energy figure)."""
        engine = self.state.engine
        sampler = self.state.device_sampler
        reading = sampler.latest() if sampler is not None else None
        counters = engine.counters if engine is not None else None
        return {
            "generation_tokens": counters.generation_tokens if counters else 0,
            "prompt_tokens": counters.prompt_tokens if counters else 0,
            "energy_j": reading.energy_j if reading is not None else None,
        }
