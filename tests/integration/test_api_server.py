"""The HTTP API on a real uvicorn server with a tiny random-weight model.

Clients are httpx (raw HTTP, SSE parsing) and the official openai package. Covers the
endpoints, the OpenAI response and chunk formats, usage and finish reasons, the
error shapes, the control token, the Host allowlist, the body limit and /metrics.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.api_server import api_config, running_server
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import LoadError
from wattserve.daemon.server import Daemon, bind_socket

TOKEN = "test-token-123"
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_llama):
    cfg = api_config(server={"max_body_bytes": MAX_BODY_BYTES})
    with running_server(cfg, tiny_llama, environ={"WATTSERVE_API_TOKEN": TOKEN}) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c


def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body into JSON objects, plus the literal '[DONE]'."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(
    response: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def test_health_ready_models(client, server) -> None:
    assert client.get("/health").json() == {"status": "ok", "phase": "ready"}
    assert client.get("/ready").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [server.engine.model_name]
    assert models["data"][0]["max_model_len"] == server.engine.max_model_len


def test_completion_non_streaming(client) -> None:
    r = client.post(
        "/v1/completions",
        json={"prompt": "abc def", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert r.headers["x-request-id"] == body["id"]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    # Token-id prompts give the same greedy answer as the text they encode.
    ids = client.post("/v1/completions", json={"prompt": "abc def", "max_tokens": 1}).json()
    assert ids["usage"]["prompt_tokens"] == usage["prompt_tokens"]


def test_stop_string_and_stop_reason(client) -> None:
    base = {"prompt": "hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    visible = full.replace("\ufffd", "")
    assert len(visible) >= 3, full
    stop = visible[len(visible) // 2 : len(visible) // 2 + 2]
    cut = client.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert full.startswith(cut["text"]) and stop not in cut["text"]


def test_completion_streaming_chunks(client) -> None:
    body = {
        "prompt": "abc",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        r.read()
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks[:-1])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    plain = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert text == plain["choices"][0]["text"]  # greedy: streaming changes nothing


def test_chat_streaming_chunks_without_usage(client) -> None:
    body = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        r.read()
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"][0]["delta"] == {}


def test_openai_client_chat_and_completion(server) -> None:
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    model = server.engine.model_name
    chat = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        temperature=0,
        seed=1,
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 5 and chat.usage.prompt_tokens > 0
    stream = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    comp = oai.completions.create(
        model=model, prompt="abc", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 3
    parts = list(
        oai.completions.create(
            model=model,
            prompt="abc",
            max_tokens=3,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(p.choices[0].text for p in parts) == comp.choices[0].text
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="x", max_tokens=1, n=2, best_of=3)
    assert e.value.param == "best_of"


def test_sampling_is_seeded(client) -> None:
    body = {"prompt": "abc", "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    a = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert a == b


@pytest.mark.parametrize(
    ("content", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_body", None),
        (b'"a string"', 400, "invalid_body", None),
        (b"", 400, None, None),
        (b'{"prompt": "x", "temperature": NaN}', 400, "invalid_value", "temperature"),
        (b'{"prompt": "x", "top_p": Infinity}', 400, "invalid_value", "top_p"),
        (b'{"prompt": "x", "top_p": 1.5}', 400, "invalid_value", "top_p"),
        (b'{"prompt": "x", "max_tokens": -3}', 400, "invalid_value", "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 1e400}', 400, None, "max_tokens"),
        (b'{"prompt": "x", "model": "nope"}', 404, "model_not_found", "model"),
        (b'{"prompt": "x", "max_tokens": 100000}', 400, "context_length_exceeded", "max_tokens"),
        (b'{"prompt": [999999]}', 400, None, "prompt"),
        (b'{"prompt": "x", "n": 17}', 400, None, "n"),
        (b'{"prompt": "x", "bogus": 1}', 400, "unknown_parameter", "bogus"),
    ],
)
def test_bad_completion_bodies(client, content, status, code, param) -> None:
    r = client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert_error(r, status, code, param)


def test_prompt_over_context(client, server) -> None:
    long_prompt = [5] * server.engine.max_model_len
    r = client.post("/v1/completions", json={"prompt": long_prompt})
    assert_error(r, 400, "context_length_exceeded", "prompt")
    r = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab " * 400}]}
    )
    assert_error(r, 400, "context_length_exceeded", "messages")
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},
    )
    assert_error(r, 400, "context_length_exceeded", "max_completion_tokens")


def test_unknown_routes_and_methods(client) -> None:
    assert_error(client.get("/v1/nope"), 404, "not_found")
    assert_error(client.delete("/v1/models"), 405, "method_not_allowed")


def test_control_requires_token(client, server) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert_error(client.get("/v1/control/policy"), 401, "missing_token")
    r = client.get("/v1/control/policy", headers={"Authorization": "Bearer wrong"})
    assert_error(r, 401, "invalid_token")
    assert r.headers["www-authenticate"] == "Bearer"
    policy = {
        "power_budget_w": 250.0,
        "ttft_slo_ms": 1500.0,
        "tpot_slo_ms": 120.0,
        "mode": "manual",
    }
    assert client.put("/v1/control/policy", json=policy, headers=auth).json() == policy
    assert client.get("/v1/control/policy", headers=auth).json() == policy
    assert client.get("/v1/status").json()["policy"] == policy
    steering = client.get("/v1/status").json()["controller"]  # the controller took it too
    assert steering["mode"] == "manual" and steering["policy"]["power_budget_w"] == 250.0
    bad = client.put("/v1/control/policy", json={**policy, "tpot_slo_ms": -1}, headers=auth)
    assert_error(bad, 400, param="tpot_slo_ms")
    before = client.get("/v1/control/knobs", headers=auth).json()
    try:
        r = client.put("/v1/control/knobs", json={"max_num_seqs": 3}, headers=auth)
        assert r.json() == {**before, "max_num_seqs": 3}
        assert server.engine.limits.max_num_seqs == 3  # the engine's batch cap moved now
        assert client.get("/v1/status").json()["engine"]["limits"]["max_num_seqs"] == 3
        r = client.put("/v1/control/knobs", json={"clock_mhz": 1500}, headers=auth)
        assert_error(r, 409, "knob_not_applied", "clock_mhz")  # device.mode = observe
        r = client.put("/v1/control/knobs", json={"quant_level": "int8"}, headers=auth)
        assert r.status_code == 200 and r.json()["quant_level"] == "int8"
        done = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert done.status_code == 200
        assert server.engine.quant_level == "int8"  # switched at the next step
        r = client.put("/v1/control/knobs", json={"quant_level": "int3"}, headers=auth)
        assert_error(r, 400, "invalid_quant_level", "quant_level")
        assert server.engine.quant_level == "int8"
        assert_error(
            client.put("/v1/control/knobs", json={"max_num_seqs": 0}, headers=auth),
            400,
            param="max_num_seqs",
        )
        r = client.put("/v1/control/knobs", json={"decode_interval_ms": 40}, headers=auth)
        assert r.status_code == 200 and r.json()["decode_interval_ms"] == 40.0
        assert server.engine.limits.decode_interval_ms == 40.0
        assert client.get("/v1/status").json()["engine"]["limits"]["decode_interval_ms"] == 40.0
        done = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert done.status_code == 200  # paced decode steps still finish the request
        assert_error(
            client.put("/v1/control/knobs", json={"decode_interval_ms": -5}, headers=auth),
            400,
            param="decode_interval_ms",
        )
        assert server.engine.limits.decode_interval_ms == 40.0
    finally:
        keep = ("max_num_seqs", "max_num_batched_tokens", "quant_level", "decode_interval_ms")
        restore = {k: before[k] for k in keep}
        assert client.put("/v1/control/knobs", json=restore, headers=auth).status_code == 200


def test_control_disabled_without_token(tiny_llama) -> None:
    with running_server(api_config(), tiny_llama) as srv:
        r = httpx.get(
            srv.base_url + "/v1/control/policy", headers={"Authorization": "Bearer anything"}
        )
        err = assert_error(r, 403, "control_disabled")
        assert "WATTSERVE_API_TOKEN" in err["message"]


def test_host_allowlist(client, server) -> None:
    port = server.daemon.address[1]
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", "[::1]:80"):
        assert client.get("/health", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        assert_error(client.get("/health", headers={"Host": host}), 400, "host_not_allowed")


def test_body_limit_with_content_length(client) -> None:
    big = {"prompt": "a" * (MAX_BODY_BYTES + 10)}
    assert_error(client.post("/v1/completions", json=big), 413, "body_too_large")


def _raw_request(server, head: bytes, body_parts: list[bytes]) -> bytes:
    """Send a request by hand, never finishing the body, and read the reply."""
    host, port = server.daemon.address
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            reply += data
    return reply


def test_body_limit_declared_length_answered_before_body(server) -> None:
    # Declares 100 MiB and sends none of it: the answer must come from the header alone.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 104857600\r\n\r\n"
    )
    reply = _raw_request(server, head, [])
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"body_too_large"' in reply


def test_body_limit_chunked_without_length(server) -> None:
    # Chunked, no Content-Length, and the terminating chunk never sent: a server that read
    # the body whole would wait forever instead of answering.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 16384
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    reply = _raw_request(server, head, [chunk] * (MAX_BODY_BYTES // len(piece) + 2))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"body_too_large"' in reply


def _samples(client) -> dict[str, float]:
    samples = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics(client) -> None:
    before = _samples(client)
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "ignore_eos": True})
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 10**7})
    client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 1})
    after = _samples(client)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta('wattserve_requests_total{outcome="length"}') == 1
    assert delta('wattserve_requests_total{outcome="rejected_invalid"}') == 2
    assert delta("wattserve_generation_tokens_total") == 3
    assert delta("wattserve_prompt_tokens_total") >= 1
    assert delta("wattserve_time_to_first_token_seconds_count") == 1
    assert delta("wattserve_time_per_output_token_seconds_count") == 1
    assert delta("wattserve_inter_token_latency_seconds_count") == 2
    assert delta("wattserve_e2e_request_latency_seconds_count") == 1
    assert delta("wattserve_engine_step_duration_seconds_count") >= 3
    assert after["wattserve_ready"] == 1
    assert after["wattserve_requests_in_flight"] == 0
    for gauge in (
        "requests_running",
        "requests_waiting",
        "kv_cache_usage_ratio",
        "batch_cap_seqs",
        "batch_cap_tokens",
        "kv_cache_total_blocks",
    ):
        assert f"wattserve_{gauge}" in after


def test_prefix_cache_hits_in_metrics_and_status(client) -> None:
    before = _samples(client)
    body = {"prompt": "a shared system prompt, " * 12, "max_tokens": 1}
    for _ in range(2):  # the second finds the first's full blocks cached
        assert client.post("/v1/completions", json=body).status_code == 200
    after = _samples(client)
    hits = after["wattserve_prefix_cache_hit_tokens_total"]
    queried = after["wattserve_prefix_cache_queried_tokens_total"]
    assert hits - before["wattserve_prefix_cache_hit_tokens_total"] >= 16
    assert queried - before["wattserve_prefix_cache_queried_tokens_total"] >= 32
    prefix = client.get("/v1/status").json()["engine"]["prefix_cache"]
    assert prefix["enabled"] is True
    assert (prefix["hit_tokens"], prefix["queried_tokens"]) == (hits, queried)
    assert prefix["hit_ratio"] == hits / queried


def test_status_snapshot(client) -> None:
    status = client.get("/v1/status").json()
    assert status["phase"] == "ready"
    assert status["engine"]["kv_cache"]["total_blocks"] > 0
    assert status["server"]["control_enabled"] is True
    device = status["device"]
    assert device["capabilities"]["is_virtual"] is True  # no NVML here: the virtual GPU
    assert device["telemetry"]["power_w"] > 0
    assert status["controller"]["mode"] == status["policy"]["mode"]
    assert status["engine"]["quantization"]["level"] == "fp32"


def _start_daemon(cfg, build_engine):
    daemon = Daemon(cfg, build_engine=build_engine, environ={})
    sock = bind_socket("127.0.0.1", 0)
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(asyncio.run(daemon.run(sock, install_signals=False))),
        daemon=True,
    )
    thread.start()
    host, port = sock.getsockname()[:2]
    return daemon, thread, codes, f"http://{host}:{port}"


def _get_until(url: str, ok, limit_s: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            r = httpx.get(url, timeout=5)
            if ok(r) or time.monotonic() > deadline:
                return r
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.02)


def test_not_ready_until_loaded_and_warmed_up(tiny_llama) -> None:
    cfg = api_config()
    release = threading.Event()

    def slow_build() -> Engine:
        release.wait(30)  # the model "loads" until the test has looked at the server
        return Engine(tiny_llama, EngineOptions.from_config(cfg.engine))

    daemon, thread, codes, url = _start_daemon(cfg, slow_build)
    try:
        health = _get_until(url + "/health", lambda r: r.status_code == 200)
        assert health.json() == {"status": "ok", "phase": "loading"}
        assert_error(httpx.get(url + "/ready"), 503, "not_ready")
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert_error(r, 503, "not_ready")
        assert int(r.headers["retry-after"]) >= 1
        assert_error(httpx.get(url + "/v1/models"), 503, "not_ready")
        release.set()
        assert _get_until(url + "/ready", lambda r: r.status_code == 200).status_code == 200
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
    finally:
        release.set()
        daemon.request_shutdown()
        thread.join(30)
    assert codes == [0]


def test_unloadable_model_exits_nonzero(tiny_llama) -> None:
    def broken() -> Engine:
        raise LoadError("/nowhere: no such file or directory")

    daemon, thread, codes, url = _start_daemon(api_config(), broken)
    thread.join(30)
    assert codes == [1]
