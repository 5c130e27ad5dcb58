"""The front: wattserve's OpenAI-compatible API in front of an attached server.

Completions and chat completions pass through with admission counted in sequences (`n`);
a streamed answer is relayed event by event, with `stream_options.include_usage` asked of
the server (the token count gives TPOT) and the usage taken out again when the client did
not ask for it. TTFT and TPOT are measured here, on what clients see, and handed to the
control loop. A client that goes away closes the upstream stream (the server aborts the
request); the sequences free when that stream is closed. /v1/status and the routes given
(the dashboard's) are answered here; any other path is forwarded as is. Errors are
OpenAI-shaped. It must not decide anything: the cap is set from outside.

The request path is kept lean, since its cost is added to every client's TTFT: the two
generation paths are plain ASGI (not FastAPI's middleware stack), the upstream client is
one aiohttp session (one keep-alive pool; measured cheaper per request than httpx), and
events are relayed as bytes, parsed only until the first output and where usage shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from wattserve.attach.admission import Admission
from wattserve.daemon.api.errors import APIError, error_body, install_error_handlers

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Hop-by-hop and length headers are the proxy's own to set.
_DROPPED_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}
)
_DROPPED_RAW = frozenset(h.encode() for h in _DROPPED_HEADERS)

_SSE_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
}
_BODY_END = {"type": "http.response.body", "body": b"", "more_body": False}


@dataclass(frozen=True)
class RequestTiming:
    """What the front saw of one streamed request (seconds; None where not measured)."""

    ttft_s: float | None
    tpot_s: float | None
    completion_tokens: int | None
    aborted: bool


@dataclass
class FrontHooks:
    """Where the front's measurements go (the control loop's record_* methods, a bench)."""

    on_ttft_s: Callable[[float], None] = lambda _s: None
    on_tpot_s: Callable[[float], None] = lambda _s: None
    on_request: Callable[[RequestTiming], None] = lambda _t: None
    status: Callable[[], dict] = dict


def sequences_of(body: dict) -> int:
    """The sequences a request holds: its `n` (default 1). Raises APIError 400."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise APIError(400, "n must be an integer >= 1", param="n", code="invalid_value")
    return n


def _has_output(chunk: dict) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return True
    return False


async def _read_body(receive: Callable) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(400, "the client went away", code="client_disconnected")
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


def _upstream_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The client's headers less the hop-by-hop ones; the answer uncompressed (relayed as is)."""
    kept = [
        (k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k.lower() not in _DROPPED_RAW
    ]
    kept.append(("accept-encoding", "identity"))
    return kept


def _content_type(response: aiohttp.ClientResponse) -> bytes:
    return response.headers.get("content-type", "application/json").encode("latin-1")


def _unavailable(e: BaseException) -> APIError:
    return APIError(502, f"the attached server did not answer: {e!r}", code="upstream_unavailable")


async def _send_bytes(send: Callable, status: int, body: bytes, content_type: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type)],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Callable, status: int, body: dict) -> None:
    await _send_bytes(send, status, json.dumps(body).encode(), b"application/json")


class _Stream:
    """One streamed request's measurements while its events are relayed."""

    __slots__ = ("first_s", "last_s", "completion_tokens", "finished", "relayed")

    def __init__(self) -> None:
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.completion_tokens: int | None = None
        self.finished = False
        self.relayed = False  # the relay ended by itself (not cut by the client)


class Front:
    """The front's ASGI app and its admission; the instance is served by uvicorn.

    The two generation paths are served here as plain ASGI (the request path a client's
    TTFT waits on); /v1/status and every other path go to a FastAPI app.
    """

    def __init__(
        self,
        upstream_url: str,
        admission: Admission,
        hooks: FrontHooks | None = None,
        *,
        routers: Sequence[APIRouter] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream_url = upstream_url.rstrip("/")
        self.admission = admission
        self.hooks = hooks or FrontHooks()
        self._routers = tuple(routers)
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self.api = self._build_app()

    @property
    def app(self) -> Front:
        return self

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GENERATION_PATHS
        ):
            try:
                await self._generate(scope, receive, send)
            except APIError as e:
                await _send_json(
                    send, e.status_code, error_body(e.status_code, e.message, e.param, e.code)
                )
            return
        await self.api(scope, receive, send)

    def _http(self) -> aiohttp.ClientSession:
        """One session (one keep-alive pool), made on the serving loop at first use."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
                auto_decompress=False,
            )
        return self._session

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            yield
            if self._session is not None:
                await self._session.close()
                self._session = None

        app = FastAPI(
            title="wattserve attach front", openapi_url=None, docs_url=None, lifespan=lifespan
        )
        install_error_handlers(app)

        @app.get("/v1/status")
        async def status() -> JSONResponse:
            return JSONResponse(self.hooks.status())

        for router in self._routers:  # the dashboard's, ahead of the pass-through
            app.include_router(router)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def passthrough(path: str, request: Request) -> Response:
            return await self._forward(request, await request.body())

        return app

    # ---- generation ------------------------------------------------------------------------

    async def _generate(self, scope: dict, receive: Callable, send: Callable) -> None:
        raw = await _read_body(receive)
        try:
            body = json.loads(raw)
        except ValueError:
            raise APIError(400, "the body is not JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        n = sequences_of(body)
        headers = _upstream_headers(scope["headers"])
        path = scope["path"]
        if not body.get("stream"):
            await self.admission.acquire(n)
            try:
                upstream = await self._send_upstream(path, raw, headers)
                try:
                    content = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as e:
                    raise _unavailable(e) from None
                finally:
                    upstream.release()
            finally:
                self.admission.release(n)
            await _send_bytes(send, upstream.status, content, _content_type(upstream))
            return
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, "stream_options must be an object", param="stream_options")
        client_wants_usage = bool(options.get("include_usage"))
        body["stream_options"] = {**options, "include_usage": True}
        upstream_raw = json.dumps(body, separators=(",", ":")).encode()
        started_s = self._clock()
        await self.admission.acquire(n)
        try:
            upstream = await self._send_upstream(path, upstream_raw, headers)
        except BaseException:
            self.admission.release(n)
            raise
        if upstream.status != 200:
            try:
                content = await upstream.read()
            except (aiohttp.ClientError, TimeoutError):
                content = b""
            finally:
                upstream.release()
                self.admission.release(n)
            await _send_bytes(send, upstream.status, content, _content_type(upstream))
            return
        await self._relay_until_done_or_gone(
            upstream, receive, send, n, started_s, client_wants_usage
        )

    async def _send_upstream(
        self, path: str, content: bytes, headers: list[tuple[str, str]]
    ) -> aiohttp.ClientResponse:
        """POST to the server; the response's body is still to be read."""
        try:
            return await self._http().post(self.upstream_url + path, data=content, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _unavailable(e) from None

    async def _relay_until_done_or_gone(
        self,
        upstream: aiohttp.ClientResponse,
        receive: Callable,
        send: Callable,
        n: int,
        started_s: float,
        client_wants_usage: bool,
    ) -> None:
        """Relay the stream; a client that goes away cancels the relay (uvicorn's send does
        not raise after a disconnect), and the upstream is closed before the slot frees."""
        stream = _Stream()
        me = asyncio.current_task()
        assert me is not None
        cut = False

        async def watch_disconnect() -> None:
            nonlocal cut
            while (await receive())["type"] != "http.disconnect":
                pass
            if not stream.relayed:
                cut = True
                me.cancel()

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            await send(_SSE_START)
            await self._relay(upstream, send, stream, started_s, client_wants_usage)
            stream.relayed = True
            await send(_BODY_END)
        except asyncio.CancelledError:
            if not cut:
                raise
            me.uncancel()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("attach front: upstream stream broke: %r", e)
            await send(_BODY_END)
        finally:
            stream.relayed = True
            watcher.cancel()
            if stream.finished:
                upstream.release()  # read to its end: the connection goes back to the pool
            else:
                upstream.close()  # the server sees the connection go and aborts the request
            self.admission.release(n)
            self._report(stream, n, started_s)

    async def _relay(
        self,
        upstream: aiohttp.ClientResponse,
        send: Callable,
        stream: _Stream,
        started_s: float,
        client_wants_usage: bool,
    ) -> None:
        """Events go out as bytes; a chunk is parsed only until the first output shows (TTFT)
        and where it carries usage (the token count; taken out if the client did not ask)."""
        pending = b""
        async for data in upstream.content.iter_any():
            pending += data
            if b"\n\n" not in pending:
                continue
            *events, pending = pending.split(b"\n\n")
            now = self._clock()
            out = []
            for event in events:
                kept = self._on_event(event, now, stream, started_s, client_wants_usage)
                if kept is not None:
                    out.append(kept)
            if out:
                out.append(b"")
                await send(
                    {"type": "http.response.body", "body": b"\n\n".join(out), "more_body": True}
                )
        if pending.strip():
            await send({"type": "http.response.body", "body": pending, "more_body": True})

    def _on_event(
        self, event: bytes, now: float, stream: _Stream, started_s: float, client_wants_usage: bool
    ) -> bytes | None:
        """One SSE event: what the client gets of it (None: nothing)."""
        if not event.startswith(b"data:"):
            return event
        payload = event[5:].strip()
        if payload == b"[DONE]":
            stream.finished = True
            return event
        if stream.first_s is not None and b'"usage"' not in payload:
            stream.last_s = now  # an output chunk, passed on as it came
            return event
        try:
            chunk = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        if _has_output(chunk):
            if stream.first_s is None:
                stream.first_s = now
                self.hooks.on_ttft_s(now - started_s)
            stream.last_s = now
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            stream.completion_tokens = usage["completion_tokens"]
        if client_wants_usage or "usage" not in chunk:
            return event
        if not chunk.get("choices"):
            return None  # the usage-only chunk the client did not ask for
        del chunk["usage"]
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode()

    def _report(self, stream: _Stream, n: int, started_s: float) -> None:
        tpot_s = None
        tokens = stream.completion_tokens
        if (
            stream.finished
            and stream.first_s is not None
            and stream.last_s is not None
            and tokens is not None
            and tokens // n > 1
        ):
            tpot_s = (stream.last_s - stream.first_s) / (tokens // n - 1)
            self.hooks.on_tpot_s(tpot_s)
        self.hooks.on_request(
            RequestTiming(
                None if stream.first_s is None else stream.first_s - started_s,
                tpot_s,
                tokens,
                aborted=not stream.finished,
            )
        )

    # ---- everything else -------------------------------------------------------------------

    async def _forward(self, request: Request, raw: bytes) -> Response:
        url = self.upstream_url + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        headers = _upstream_headers(request.scope["headers"])
        try:
            async with self._http().request(
                request.method, url, data=raw, headers=headers
            ) as upstream:
                content = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _unavailable(e) from None
        kept: dict[str, Any] = {
            k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_HEADERS
        }
        kept.pop("content-encoding", None)
        return Response(content, upstream.status, headers=kept)
