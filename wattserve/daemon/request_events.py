"""What the API measured of each request, published once to every subscriber.

RequestFinished goes out once per request when it ends, with its timings (seconds) and
token counts; FirstToken goes out when its first token reaches the API, because the
controller and the TTFT histogram take TTFT then, not when the request ends. The
subscribers (the Prometheus metrics, the live feed, the control loop) are registered
while the daemon is built; they run on the event loop and must not block. This module
holds plain values and the list of subscribers; it must not know who they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class FirstToken:
    """A request's first token reached the API, ttft_s after the request arrived."""

    request_id: str
    ttft_s: float


@dataclass(frozen=True)
class RequestFinished:
    """One request ended (once per engine request; each choice of n > 1 is one).

    finish_reason: stop, length, abort or error. ttft_s: arrival to first token (None: no
    token came). tpot_s: (end - first token) / (completion_tokens - 1) (None: fewer than two
    tokens, or the end was not seen). e2e_s: arrival to the last event (None: the request
    was closed before the engine's final event reached the API, as when the client left
    or the drain deadline passed; such a request counts, but is no latency sample).
    """

    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None


class RequestSubscriber(Protocol):
    def on_first_token(self, event: FirstToken) -> None: ...

    def on_request_finished(self, event: RequestFinished) -> None: ...


class RequestEvents:
    """The subscribers of request events, called in the order they subscribed."""

    def __init__(self) -> None:
        self._subscribers: list[RequestSubscriber] = []

    def subscribe(self, subscriber: RequestSubscriber) -> None:
        self._subscribers.append(subscriber)

    def first_token(self, event: FirstToken) -> None:
        for s in tuple(self._subscribers):
            s.on_first_token(event)

    def finished(self, event: RequestFinished) -> None:
        for s in tuple(self._subscribers):
            s.on_request_finished(event)
