"""The live dashboard: the page at /, its static files, and the event stream it reads.

`build_router(state)` serves wattserve/daemon/dashboard/ (index.html, app.js, style.css and the
vendored uPlot chart library) from memory, read once from the installed package, and
`GET /v1/events/stream`: Server-Sent Events from the live feed (wattserve/daemon/feed.py). On
connect the stream sends one `backlog` event (the feed's last five minutes of telemetry,
its recent events and the energy used since start), then each `telemetry` snapshot and
`event` as it happens, with comment keepalives while the feed is quiet. It ends with an
`end` event when the feed stops or once the daemon drains with no request left in
flight, so it never holds up uvicorn's graceful shutdown. Everything it sends is what
the unauthenticated /v1/status and /metrics already show. At most
`server.max_event_streams` streams are open at once; one more gets 503. It must not
decide, change state or accept writes: the page changes policy through PUT
/v1/control/policy.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from wattserve.daemon.api.errors import APIError, error_response
from wattserve.daemon.api.state import Phase, ServingState
from wattserve.daemon.feed import FeedHub
from wattserve.daemon.mqtt.payloads import EventPayload, TelemetryPayload

# How often the stream looks at the daemon's phase while waiting for the next item.
_POLL_S = 0.25
# A comment line this often while nothing else is sent keeps proxies and clients from
# timing the connection out.
KEEPALIVE_S = 15.0
# How long a browser waits before reconnecting a dropped stream (SSE `retry:`), ms.
_RETRY_MS = 3000
# Per-client queue: a reader this far behind loses its oldest telemetry first.
_SUBSCRIPTION_ITEMS = 256

_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# The page loads only its own files and talks only to this daemon; no inline code.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class _Asset:
    body: bytes
    media_type: str
    etag: str


def load_assets() -> dict[str, _Asset]:
    """The dashboard's files by path relative to the package (e.g. "vendor/uPlot.min.css")."""
    root = importlib.resources.files("wattserve.daemon.dashboard")
    assets: dict[str, _Asset] = {}
    pending = [(root, "")]
    while pending:
        folder, prefix = pending.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                if not entry.name.startswith(("_", ".")):
                    pending.append((entry, f"{prefix}{entry.name}/"))
                continue
            suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
            media_type = _MEDIA_TYPES.get(suffix)
            if media_type is None:
                continue  # __init__.py, the licence text: not served
            body = entry.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
            assets[prefix + entry.name] = _Asset(body, media_type, etag)
    if "index.html" not in assets:
        raise RuntimeError(
            "wattserve/daemon/dashboard/index.html is missing from the installed package"
        )
    return assets


def _asset_response(request: Request, asset: _Asset) -> Response:
    headers = {**_PAGE_HEADERS, "ETag": asset.etag}
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.media_type, headers=headers)


class EnergyCounter:
    """Device energy used since the daemon started, in joules, from the live snapshots.

    Sums each snapshot's window energy (the feed's rise of the device's cumulative
    counter since the previous snapshot, None where the counter restarted), so a device
    reopened adds nothing negative. None until the device reports energy. Called on the
    event loop (a feed listener), read there by the stream: no lock needed.
    """

    def __init__(self) -> None:
        self.total_j: float | None = None

    def on_telemetry(self, payload: TelemetryPayload) -> None:
        if payload.device.energy_j is None:
            return
        window_j = payload.serving.energy_window_j
        self.total_j = (self.total_j or 0.0) + (window_j or 0.0)


def _sse(event: str, data: str) -> bytes:
    return f"event: {event}\ndata: {data}\n\n".encode()


def _stream_over(state: ServingState) -> str | None:
    """Why the stream should end now, or None: the daemon is stopping and no request is
    left to watch (a drain with requests in flight is still worth seeing)."""
    if state.phase is Phase.STOPPED:
        return "stopped"
    if state.phase is Phase.DRAINING and state.in_flight == 0:
        return "draining"
    return None


async def _event_stream(
    feed: FeedHub, stream_over: Callable[[], str | None], energy: EnergyCounter
) -> AsyncIterator[bytes]:
    async with feed.subscribe(_SUBSCRIPTION_ITEMS) as sub:
        # No await between subscribing and reading the backlog: the feed ticks on this
        # loop, so no snapshot falls between the two. An event published from another
        # thread may already be in the backlog and still queued for us: sent once.
        history = feed.history()
        events = feed.recent_events()
        in_backlog = {id(e) for e in events}
        backlog: dict[str, Any] = {
            "telemetry": [t.model_dump(mode="json") for t in history],
            "events": [e.model_dump(mode="json") for e in events],
            "energy_since_start_j": energy.total_j,
            "period_s": feed.period_s,
            "keepalive_s": KEEPALIVE_S,
        }
        yield f"retry: {_RETRY_MS}\n\n".encode() + _sse("backlog", json.dumps(backlog))
        quiet_s = 0.0
        while True:
            reason = stream_over()
            if reason is not None:
                break
            item = await sub.get(_POLL_S)
            if item is None:
                if sub.closed:
                    reason = "feed stopped"
                    break
                quiet_s += _POLL_S
                if quiet_s >= KEEPALIVE_S:
                    quiet_s = 0.0
                    yield b": keepalive\n\n"
                continue
            quiet_s = 0.0
            payload = item.payload
            if isinstance(payload, EventPayload) and id(payload) in in_backlog:
                continue
            yield _sse(item.kind, payload.model_dump_json())
        yield _sse("end", json.dumps({"reason": reason, "dropped": sub.dropped}))


def build_router(state: ServingState) -> APIRouter:
    """The daemon's dashboard: its live feed, ending the stream as the daemon stops."""
    return dashboard_router(
        state.feed, lambda: _stream_over(state), state.cfg.server.max_event_streams
    )


def dashboard_router(
    feed: FeedHub | None, stream_over: Callable[[], str | None], max_streams: int
) -> APIRouter:
    """The dashboard's routes over one feed (the daemon's, or wattserve attach's); counts
    energy from the feed while it runs. stream_over: why an open stream should end now
    (None: it goes on)."""
    assets = load_assets()
    energy = EnergyCounter()
    if feed is not None:
        feed.add_listener(on_telemetry=energy.on_telemetry)
    router = APIRouter(tags=["dashboard"], include_in_schema=False)
    subscribers = _Subscribers(max_streams)

    @router.get("/")
    async def page(request: Request) -> Response:
        return _asset_response(request, assets["index.html"])

    @router.get("/dashboard/{path:path}")
    async def static_file(path: str, request: Request) -> Response:
        asset = assets.get(path)
        if asset is None:
            raise APIError(404, f"no dashboard file {path[:100]!r}", code="not_found")
        return _asset_response(request, asset)

    # Not in the OpenAPI document: a stream that never ends by itself is no operation for
    # a schema-driven client to call (docs/dashboard.md describes it).
    @router.get("/v1/events/stream")
    async def events_stream() -> Response:
        if feed is None:
            raise APIError(503, "the live feed is not running", code="feed_unavailable")
        return _CountedEventStream(_event_stream(feed, stream_over, energy), subscribers)

    return router


@dataclass
class _Subscribers:
    """How many event streams are open, against `server.max_event_streams`."""

    limit: int
    active: int = 0


class _CountedEventStream(StreamingResponse):
    """The event stream, counted while it runs; past the limit it answers 503 instead.

    Counted in __call__, not in the route: Starlette cancels a body iterator that never
    started without running its `finally`, and __call__ always returns.
    """

    def __init__(self, events: AsyncIterator[bytes], subscribers: _Subscribers) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._subscribers = subscribers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        subs = self._subscribers
        if subs.active >= subs.limit:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            refusal = error_response(
                503,
                f"too many event streams open: the limit is {subs.limit} "
                "(server.max_event_streams); retry later",
                code="too_many_event_streams",
                headers={"Retry-After": "5"},
            )
            await refusal(scope, receive, send)
            return
        subs.active += 1
        try:
            await super().__call__(scope, receive, send)
        finally:
            subs.active -= 1
