"""Hostile clients against a real daemon: every one gets a bounded answer, nobody else suffers.

Oversized bodies (fast and slow) read their whole 413 and a clean end of stream, never a
reset; oversized, endless and slow request heads get 431, 408 or a close; a body that trickles in
below the minimum rate gets 408, so slow POSTs cannot hold the connection cap; two Host
headers get 400; a streaming
client that stops reading is cut off and its slot freed; connections and dashboard event
streams are capped with 503; 1,000 idle sockets leave /health answering; huge prompts,
long stop lists and deeply nested JSON get 4xx while a normal request still succeeds.
Raw sockets are used where httpx would hide what the server did on the wire. Every wait
is a bounded loop; no assertion is on elapsed time.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.api_server import api_config, running_server

MAX_BODY_BYTES = 1 << 20  # the default server.max_body_bytes
MAX_HEADER_BYTES = 64 << 10  # the default server.max_header_bytes
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
BODY_MIN_BYTES_PER_S = 100
WRITE_TIMEOUT_S = 1.0
MAX_EVENT_STREAMS = 2
WAIT_LIMIT_S = 30.0
# Every SSE chunk carries the model name: a long one fills the socket buffers in few tokens.
LONG_MODEL_NAME = "m" * 2000


@pytest.fixture(scope="module")
def server(tiny_llama):
    cfg = api_config(
        server={
            "header_timeout_s": HEADER_TIMEOUT_S,
            "body_timeout_s": BODY_TIMEOUT_S,
            "body_min_bytes_per_s": BODY_MIN_BYTES_PER_S,
            "stream_write_timeout_s": WRITE_TIMEOUT_S,
            "max_event_streams": MAX_EVENT_STREAMS,
            "max_waiting_requests": 0,
        },
        engine={"max_model_len": 512, "max_num_seqs": 1, "served_model_name": LONG_MODEL_NAME},
    )
    with running_server(cfg, tiny_llama) as srv:
        yield srv


def _connect(srv, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
    s.settimeout(WAIT_LIMIT_S)
    s.connect(srv.daemon.address)
    return s


def _read_to_eof(s: socket.socket) -> bytes:
    """Everything the server sends until it closes; a reset fails the test (it raises)."""
    reply = b""
    while data := s.recv(65536):
        reply += data
    return reply


def _parse(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def _assert_error_reply(reply: bytes, status: int, code: str) -> dict[str, str]:
    got, headers, body = _parse(reply)
    assert got == status, reply[:300]
    assert headers["content-type"] == "application/json"
    assert len(body) == int(headers["content-length"]), "truncated error body"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return headers


def _post_head(length: int, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _normal_request_works(srv) -> None:
    # Greedy and past end-of-sequence: the tiny model's random weights can sample its EOS
    # at temperature 1, and a normal request that ends early is not the engine's fault.
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


# ---- 1. oversized bodies --------------------------------------------------------------------
BIG_BODY = b'{"prompt": "' + b"a" * (3 << 20) + b'"}'


@pytest.mark.parametrize("attempt", range(5))
def test_oversized_body_sent_at_once_reads_its_413(server, attempt) -> None:
    with _connect(server) as s:
        s.sendall(_post_head(len(BIG_BODY)) + BIG_BODY)  # 3 MiB in one call
        reply = _read_to_eof(s)
    headers = _assert_error_reply(reply, 413, "body_too_large")
    assert headers["connection"] == "close"


def test_oversized_body_sent_slowly_reads_its_413(server) -> None:
    piece = 64 << 10
    with _connect(server) as s:
        s.sendall(_post_head(len(BIG_BODY)))
        for start in range(0, len(BIG_BODY), piece):  # 48 pieces
            s.sendall(BIG_BODY[start : start + piece])
            time.sleep(0.005)
        reply = _read_to_eof(s)
    _assert_error_reply(reply, 413, "body_too_large")


def test_oversized_chunked_body_reads_its_413(server) -> None:
    piece = b"a" * (32 << 10)
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    with _connect(server) as s:
        s.sendall(head + chunk * 96 + b"0\r\n\r\n")  # 3 MiB
        reply = _read_to_eof(s)
    _assert_error_reply(reply, 413, "body_too_large")
    _normal_request_works(server)


# ---- 2. request heads -----------------------------------------------------------------------
def test_too_many_headers_get_431(server) -> None:
    extra = "".join(f"X-Filler-{i}: {i}\r\n" for i in range(200))
    with _connect(server) as s:
        s.sendall(f"GET /health HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n".encode())
        reply = _read_to_eof(s)
    _assert_error_reply(reply, 431, "too_many_headers")


def test_oversized_header_gets_431(server) -> None:
    value = "a" * (MAX_HEADER_BYTES + 1024)
    with _connect(server) as s:
        s.sendall(f"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: {value}\r\n\r\n".encode())
        reply = _read_to_eof(s)
    _assert_error_reply(reply, 431, "headers_too_large")


def test_endless_header_line_is_cut_off(server) -> None:
    # One header line that never ends: the server must answer before we sent 1 MiB of it
    # (the bound is max_header_bytes plus at most one 256 KiB read).
    piece = b"a" * (16 << 10)
    sent = 0
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Endless: ")
        while sent < 4 * MAX_BODY_BYTES:
            readable, _, _ = select.select([s], [], [], 0.01)
            if readable:
                break
            s.sendall(piece)
            sent += len(piece)
        assert sent < MAX_BODY_BYTES, f"no answer after {sent} bytes of one header line"
        reply = _read_to_eof(s)
    _assert_error_reply(reply, 431, "headers_too_large")


def test_slow_headers_are_cut_off(server) -> None:
    # Slowloris: a header line every 0.1 s, forever (bounded here at 100 lines = 10 s).
    lines = 0
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        while lines < 100:
            readable, _, _ = select.select([s], [], [], 0.1)
            if readable:
                break
            s.sendall(b"X-Slow-%d: 1\r\n" % lines)
            lines += 1
        assert lines < 100, "the slow head was never cut off"
        reply = _read_to_eof(s)
    _assert_error_reply(reply, 408, "request_timeout")
    _normal_request_works(server)


def test_two_host_headers_get_400(server) -> None:
    for second in ("localhost", "evil.example"):
        with _connect(server) as s:
            s.sendall(f"GET /health HTTP/1.1\r\nHost: localhost\r\nHost: {second}\r\n\r\n".encode())
            reply = _read_to_eof(s)
        _assert_error_reply(reply, 400, "duplicate_host")
    _normal_request_works(server)


def test_a_body_below_the_minimum_rate_gets_408(server) -> None:
    # 10 bytes a second against a floor of 100 after the first second: cut off about 1.1 s
    # in; bounded here at 200 bytes (20 s).
    sent = 0
    with _connect(server) as s:
        s.sendall(_post_head(1000))
        while sent < 200:
            readable, _, _ = select.select([s], [], [], 0.1)
            if readable:
                break
            s.sendall(b" ")
            sent += 1
        assert sent < 200, "the slow body was never cut off"
        reply = _read_to_eof(s)
    _assert_error_reply(reply, 408, "request_timeout")
    _normal_request_works(server)


def test_a_body_at_the_minimum_rate_is_served(server) -> None:
    # 800 bytes at about 400 a second: longer than the first second, and well above the
    # floor of 100 a second after it (a machine that stretches every sleep 3x still is).
    body = b'{"prompt": "hi", "max_tokens": 1' + b" " * 767 + b"}"
    with _connect(server) as s:
        s.sendall(_post_head(len(body)))
        for start in range(0, len(body), 40):
            s.sendall(body[start : start + 40])
            time.sleep(0.1)
        status, _, _ = _parse(s.recv(65536))
    assert status == 200


def test_slow_posts_do_not_hold_the_connection_cap(tiny_llama) -> None:
    cap, clients = 64, 128
    cfg = api_config(
        server={
            "max_connections": cap,
            "body_timeout_s": BODY_TIMEOUT_S,
            "body_min_bytes_per_s": 1024,
        }
    )
    with running_server(cfg, tiny_llama) as srv, _open_file_limit(2 * clients + 512):
        slow: list[socket.socket] = []
        try:
            for _ in range(clients):  # each sends its head and 10 of 1,000 body bytes
                s = _connect(srv)
                s.sendall(_post_head(1000) + b"{" * 10)
                slow.append(s)
            codes = [json.loads(_parse(_read_to_eof(s))[2])["error"]["code"] for s in slow]
        finally:
            for s in slow:
                s.close()
        # Those within the cap were cut off (a socket never answered fails on its timeout).
        assert set(codes) == {"request_timeout", "too_many_connections"}, set(codes)
        assert codes.count("request_timeout") <= cap
        _wait_for(
            lambda: httpx.get(srv.base_url + "/health", timeout=30).status_code == 200,
            "/health once the slow bodies were cut off",
        )


def test_idle_connection_is_closed(server) -> None:
    with _connect(server) as s:
        assert s.recv(1) == b""  # closed by the header timeout (the socket timeout is 30 s)


# ---- 3. a streaming client that stops reading -----------------------------------------------
def _shrink_listener_send_buffer(srv, size: int) -> None:
    """SO_SNDBUF on the daemon's listening socket; accepted sockets inherit it. Linux grows
    a loopback send buffer to megabytes otherwise, and the tiny model's context would end
    before a client that stops reading filled it."""
    address = tuple(srv.daemon.address)
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # not a socket (or already gone)
        with sock:
            with contextlib.suppress(OSError):
                if (
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and sock.getsockname()[:2] == address
                ):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
                    return
    raise AssertionError("the daemon's listening socket was not found")


def test_stalled_stream_reader_is_cut_off_and_its_slot_freed(server) -> None:
    srv = server
    _shrink_listener_send_buffer(srv, 4096)
    aborts_before = srv.engine.counters.requests_finished["abort"]
    body = json.dumps(
        {"prompt": "abc", "max_tokens": 450, "ignore_eos": True, "temperature": 0, "stream": True}
    ).encode()
    # Decode pacing keeps the 450 tokens from all being generated before the write timeout
    # fires (a tiny model on an idle machine does that in about a second, and the request
    # then ends "length" rather than being aborted): 450 steps x 100 ms = 45 s.
    srv.engine.set_limits(decode_interval_ms=100.0)
    try:
        with _connect(srv, rcvbuf=1024) as s:
            s.sendall(_post_head(len(body)) + body)
            assert s.recv(12).startswith(b"HTTP/1.1 200")
            # Then never read again. The one admission slot is held meanwhile.
            _wait_for(lambda: srv.engine.num_running == 1, "the stream to run")
            r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x"}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            _wait_for(lambda: srv.daemon.state.in_flight == 0, "the stalled stream's slot")
            # The engine aborted it (the slot is freed first, the engine's step follows).
            _wait_for(
                lambda: srv.engine.counters.requests_finished["abort"] == aborts_before + 1,
                "the engine's abort",
            )
            _wait_for(lambda: srv.engine.kv.num_used_blocks == 0, "its KV blocks")
    finally:
        srv.engine.set_limits(decode_interval_ms=0.0)
    _normal_request_works(srv)


# ---- 4. caps on connections and event streams -------------------------------------------------
def test_event_streams_beyond_the_cap_get_503(server) -> None:
    with contextlib.ExitStack() as stack:
        lines = []  # kept: dropping a line iterator closes its stream
        for _ in range(MAX_EVENT_STREAMS):
            client = stack.enter_context(httpx.Client(base_url=server.base_url, timeout=30))
            r = stack.enter_context(client.stream("GET", "/v1/events/stream"))
            assert r.status_code == 200
            lines.append(r.iter_lines())
            assert next(lines[-1]).startswith("retry:")  # the stream is running
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            with client.stream("GET", "/v1/events/stream") as r:
                assert r.status_code == 503
                r.read()
        assert r.json()["error"]["code"] == "too_many_event_streams"
        assert r.headers["retry-after"]

    def one_more_opens() -> bool:
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            with c.stream("GET", "/v1/events/stream") as r:
                return r.status_code == 200

    _wait_for(one_more_opens, "a freed event-stream slot")


def test_connections_beyond_the_cap_get_503(tiny_llama) -> None:
    cap = 4
    with running_server(api_config(server={"max_connections": cap}), tiny_llama) as srv:
        with contextlib.ExitStack() as stack:
            held = [stack.enter_context(httpx.Client(base_url=srv.base_url)) for _ in range(cap)]
            for client in held:  # answered, so accepted; kept alive
                assert client.get("/health").status_code == 200
            with _connect(srv) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
                reply = _read_to_eof(s)
            headers = _assert_error_reply(reply, 503, "too_many_connections")
            assert headers["retry-after"] == "1"
            # The connections within the cap still serve.
            assert held[0].get("/health").status_code == 200

        def health_answers() -> bool:
            return httpx.get(srv.base_url + "/health", timeout=30).status_code == 200

        _wait_for(health_answers, "a freed connection slot")


@contextlib.contextmanager
def _open_file_limit(needed: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        yield
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_thousand_idle_connections_do_not_stop_health(tiny_llama) -> None:
    # Default limits. Client and server ends live in this one process: 2 fds per socket.
    with running_server(api_config(), tiny_llama) as srv, _open_file_limit(2 * 1000 + 512):
        idle: list[socket.socket] = []
        try:
            for _ in range(1000):
                idle.append(socket.create_connection(srv.daemon.address, timeout=30))
            r = httpx.get(srv.base_url + "/health", timeout=30)
            assert r.status_code == 200, r.text
            _normal_request_works(srv)
        finally:
            for s in idle:
                s.close()


# ---- 6. huge and deep bodies ------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "a b " * 250_000, "max_tokens": 4}),
        ("/v1/completions", {"prompt": ["a" * 1_000_000], "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 1_000_000}]}),
        ("/v1/completions", {"prompt": "hi", "stop": ["x" * 1024] * 17}),
        ("/v1/completions", {"prompt": "hi", "stop": ["x" * 1025] * 16}),
        ("/v1/completions", b"[" * 200_000),
        ("/v1/completions", b'{"prompt": ' + b"[" * 200_000),
        ("/v1/chat/completions", b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    ],
    ids=[
        "prompt-1M-chars",
        "prompt-list-1M-chars",
        "chat-1M-chars",
        "17-stops",
        "stops-of-1025",
        "nested-200k",
        "nested-prompt-200k",
        "nested-messages-200k",
    ],
)
def test_huge_or_deep_bodies_get_4xx(server, path, body) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert len(content) <= MAX_BODY_BYTES  # these are refused for what they hold, not size
    r = httpx.post(
        server.base_url + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    _normal_request_works(server)


def test_sixteen_stop_strings_of_1024_chars_are_the_limit(server) -> None:
    # The documented maximum is served (and then sixteen 1,024-char checks per token).
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 8, "stop": ["x" * 1024] * 16},
        timeout=60,
    )
    assert r.status_code == 200, r.text
