"""The front: wattserve's OpenAI-compatible API in front of an attached server.

Completions and chat completions pass through with admission counted in sequences (`n`);
a streamed answer is relayed event by event, with `stream_options.include_usage` asked of
the server (the token count gives TPOT) and the usage taken out again when the client did
not ask for it. TTFT and TPOT are measured here, on what clients see, and handed to the
control loop. A client that goes away closes the upstream stream (the server aborts the
request); the sequences free when that stream is closed. Any other path is forwarded as
is. Errors are OpenAI-shaped. It must not decide anything: the cap is set from outside.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from wattserve.attach.admission import Admission
from wattserve.daemon.api.errors import APIError, install_error_handlers

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Hop-by-hop and length headers are the proxy's own to set.
_DROPPED_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}
)


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


class Front:
    """The front's app and its admission; `app` is served by uvicorn."""

    def __init__(
        self,
        upstream_url: str,
        admission: Admission,
        hooks: FrontHooks | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.upstream_url = upstream_url.rstrip("/")
        self.admission = admission
        self.hooks = hooks or FrontHooks()
        self._clock = clock
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.app = self._build_app()

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.upstream_url,
                timeout=httpx.Timeout(10.0, read=None),
                transport=self._transport,
            )
        return self._client

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            yield
            if self._client is not None:
                await self._client.aclose()
                self._client = None

        app = FastAPI(
            title="wattserve attach front", openapi_url=None, docs_url=None, lifespan=lifespan
        )
        install_error_handlers(app)

        @app.get("/v1/status")
        async def status() -> JSONResponse:
            return JSONResponse(self.hooks.status())

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def generate(request: Request) -> Response:
            return await self._generate(request)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def passthrough(path: str, request: Request) -> Response:
            return await self._forward(request, await request.body())

        return app

    # ---- generation ------------------------------------------------------------------------

    async def _generate(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            raise APIError(400, "the body is not JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        n = sequences_of(body)
        if not body.get("stream"):
            await self.admission.acquire(n)
            try:
                return await self._forward(request, raw)
            finally:
                self.admission.release(n)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, "stream_options must be an object", param="stream_options")
        client_wants_usage = bool(options.get("include_usage"))
        upstream_body = dict(body, stream_options={**options, "include_usage": True})
        started_s = self._clock()
        await self.admission.acquire(n)
        try:
            upstream = await self._open_stream(request, upstream_body)
        except BaseException:
            self.admission.release(n)
            raise
        if upstream.status_code != 200:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                self.admission.release(n)
            return Response(content, upstream.status_code, media_type="application/json")
        return StreamingResponse(
            self._relay(upstream, n, started_s, client_wants_usage),
            media_type="text/event-stream",
        )

    async def _open_stream(self, request: Request, body: dict) -> httpx.Response:
        req = self._http().build_request(
            "POST", request.url.path, json=body, headers=self._headers(request)
        )
        try:
            return await self._http().send(req, stream=True)
        except httpx.HTTPError as e:
            raise APIError(
                502, f"the attached server did not answer: {e}", code="upstream_unavailable"
            ) from None

    async def _relay(
        self, upstream: httpx.Response, n: int, started_s: float, client_wants_usage: bool
    ) -> AsyncIterator[bytes]:
        first_s: float | None = None
        last_s: float | None = None
        completion_tokens: int | None = None
        finished = False
        try:
            async for line in upstream.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    finished = True
                    yield b"data: [DONE]\n\n"
                    continue
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    yield f"data: {payload}\n\n".encode()
                    continue
                now = self._clock()
                if _has_output(chunk):
                    if first_s is None:
                        first_s = now
                        self.hooks.on_ttft_s(first_s - started_s)
                    last_s = now
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    completion_tokens = usage["completion_tokens"]
                if not client_wants_usage and "usage" in chunk:
                    if not chunk.get("choices"):
                        continue  # the usage-only chunk the client did not ask for
                    del chunk["usage"]
                    payload = json.dumps(chunk, separators=(",", ":"))
                yield f"data: {payload}\n\n".encode()
        except httpx.HTTPError as e:
            log.warning("attach front: upstream stream broke: %s", e)
        finally:
            # Shielded: the client's disconnect cancels this generator, and the upstream
            # must still be closed (the server aborts the request) before the slot frees.
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            self.admission.release(n)
            tpot_s = None
            if (
                finished
                and first_s is not None
                and last_s is not None
                and completion_tokens is not None
                and completion_tokens // n > 1
            ):
                tpot_s = (last_s - first_s) / (completion_tokens // n - 1)
                self.hooks.on_tpot_s(tpot_s)
            self.hooks.on_request(
                RequestTiming(
                    None if first_s is None else first_s - started_s,
                    tpot_s,
                    completion_tokens,
                    aborted=not finished,
                )
            )

    # ---- everything else -------------------------------------------------------------------

    def _headers(self, request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS}

    async def _forward(self, request: Request, raw: bytes) -> Response:
        try:
            upstream = await self._http().request(
                request.method,
                request.url.path,
                params=request.query_params,
                content=raw,
                headers=self._headers(request),
            )
        except httpx.HTTPError as e:
            raise APIError(
                502, f"the attached server did not answer: {e}", code="upstream_unavailable"
            ) from None
        headers: dict[str, Any] = {
            k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_HEADERS
        }
        headers.pop("content-encoding", None)
        return Response(upstream.content, upstream.status_code, headers=headers)
