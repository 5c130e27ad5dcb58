"""The bridge between one HTTP request and its engine sequence.

The engine hands over each step's events together (Engine.set_delivery); the delivery
installed here crosses to the asyncio loop once per step (loop.call_soon_threadsafe) and
puts each event in its request's queue there, so handlers simply await events. The
bridge also owns the request's admission slot and measures it where the client sees it,
on the API side: it publishes FirstToken and, once, RequestFinished
(wattserve/daemon/request_events.py) to the subscribers on the serving state, and observes each
token gap (ITL) into the metrics itself. Closing a stream that has not finished aborts
its sequence in the engine (client gone, drain timeout), which frees its KV blocks at the
top of the next engine step. No tensors and no HTTP formatting here.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from wattserve.daemon.api.state import ServingState
from wattserve.daemon.engine.engine import Engine, Sink, call_each
from wattserve.daemon.engine.request import InvalidRequestError, RequestOutput, SamplingParams
from wattserve.daemon.request_events import FirstToken, RequestFinished


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


class LoopDelivery:
    """The engine's delivery for requests served on one asyncio loop: a step's events
    cross threads in one call_soon_threadsafe, and the engine's call_each then runs each
    sink on the loop (one failing sink costs the others nothing)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    # Runs on the engine thread: it must never raise into the engine's step.
    def __call__(self, batch: list[tuple[Sink, RequestOutput]]) -> None:
        try:
            self.loop.call_soon_threadsafe(call_each, batch)
        except RuntimeError:
            pass  # the loop is closed: the process is exiting and nobody listens


class EventQueue:
    """One request's events on the loop, for one consumer: put_nowait() from the
    delivery, `await get()` in the request's handler. What asyncio.Queue does for this
    case (unbounded, one getter) without its bookkeeping: a put appends and wakes the
    waiting getter, if any, through one future."""

    __slots__ = ("_events", "_waiter")

    def __init__(self) -> None:
        self._events: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._events.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # cancelled with its getter
                waiter.set_result(None)

    async def get(self):
        while not self._events:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return self._events.popleft()

    def qsize(self) -> int:
        return len(self._events)


def _deliver_on(engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
    """Make sure the engine delivers to this loop (the first request installs it)."""
    current = engine.delivery
    if not (isinstance(current, LoopDelivery) and current.loop is loop):
        engine.set_delivery(LoopDelivery(loop))


class GenerationStream:
    """One admitted request: `await next_event()` until an event has `finished` set."""

    def __init__(self, state: ServingState, request_id: str, arrival_s: float) -> None:
        self.state = state
        self.request_id = request_id
        self.arrival_s = arrival_s  # time.monotonic() when the HTTP request arrived
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._loop = asyncio.get_running_loop()
        # None in the queue means "the client went away" (see client_gone()).
        self._queue = EventQueue()
        self._first_token_s: float | None = None
        self._last_token_s: float | None = None
        self._closed = False

    # Runs on the loop, called by LoopDelivery.
    def sink(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def client_gone(self) -> None:
        """Called on the loop when the client disconnects: wakes next_event() to raise."""
        self._queue.put_nowait(None)

    async def next_event(self) -> RequestOutput:
        """The next engine event; raises ClientGone once client_gone() was called."""
        out = await self._queue.get()
        if out is None:
            raise ClientGone
        now = time.monotonic()
        if out.token_ids:
            if self._first_token_s is None:
                self._first_token_s = now
                self.state.request_events.first_token(
                    FirstToken(self.request_id, now - self.arrival_s)
                )
            else:
                # One engine event per token; a gap covers however many tokens it carries.
                gap = (now - (self._last_token_s or now)) / len(out.token_ids)
                for _ in out.token_ids:
                    self.state.metrics.itl.observe(gap)
            self._last_token_s = now
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        if out.finished:
            self.finish_reason = out.finish_reason or "error"
            self.error = out.error
            self._record_finish(now)
        return out

    def _record_finish(self, now: float) -> None:
        reason = self.finish_reason or "error"
        e2e = now - self.arrival_s
        tpot_s = None
        if self._first_token_s is not None and self.completion_tokens > 1:
            tpot_s = (now - self._first_token_s) / (self.completion_tokens - 1)
        self._publish_finished(reason, tpot_s=tpot_s, e2e_s=e2e)
        self._release(e2e if reason in ("stop", "length") else None)

    def _publish_finished(self, reason: str, *, tpot_s: float | None, e2e_s: float | None) -> None:
        first = self._first_token_s
        self.state.request_events.finished(
            RequestFinished(
                request_id=self.request_id,
                finish_reason=reason,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                ttft_s=None if first is None else first - self.arrival_s,
                tpot_s=tpot_s,
                e2e_s=e2e_s,
            )
        )

    def close(self) -> None:
        """Idempotent. If the engine has not finished the request, abort it there."""
        if self._closed:
            return
        self._closed = True
        if self.finished:
            return
        engine = self.state.engine
        if engine is not None:
            engine.abort(self.request_id)
        self.finish_reason = "abort"
        # Published now: the engine's own abort event arrives after nobody listens any more.
        # Its end was not seen, so it carries no TPOT or E2E.
        self._publish_finished("abort", tpot_s=None, e2e_s=None)
        self._release(None)

    def abort(self) -> None:
        """Ask the engine to end the request; its final event (finish_reason abort) follows."""
        if not self.finished and self.state.engine is not None:
            self.state.engine.abort(self.request_id)

    def _release(self, e2e_s: float | None) -> None:
        self.state.release(e2e_s)
        self.state.live.pop(self.request_id, None)


def start_generation(
    state: ServingState,
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    arrival_s: float,
) -> GenerationStream:
    """Admit and queue one request. Raises Unavailable (no slot) or InvalidRequestError."""
    state.admit()  # guarantees state.engine is set
    engine = state.engine
    stream = GenerationStream(state, request_id, arrival_s)
    stream.prompt_tokens = len(prompt_token_ids)
    state.live[request_id] = stream
    _deliver_on(engine, stream._loop)  # type: ignore[arg-type]
    try:
        engine.add_request(prompt_token_ids, params, stream.sink, request_id=request_id)  # type: ignore[union-attr]
    except InvalidRequestError:
        stream._closed = True
        stream.finish_reason = "error"
        stream._release(None)
        raise
    return stream
