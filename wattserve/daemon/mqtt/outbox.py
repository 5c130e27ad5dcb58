"""The bounded, thread-safe queue between the daemon and the MQTT connection.

Telemetry and events wait here until the connection publishes them, in arrival order.
Each kind has its own bound: beyond it the oldest message of that kind is dropped and
counted (telemetry goes stale anyway, so its bound is small; events get a larger one).
Putting never blocks and never fails, so the feed can never hold up serving.
Retained state (status, policy) does not queue here: only its latest value matters.
This module must not do I/O or know about the broker.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

MessageKind = Literal["telemetry", "event"]


@dataclass(frozen=True)
class Outgoing:
    """One message to publish."""

    kind: MessageKind
    topic: str
    payload: bytes
    qos: int


@dataclass(frozen=True)
class OutboxCounts:
    queued_telemetry: int
    queued_events: int
    dropped_telemetry: int
    dropped_events: int


class Outbox:
    """Two bounded FIFOs popped in arrival order; safe to use from any thread."""

    def __init__(self, telemetry_max: int, event_max: int) -> None:
        if telemetry_max < 1 or event_max < 1:
            raise ValueError("outbox bounds must be >= 1")
        self._max = {"telemetry": telemetry_max, "event": event_max}
        self._queues: dict[MessageKind, deque[tuple[int, Outgoing]]] = {
            "telemetry": deque(),
            "event": deque(),
        }
        self._dropped: dict[MessageKind, int] = {"telemetry": 0, "event": 0}
        self._seq = itertools.count()
        self._front_seq = itertools.count(-1, -1)  # put back: before anything queued
        self._lock = threading.Lock()

    def put(self, message: Outgoing) -> None:
        """Queue a message; drop (and count) the oldest of its kind beyond the bound."""
        with self._lock:
            queue = self._queues[message.kind]
            queue.append((next(self._seq), message))
            self._trim(message.kind)

    def put_back(self, message: Outgoing) -> None:
        """Return a message whose publishing failed to the head of its queue.

        If its queue filled up meanwhile, the message itself is the oldest: it is dropped.
        """
        with self._lock:
            self._queues[message.kind].appendleft((next(self._front_seq), message))
            self._trim(message.kind)

    def pop(self) -> Outgoing | None:
        """The oldest queued message of either kind, or None when empty."""
        with self._lock:
            t, e = self._queues["telemetry"], self._queues["event"]
            if not t and not e:
                return None
            if not e or (t and t[0][0] < e[0][0]):
                return t.popleft()[1]
            return e.popleft()[1]

    def counts(self) -> OutboxCounts:
        with self._lock:
            return OutboxCounts(
                queued_telemetry=len(self._queues["telemetry"]),
                queued_events=len(self._queues["event"]),
                dropped_telemetry=self._dropped["telemetry"],
                dropped_events=self._dropped["event"],
            )

    def __len__(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def _trim(self, kind: MessageKind) -> None:
        queue = self._queues[kind]
        while len(queue) > self._max[kind]:
            queue.popleft()
            self._dropped[kind] += 1
