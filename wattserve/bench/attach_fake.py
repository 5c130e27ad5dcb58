"""A fake vLLM/SGLang server for `wattserve attach`'s tests and its bench's fallback.

It serves a recorded /metrics exposition (tests/data/attach/) with the families wattserve
reads replaced by live values, and an OpenAI streaming endpoint whose speed is set by the
caller (first-token delay, seconds per token). Faults are switches: a family hidden or
renamed, a restart (counters back to zero). It counts the requests it saw, their bodies
and the ones their client abandoned. Loopback only; it must not be used outside tests and
benches.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from wattserve.attach.names import MetricNames

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)(.*)$")
_LE = re.compile(r'le="([^"]+)"')
_LABEL = re.compile(r'[A-Za-z_][A-Za-z0-9_]*="[^"]*"')


@dataclass
class FakeState:
    """The fake's live figures and switches (set from the test's thread)."""

    first_token_s: float = 0.01
    token_s: float = 0.005
    token_s_per_seq: float = 0.0  # added per running sequence: a batch slows every stream
    running: int = 0
    waiting: int = 0
    extra_running: int = 0  # requests the fake pretends to serve for someone else
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    kv_usage: float = 0.0
    hidden: set[str] = field(default_factory=set)  # families left out of /metrics
    renamed: dict[str, str] = field(default_factory=dict)
    bodies: list[dict] = field(default_factory=list)
    aborted: int = 0
    finished: int = 0
    max_running: int = 0

    def restart(self) -> None:
        """A server restart: counters and histograms start again from zero."""
        self.prompt_tokens = self.generation_tokens = 0.0
        self.ttft.clear()
        self.itl.clear()


def _bounds(template: str, family: str) -> list[float]:
    out = []
    for line in template.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == f"{family}_bucket":
            le = _LE.search(m.group(2) or "")
            if le:
                out.append(float(le.group(1)))
    return sorted(set(out))


class FakeServer:
    """The app and its state; `names` says which families are live."""

    def __init__(self, template: str, names: MetricNames, model: str = "fake-model") -> None:
        self.template = template
        self.names = names
        self.model = model
        self.state = FakeState()
        self._lock = threading.Lock()
        self.app = self._build()

    # ---- /metrics --------------------------------------------------------------------------

    def _value(self, sample: str, labels: str) -> float | None:
        s, n = self.state, self.names
        hist = {n.ttft: s.ttft, n.itl: s.itl}
        gauges = {
            n.running: s.running + s.extra_running,
            n.waiting: s.waiting,
            n.kv_usage: s.kv_usage,
        }
        counters = {
            f"{n.prompt_tokens}_total": s.prompt_tokens,
            f"{n.generation_tokens}_total": s.generation_tokens,
        }
        if sample in gauges:
            return float(gauges[sample])
        if sample in counters:
            return counters[sample]
        for family, values in hist.items():
            if sample == f"{family}_count":
                return float(len(values))
            if sample == f"{family}_sum":
                return float(sum(values))
            if sample == f"{family}_bucket":
                le = float(_LE.search(labels).group(1))  # type: ignore[union-attr]
                return float(sum(1 for v in values if v <= le))
        return None

    def metrics_text(self) -> str:
        seen_label_sets: dict[str, str] = {}
        out = []
        with self._lock:
            for line in self.template.splitlines():
                family = self._family_of(line)
                if family in self.state.hidden:
                    continue
                if family in self.state.renamed:
                    line = line.replace(family, self.state.renamed[family], 1)
                    out.append(line)
                    continue
                m = _SAMPLE.match(line)
                if m is None or line.startswith("#"):
                    out.append(line)
                    continue
                name, labels = m.group(1), m.group(2) or ""
                value = self._value(name, labels)
                if value is None:
                    out.append(line)
                    continue
                # Live values on a family's first label set; the others read zero.
                base = ",".join(
                    sorted(x for x in _LABEL.findall(labels) if not x.startswith("le="))
                )
                first = seen_label_sets.setdefault(family, base)
                out.append(f"{name}{labels} {value if base == first else 0.0}")
        return "\n".join(out) + "\n"

    def _family_of(self, line: str) -> str:
        """The family a line belongs to, as names.py spells it (a counter without _total)."""
        if line.startswith("# "):
            parts = line.split()
            name = parts[2] if len(parts) > 2 else ""
        else:
            m = _SAMPLE.match(line)
            if m is None:
                return ""
            name = m.group(1)
            for suffix in ("_bucket", "_count", "_sum", "_created"):
                stem = name[: -len(suffix)]
                if name.endswith(suffix) and f"# TYPE {stem} " in self.template:
                    name = stem
                    break
        return name[: -len("_total")] if name.endswith("_total") else name

    # ---- generation ------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(self.metrics_text())

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def generate(request: Request):
            body = await request.json()
            chat = request.url.path.endswith("chat/completions")
            with self._lock:
                self.state.bodies.append(body)
            n = int(body.get("n") or 1)
            max_tokens = int(body.get("max_tokens") or 8)
            if body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return StreamingResponse(
                    self._stream(request, n, max_tokens, chat, usage),
                    media_type="text/event-stream",
                )
            await self._run(n, max_tokens)
            text = "x" * max_tokens
            choices = [
                {"index": i, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": i, "text": text}
                for i in range(n)
            ]
            return JSONResponse(
                {
                    "id": "fake",
                    "object": "chat.completion" if chat else "text_completion",
                    "model": self.model,
                    "choices": choices,
                    "usage": {"prompt_tokens": 4, "completion_tokens": n * max_tokens},
                }
            )

        return app

    def _begin(self, n: int) -> None:
        with self._lock:
            self.state.running += n
            self.state.max_running = max(self.state.max_running, self.state.running)
            self.state.prompt_tokens += 4 * n

    def _end(self, n: int, aborted: bool) -> None:
        with self._lock:
            self.state.running -= n
            if aborted:
                self.state.aborted += 1
            else:
                self.state.finished += 1

    def token_interval_s(self) -> float:
        return self.state.token_s + self.state.token_s_per_seq * self.state.running

    async def _run(self, n: int, max_tokens: int) -> None:
        self._begin(n)
        try:
            await asyncio.sleep(self.state.first_token_s + self.state.token_s * (max_tokens - 1))
            with self._lock:
                self.state.generation_tokens += n * max_tokens
                self.state.ttft.extend([self.state.first_token_s] * n)
                self.state.itl.extend([self.state.token_s] * (n * (max_tokens - 1)))
        finally:
            self._end(n, aborted=False)

    async def _stream(self, request: Request, n: int, max_tokens: int, chat: bool, usage: bool):
        self._begin(n)
        aborted = True
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            started = time.monotonic()
            await asyncio.sleep(self.state.first_token_s)
            with self._lock:
                self.state.ttft.extend([time.monotonic() - started] * n)
            for t in range(max_tokens):
                if t:
                    await asyncio.sleep(self.token_interval_s())
                for i in range(n):
                    choice = (
                        {"index": i, "delta": {"content": "x"}}
                        if chat
                        else {"index": i, "text": "x"}
                    )
                    chunk = {"id": "fake", "object": obj, "model": self.model, "choices": [choice]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                with self._lock:
                    self.state.generation_tokens += n
                    if t:
                        self.state.itl.extend([self.token_interval_s()] * n)
            if usage:
                total = {"prompt_tokens": 4, "completion_tokens": n * max_tokens}
                chunk = {
                    "id": "fake",
                    "object": obj,
                    "model": self.model,
                    "choices": [],
                    "usage": total,
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
            aborted = False
        finally:
            self._end(n, aborted)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(app, port: int | None = None) -> Iterator[str]:
    """Serve an ASGI app on a loopback port in a thread; yields its base URL."""
    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="attach-fake", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10.0)


def main(argv: list[str] | None = None) -> int:
    """Serve the fake in this process until killed (the bench's overhead pairs)."""
    import argparse

    from wattserve.attach.names import BY_KIND

    p = argparse.ArgumentParser(prog="python -m wattserve.bench.attach_fake")
    p.add_argument("--exposition", required=True, help="a recorded /metrics file")
    p.add_argument("--kind", choices=sorted(BY_KIND), default="vllm")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--first-token-s", type=float, default=0.02)
    p.add_argument("--token-s", type=float, default=0.001)
    args = p.parse_args(argv)
    with open(args.exposition) as f:
        fake = FakeServer(f.read(), BY_KIND[args.kind])
    fake.state.first_token_s, fake.state.token_s = args.first_token_s, args.token_s
    uvicorn.run(fake.app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
