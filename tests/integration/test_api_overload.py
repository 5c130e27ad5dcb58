"""Overload: 1 running + 1 waiting slot, 10 concurrent requests -> exactly 2 answers, 8 x 503.

The engine is held by a gate in its step hook while the ten requests arrive, so the
two admitted ones are certainly still in flight when the other eight are refused: the
expected mix does not depend on timing. Opening the gate lets the two complete.
"""

from __future__ import annotations

import asyncio
import threading

import httpx

from tests.api_server import api_config, running_server

N_REQUESTS = 10
MAX_TOKENS = 8
WAIT_S = 30.0


def test_overload_gives_exact_mix_of_200_and_503(tiny_llama) -> None:
    cfg = api_config(server={"max_waiting_requests": 1}, engine={"max_num_seqs": 1})
    gate = threading.Event()
    with running_server(cfg, tiny_llama) as srv:
        # Installed after warm-up; bounded so a failing test cannot hang the engine forever.
        srv.engine.add_step_hook(lambda _stats: gate.wait(WAIT_S))
        statuses, bodies, headers = asyncio.run(_burst(srv.base_url, gate))
        metrics = httpx.get(srv.base_url + "/metrics").text

    assert sorted(statuses) == [200] * 2 + [503] * 8
    for status, body, hdrs in zip(statuses, bodies, headers, strict=True):
        if status == 200:
            choice = body["choices"][0]
            assert choice["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
        else:
            assert body["error"]["code"] == "overloaded"
            assert body["error"]["type"] == "service_unavailable_error"
            assert int(hdrs["retry-after"]) >= 1
    assert 'wattserve_requests_total{outcome="rejected_overload"} 8.0' in metrics
    assert 'wattserve_requests_total{outcome="length"} 2.0' in metrics


async def _burst(base_url: str, gate: threading.Event):
    body = {"prompt": "abc", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    limits = httpx.Limits(max_connections=N_REQUESTS)
    async with httpx.AsyncClient(base_url=base_url, timeout=WAIT_S, limits=limits) as client:
        tasks = [
            asyncio.create_task(client.post("/v1/completions", json=body))
            for _ in range(N_REQUESTS)
        ]
        # The eight refusals come back while the engine is held; then release it.
        for _ in range(int(WAIT_S / 0.05)):
            if sum(t.done() for t in tasks) >= N_REQUESTS - 2:
                break
            await asyncio.sleep(0.05)
        gate.set()
        responses = await asyncio.gather(*tasks)
    return (
        [r.status_code for r in responses],
        [r.json() for r in responses],
        [r.headers for r in responses],
    )
