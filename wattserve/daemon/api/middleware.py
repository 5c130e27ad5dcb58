"""Pure-ASGI guards in front of every route: Host allowlist and request-body limit.

The Host check defends against DNS rebinding (a web page that resolves its own name to
127.0.0.1 must not reach a local daemon). The body limit answers 413 as soon as the
declared Content-Length or the bytes received so far pass the limit, so an oversized or
endless chunked body is never read whole; the connection then closes lingering
(wattserve/daemon/api/connection.py), so a client still sending reads its 413 rather than a reset.
Both answer with OpenAI-shaped errors. They
are plain ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched. They must not look at what a body means.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wattserve.daemon.api.errors import error_body


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str,
    *,
    close: bool = False,
    headers: dict[str, str] | None = None,
) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
    ]
    if close:
        # The rest of the request body is still on the wire: the connection cannot be reused.
        raw_headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def host_without_port(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        end = host.find("]")
        return host[: end + 1] if end > 0 else host
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host  # bare IPv6 or no port


class HostAllowlistMiddleware:
    """Reject requests whose Host header is not in the allowlist ('*' allows any)."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allow_any = "*" in allowed_hosts
        # Entries are bare names or addresses; '[::1]'-style entries lose any port.
        self.allowed = {
            host_without_port(h) if h.startswith("[") else h.strip().lower() for h in allowed_hosts
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.allow_any:
            await self.app(scope, receive, send)
            return
        host = ""
        for name, value in scope.get("headers", []):
            if name == b"host":
                host = value.decode("latin-1")
                break
        if host_without_port(host) not in self.allowed:
            shown = host[:100] or "(none)"
            await send_error(
                send,
                400,
                f"Host header {shown!r} is not allowed; add it to server.allowed_hosts",
                "host_not_allowed",
            )
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Buffer at most `max_body_bytes` of a request body; past that, answer 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0:
                    await send_error(
                        send, 400, "invalid Content-Length", "invalid_body", close=True
                    )
                    return
                if declared > limit:
                    await send_error(send, 413, self._message(), "body_too_large", close=True)
                    return
        # Read the body here, bounded, so a chunked body without Content-Length is cut off
        # at the limit too; the app then reads it from the buffer.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_error(send, 413, self._message(), "body_too_large", close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            # After the body, the only message left is http.disconnect: pass it through so
            # handlers and streaming responses notice a client that went away.
            return await receive()

        await self.app(scope, replay, send)

    def _message(self) -> str:
        return f"request body exceeds the limit of {self.max_body_bytes} bytes"
