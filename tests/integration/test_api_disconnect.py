"""A client that goes away has its sequence aborted and its KV blocks freed.

The engine is slowed by a step hook (a sleep per step, as a slower device would be) so
that a long generation is certainly still running when the client closes the
connection; the checks then poll, bounded, until the engine is empty again.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.api_server import api_config, running_server

STEP_SLEEP_S = 0.02
MAX_TOKENS = 200  # >= 4 s of generation at the slowed step rate
POLL_LIMIT_S = 20.0


@pytest.fixture(scope="module")
def slow_server(tiny_llama):
    with running_server(api_config(), tiny_llama) as srv:
        srv.engine.add_step_hook(lambda _stats: time.sleep(STEP_SLEEP_S))
        yield srv


def _wait_engine_idle(srv) -> None:
    deadline = time.monotonic() + POLL_LIMIT_S
    while time.monotonic() < deadline:
        if (
            srv.engine.num_running == 0
            and srv.engine.num_waiting == 0
            and srv.engine.kv.num_used_blocks == 0
            and srv.daemon.state.in_flight == 0
        ):
            return
        time.sleep(0.02)
    raise AssertionError(
        f"engine not idle: running={srv.engine.num_running} kv={srv.engine.kv.num_used_blocks}"
    )


def _aborted(srv) -> float:
    for line in httpx.get(srv.base_url + "/metrics").text.splitlines():
        if line.startswith('wattserve_requests_total{outcome="abort"}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("abort counter missing")


BODY = {"prompt": "abc", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}


def test_streaming_client_disconnect_frees_the_sequence(slow_server) -> None:
    srv = slow_server
    aborted_before = _aborted(srv)
    engine_aborts_before = srv.engine.counters.requests_finished["abort"]
    with httpx.Client(base_url=srv.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6), strict=False) if line]
            assert got and srv.engine.num_running == 1 and srv.engine.kv.num_used_blocks > 0
        # Leaving the block closes the connection mid-stream.
    _wait_engine_idle(srv)
    assert srv.engine.counters.requests_finished["abort"] == engine_aborts_before + 1
    assert _aborted(srv) == aborted_before + 1


def test_streaming_disconnect_frees_every_choice(slow_server) -> None:
    srv = slow_server
    engine_aborts_before = srv.engine.counters.requests_finished["abort"]
    body = {**BODY, "stream": True, "n": 3, "temperature": 1.0, "seed": 1}
    with httpx.Client(base_url=srv.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(12), strict=False) if line]
            assert got and srv.engine.num_running == 3
    _wait_engine_idle(srv)
    assert srv.engine.counters.requests_finished["abort"] == engine_aborts_before + 3


def test_non_streaming_client_disconnect_frees_the_sequence(slow_server) -> None:
    srv = slow_server
    aborted_before = _aborted(srv)
    host, port = srv.daemon.address
    payload = httpx.Request("POST", srv.base_url + "/v1/completions", json=BODY)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload.content)}\r\n\r\n"
    )
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(head.encode() + payload.content)
        deadline = time.monotonic() + POLL_LIMIT_S
        while srv.engine.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.engine.num_running == 1
    _wait_engine_idle(srv)
    assert _aborted(srv) == aborted_before + 1
