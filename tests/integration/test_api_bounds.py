"""One request must not take the server: per-request bounds, off-loop answers, fcfs priority.

Requests over server.max_choices_per_request or server.max_prompt_logprob_tokens get an
OpenAI-shaped 400 naming the key before the engine sees anything; a 256-choice answer with
echoed prompt logprobs is assembled and encoded while the server's event loop keeps
turning (its lag measured with the loop's own clock); under server.scheduling_policy fcfs
only priority 0 is served. The tiny random model answers; nothing asserts on speed except
the loop-lag bound the issue sets.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import httpx
import pytest

from tests.api_server import api_config, running_server

WAIT_S = 120.0
LAG_PROBE_S = 0.005  # the probe's sleep; its overshoot is the loop's lag
MAX_LAG_S = 0.1  # issue 46: /health answers within 100 ms while a big answer is built


def _ids(n: int, offset: int = 0) -> list[int]:
    """A prompt of n token ids inside the tiny model's 512-token vocabulary."""
    return [10 + (offset * 7 + i) % 480 for i in range(n)]


def _engine_work(srv) -> tuple[int, int]:
    c = srv.engine.counters
    return c.prompt_tokens, sum(c.requests_finished.values())


def _error(r: httpx.Response, param: str, code: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (
        param,
        code,
        "invalid_request_error",
    )
    return error["message"]


@pytest.fixture(scope="module")
def server(tiny_llama):
    cfg = api_config(server={"max_prompt_logprob_tokens": 100})
    with running_server(cfg, tiny_llama) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as c:
        yield c


# ---- choices per request ----------------------------------------------------------------------
def test_more_choices_than_the_bound_get_400_before_any_work(server, client) -> None:
    before = _engine_work(server)
    body = {"prompt": ["a"] * 16, "n": 16, "max_tokens": 1}  # 256 choices; the default is 16
    message = _error(client.post("/v1/completions", json=body), "n", "too_many_choices")
    assert "256" in message and "server.max_choices_per_request" in message
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 16, "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200  # at the bound
    after_chat = _engine_work(server)
    assert after_chat != before  # the counters do move for served work
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 9, "max_tokens": 1})
    _error(r, "n", "too_many_choices")
    assert _engine_work(server) == after_chat  # refused before the engine saw anything


def test_choices_at_the_bound_are_served(client) -> None:
    body = {"prompt": ["a", "b"], "n": 8, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(16))


# ---- prompt-logprob tokens --------------------------------------------------------------------
def test_prompt_logprob_tokens_over_the_bound_get_400(server, client) -> None:
    before = _engine_work(server)
    body = {"prompt": _ids(60), "n": 2, "echo": True, "logprobs": 5, "max_tokens": 1}
    message = _error(
        client.post("/v1/completions", json=body), "logprobs", "too_many_prompt_logprobs"
    )
    assert "120" in message and "server.max_prompt_logprob_tokens" in message
    two_prompts = {**body, "prompt": [_ids(60), _ids(60, 1)], "n": 1}  # counted over prompts
    _error(client.post("/v1/completions", json=two_prompts), "logprobs", "too_many_prompt_logprobs")
    assert _engine_work(server) == before


@pytest.mark.parametrize(
    "extra",
    [{"n": 1, "echo": True, "logprobs": 5}, {"n": 2, "logprobs": 5}, {"n": 2, "echo": True}],
    ids=["echo-logprobs-within", "logprobs-without-echo", "echo-without-logprobs"],
)
def test_requests_within_the_logprob_bound_are_served(client, extra) -> None:
    body = {"prompt": _ids(60), "max_tokens": 1, "ignore_eos": True, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if extra.get("echo") and extra.get("logprobs"):
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 61  # prompt + 1


# ---- priority under fcfs ----------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fcfs_refuses_a_nonzero_priority(server, client, path) -> None:
    body = (
        {"prompt": "hi", "max_tokens": 1}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    before = _engine_work(server)
    for priority in (-5, 3):
        r = client.post(path, json={**body, "priority": priority})
        message = _error(r, "priority", "priority_not_enabled")
        assert "server.scheduling_policy" in message
    assert _engine_work(server) == before
    assert client.post(path, json={**body, "priority": 0}).status_code == 200
    assert client.post(path, json=body).status_code == 200


def test_priority_policy_serves_priorities_first(tiny_llama) -> None:
    """Under "priority" the scheduler orders by it, as before: with one running slot held,
    a later request with a lower priority value is served before an earlier one."""
    cfg = api_config(server={"scheduling_policy": "priority"}, engine={"max_num_seqs": 1})
    gate = threading.Event()
    with running_server(cfg, tiny_llama) as srv:
        srv.engine.add_step_hook(lambda _stats: gate.wait(WAIT_S))
        order = asyncio.run(_priority_race(srv, gate))
    assert order == ["urgent", "late"]


async def _priority_race(srv, gate: threading.Event) -> list[str]:
    order: list[str] = []
    body = {"prompt": "abc", "max_tokens": 2, "ignore_eos": True, "temperature": 0}

    async def send(client: httpx.AsyncClient, name: str, priority: int) -> None:
        r = await client.post("/v1/completions", json={**body, "priority": priority})
        assert r.status_code == 200, r.text
        order.append(name)

    async with httpx.AsyncClient(base_url=srv.base_url, timeout=WAIT_S) as client:
        first = asyncio.create_task(send(client, "first", 0))  # holds the one running slot
        await _until(lambda: srv.engine.num_running == 1)
        # The engine is held in its step hook: both reach its inbox before it looks again.
        late = asyncio.create_task(send(client, "late", 5))
        await _until(lambda: srv.daemon.state.in_flight == 2)
        urgent = asyncio.create_task(send(client, "urgent", -5))
        await _until(lambda: srv.daemon.state.in_flight == 3)
        gate.set()
        await asyncio.gather(first, late, urgent)
    return [name for name in order if name != "first"]


async def _until(condition) -> None:
    for _ in range(int(WAIT_S / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition never held")


# ---- a large answer is built off the loop -----------------------------------------------------
# Found (issue 46): a full garbage collection walked every object of torch, transformers and
# the test session, 0.25-0.34 s with the GIL held, on whichever thread's allocation set it
# off; 1 run in 3 that was the loop's. The daemon now freezes its start-up heap once warm.
def test_loop_keeps_turning_while_a_256_choice_answer_is_built(tiny_llama) -> None:
    prompt_tokens = 128
    cfg = api_config(
        server={"max_choices_per_request": 256, "max_prompt_logprob_tokens": 1 << 20},
        engine={"kv_cache_bytes": 96 << 20, "max_num_batched_tokens": 4096},
    )
    body = {
        "prompt": [_ids(prompt_tokens, p) for p in range(16)],
        "n": 16,
        "echo": True,
        "logprobs": 20,
        "max_tokens": 1,
        "ignore_eos": True,
    }
    gc.unfreeze()  # an earlier daemon of this session may have frozen it: this one must
    with running_server(cfg, tiny_llama) as srv:
        assert gc.get_freeze_count() > 0, "the daemon froze its start-up heap"
        stop = threading.Event()
        samples: list[tuple[float, float]] = []
        probe = asyncio.run_coroutine_threadsafe(_probe_loop(stop, samples), srv.daemon._loop)
        with httpx.Client(base_url=srv.base_url, timeout=WAIT_S) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                # The answer is built before its first byte is sent: stop measuring here, so
                # that this process parsing 10+ MB of JSON is not counted as the server's.
                stop.set()
                probe.result(WAIT_S)
                assert r.status_code == 200
                answer = r.read()
            health = client.get("/health")
    assert health.status_code == 200
    choices = httpx.Response(200, content=answer).json()["choices"]
    assert len(choices) == 256
    assert all(len(c["logprobs"]["tokens"]) == prompt_tokens + 1 for c in choices)
    assert all(len(c["logprobs"]["top_logprobs"][1]) >= 1 for c in choices)
    assert len(samples) > 10  # the probe ran through the request
    busy_s = max(busy for busy, _ in samples)
    lag_s = max(lag for _, lag in samples)
    assert busy_s < MAX_LAG_S, f"the loop ran {busy_s:.3f} s at once (wall lag {lag_s:.3f} s)"


async def _probe_loop(stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    """Sleep LAG_PROBE_S again and again on the server's loop. Each sleep's overshoot on the
    loop's clock is its lag; the loop thread's CPU time over the sleep is the part of that
    lag the loop spent running other callbacks. Only the latter is asserted on: on a shared
    machine the process may get no CPU for a second, with the loop idle, and that is not the
    server's doing. Appends (busy_s, lag_s)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        start_s, start_cpu_s = loop.time(), time.thread_time()
        await asyncio.sleep(LAG_PROBE_S)
        lag_s = loop.time() - start_s - LAG_PROBE_S
        samples.append((time.thread_time() - start_cpu_s, lag_s))
