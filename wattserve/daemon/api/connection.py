"""Bounds on each HTTP connection, below the ASGI app: uvicorn's httptools protocol plus limits.

uvicorn's httptools protocol bounds none of these, and an ASGI middleware cannot see them:
- the request head: more than `max_header_bytes` (counted on the wire, so one endless
  header line is cut off too) or `max_header_count` fields get 431;
- its arrival time: a head not whole `header_timeout_s` after the connection (or its
  previous response) was ready is cut off (408 if it had begun), so slowloris clients and
  idle sockets do not pile up;
- its body's arrival: a body not whole `body_timeout_s` after its head, plus one second
  per `body_min_bytes_per_s` bytes received, is cut off with 408 (slow POSTs would
  otherwise hold their connections, and fill `max_connections`, for ever);
- the number of connections: a request on a connection beyond `max_connections` gets 503;
- two Host headers in one request: 400, as HTTP/1.1 requires (the app would see one);
- a client that stops reading: no write progress for `stream_write_timeout_s` aborts the
  connection; the app then sees http.disconnect and frees the request's slot;
- closing while the client is still sending (a 413 before the body was read): the write
  side is shut after the answer and the rest is read and dropped for a bounded time and
  size (a lingering close), so the client reads its answer instead of a TCP reset.
Every answer is OpenAI-shaped with `Connection: close`. This module must not look at
paths or bodies, nor know about the engine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from wattserve.daemon.api.errors import error_body
from wattserve.daemon.api.middleware import send_error
from wattserve.daemon.config import ServerConfig

log = logging.getLogger("wattserve.connection")

# A lingering close drops at most this much of an unwanted request body, for at most this
# long, before it closes anyway: a client that keeps sending past either gets the reset.
LINGER_MAX_BYTES = 64 << 20
LINGER_S = 5.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    max_header_bytes: int
    max_header_count: int
    header_timeout_s: float
    stream_write_timeout_s: float
    body_timeout_s: float
    body_min_bytes_per_s: int

    @classmethod
    def from_config(cls, server: ServerConfig) -> ConnectionLimits:
        return cls(
            max_connections=server.max_connections,
            max_header_bytes=server.max_header_bytes,
            max_header_count=server.max_header_count,
            header_timeout_s=server.header_timeout_s,
            stream_write_timeout_s=server.stream_write_timeout_s,
            body_timeout_s=server.body_timeout_s,
            body_min_bytes_per_s=server.body_min_bytes_per_s,
        )


def protocol_factory(limits: ConnectionLimits) -> Any:
    """What uvicorn.Config(http=...) takes: builds one BoundedHttpProtocol per connection."""
    return functools.partial(BoundedHttpProtocol, limits=limits)


def _refusal(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Any:
    """An ASGI app that answers every request with this error and closes the connection."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send_error(send, status, message, code, close=True, headers=headers)

    return app


def _raw_error(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response, for answers written before any request exists."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Transport:
    """The transport as uvicorn's protocol sees it: close() is the protocol's (lingering)."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedHttpProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_connection()

    def is_closing(self) -> bool:
        return self._protocol.closing or self._transport.is_closing()


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits in the module docstring."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.closing = False  # a close began: lingering or done
        self._raw: asyncio.Transport | None = None
        self._shutting_down = False
        self._over_cap = False
        # The head being received: open from connection start (or the previous request's
        # end) until its headers are complete; bytes counted on the wire while open.
        self._head_open = True
        self._head_bytes = 0
        self._head_chunk_clean = True  # this chunk's bytes all belong to the open head
        self._head_fields = 0
        self._head_field_bytes = 0
        self._head_hosts = 0
        self._request_open = False  # a request began and its body is not all read
        self._lingered_bytes = 0
        # The body being received: from its head's end until the message is complete.
        self._body_started_s = 0.0
        self._body_bytes = 0
        self._body_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None

    # ---- connection life --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        self._over_cap = len(self.connections) > self.limits.max_connections
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._write_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self.closing = True
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self._shutting_down = True  # the server is stopping: no lingering
        super().shutdown()

    def close_connection(self) -> None:
        """Close; linger first if the client may still be sending its request."""
        raw = self._raw
        if raw is None or self.closing or raw.is_closing():
            return
        self.closing = True
        if self._request_open and not self._shutting_down and raw.can_write_eof():
            # The answer is queued: FIN after it, then drop what the client still sends
            # until it closes, or the bounds end it.
            raw.write_eof()
            raw.resume_reading()
            self._linger_timer = self.loop.call_later(LINGER_S, raw.close)
            return
        raw.close()

    # ---- reading ------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closing:
            # Lingering: the request's answer is sent, the rest of it is dropped.
            self._lingered_bytes += len(data)
            if self._lingered_bytes > LINGER_MAX_BYTES and self._raw is not None:
                self._raw.close()
            return
        self._head_chunk_clean = self._head_open
        if self._body_timer is not None:
            self._body_bytes += len(data)  # a head's tail in the same read counts too
        super().data_received(data)
        if self._head_open and not self.closing:
            # A head that began inside this chunk is counted from the next one: the bound
            # is then max_header_bytes plus at most one read (asyncio reads <= 256 KiB).
            self._head_bytes = self._head_bytes + len(data) if self._head_chunk_clean else 0
            if self._head_bytes > self.limits.max_header_bytes:
                self._reject_head(431, self._header_bytes_message(), "headers_too_large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_open = True
        self._head_fields = 0
        self._head_field_bytes = 0
        self._head_hosts = 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_field_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_fields += 1
        self._head_field_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if name.lower() == b"host":
            self._head_hosts += 1

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._head_chunk_clean = False
        self._head_bytes = 0
        self._arm_body_timer()
        refusal = self._refusal_for_head()
        if refusal is None:
            super().on_headers_complete()
            return
        # uvicorn's own request cycle answers, so that pipelining and flow control hold.
        app = self.app
        self.app = refusal
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._request_open = False
        self._head_open = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def _refusal_for_head(self) -> Any | None:
        limits = self.limits
        if self._head_fields > limits.max_header_count:
            return _refusal(
                431,
                f"the request has {self._head_fields} header fields; the limit is "
                f"{limits.max_header_count} (server.max_header_count)",
                "too_many_headers",
            )
        if self._head_field_bytes > limits.max_header_bytes:
            return _refusal(431, self._header_bytes_message(), "headers_too_large")
        if self._head_hosts > 1:
            return _refusal(
                400,
                f"the request has {self._head_hosts} Host headers; HTTP/1.1 allows one",
                "duplicate_host",
            )
        if self._over_cap:
            return _refusal(
                503,
                f"too many open connections: the limit is {limits.max_connections} "
                "(server.max_connections); retry later",
                "too_many_connections",
                headers={"Retry-After": "1"},
            )
        return None

    def _header_bytes_message(self) -> str:
        return (
            f"the request line and headers exceed {self.limits.max_header_bytes} bytes "
            "(server.max_header_bytes)"
        )

    def _idle_or_in_head(self) -> bool:
        """No request is being answered on this connection (none yet, or the last is done)."""
        return (self.cycle is None or self.cycle.response_complete) and not self.pipeline

    def _reject_head(self, status: int, message: str, code: str) -> None:
        """Answer a head that cannot become a request, then close (lingering)."""
        assert self._raw is not None
        if self._idle_or_in_head():
            log.warning("refusing a request head: %s", message)
            self._raw.write(_raw_error(status, message, code))
        # else: a response is in progress here; a second one would corrupt it.
        self.close_connection()

    # ---- timers -------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.closing or not self._idle_or_in_head():
            return  # a request is being answered: no head is late
        if self._request_open:
            self._reject_head(
                408,
                f"the request head did not arrive within {self.limits.header_timeout_s:g} s "
                "(server.header_timeout_s)",
                "request_timeout",
            )
        else:
            self.close_connection()  # idle: nothing to answer

    def _arm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_started_s = self.loop.time()
        self._body_bytes = 0
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _body_deadline_s(self) -> float:
        limits = self.limits
        earned_s = self._body_bytes / limits.body_min_bytes_per_s
        return self._body_started_s + limits.body_timeout_s + earned_s

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.closing or not self._request_open:
            return
        now = self.loop.time()
        if self.flow.read_paused:
            # We stopped reading (the app is busy, or a pipelined request waits its turn):
            # the client is not late. The body gets a fresh period once reading resumes.
            self._body_started_s = now - self._body_bytes / self.limits.body_min_bytes_per_s
        left_s = self._body_deadline_s() - now
        if left_s > 0:
            self._body_timer = self.loop.call_later(left_s, self._body_timed_out)
            return
        message = (
            f"the request body did not arrive in time: {self._body_bytes} bytes in "
            f"{now - self._body_started_s:.1f} s (server.body_timeout_s "
            f"{self.limits.body_timeout_s:g} s, then server.body_min_bytes_per_s "
            f"{self.limits.body_min_bytes_per_s})"
        )
        log.warning(
            "client %s: %s",
            f"{self.client[0]}:{self.client[1]}" if self.client else "?",
            message,
        )
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not self.pipeline:
            assert self._raw is not None
            self._raw.write(_raw_error(408, message, "request_timeout"))
            # The app waiting for the body reads http.disconnect, and answers nothing more.
            cycle.disconnected = True
            cycle.message_event.set()
        self.close_connection()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.limits.stream_write_timeout_s, self._write_timed_out
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        log.warning(
            "client %s took no response bytes for %g s (server.stream_write_timeout_s): "
            "closing its connection",
            f"{self.client[0]}:{self.client[1]}" if self.client else "?",
            self.limits.stream_write_timeout_s,
        )
        if self._raw is not None:
            self.closing = True
            self._raw.abort()  # the buffered answer is dropped: nobody reads it
