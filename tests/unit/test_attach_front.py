"""The attach front against the fake server: pass-through, usage, admission in sequences,
disconnects, its own TTFT/TPOT, and OpenAI-shaped errors."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from wattserve.attach.admission import Admission
from wattserve.attach.front import Front, FrontHooks
from wattserve.attach.names import SGLANG
from wattserve.bench.attach_fake import FakeServer, free_port, serve_in_thread

DATA = Path(__file__).resolve().parent.parent / "data" / "attach"


@pytest.fixture
def fake():
    server = FakeServer((DATA / "sglang-00ae9c1.metrics").read_text(), SGLANG)
    with serve_in_thread(server.app) as url:
        server.url = url
        yield server


def _front(url: str, cap: int = 64):
    ttft: list[float] = []
    tpot: list[float] = []
    front = Front(url, Admission(cap), FrontHooks(on_ttft_s=ttft.append, on_tpot_s=tpot.append))
    return front, ttft, tpot


def _events(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def _stream(base: str, body: dict) -> list[str]:
    with httpx.Client(base_url=base, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": True, **body})
        assert r.status_code == 200
        return _events(r.text)


def test_stream_passes_through_and_usage_asked_upstream_is_removed(fake) -> None:
    front, _, _ = _front(fake.url)
    with serve_in_thread(front.app) as base:
        events = _stream(base, {"max_tokens": 5})
    assert fake.state.bodies[-1]["stream_options"] == {"include_usage": True}
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "xxxxx"
    assert all("usage" not in c for c in chunks)


def test_usage_kept_when_the_client_asked(fake) -> None:
    front, _, _ = _front(fake.url)
    with serve_in_thread(front.app) as base:
        events = _stream(base, {"max_tokens": 3, "stream_options": {"include_usage": True}})
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


def test_front_measures_ttft_and_tpot_as_clients_see_them(fake) -> None:
    fake.state.first_token_s, fake.state.token_s = 0.2, 0.02
    front, ttft, tpot = _front(fake.url)
    with serve_in_thread(front.app) as base:
        _stream(base, {"max_tokens": 11})
    assert len(ttft) == 1 and ttft[0] >= 0.2
    assert len(tpot) == 1 and 0.015 <= tpot[0] <= 0.2


def test_non_streaming_and_other_paths_pass_through(fake) -> None:
    front, _, _ = _front(fake.url)
    with serve_in_thread(front.app) as base, httpx.Client(base_url=base, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert c.get("/v1/models").json()["data"][0]["id"] == "fake-model"


def test_admission_counts_sequences_not_requests(fake) -> None:
    fake.state.token_s = 0.03
    front, _, _ = _front(fake.url, cap=3)
    with serve_in_thread(front.app) as base:
        threads = [
            threading.Thread(target=_stream, args=(base, {"max_tokens": 15, "n": 2}))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # Two sequences each: a second request would make four > 3, so they ran one at a time.
    assert fake.state.max_running == 2
    assert fake.state.finished == 3
    assert front.admission.in_flight_seqs == 0


def test_a_request_wider_than_the_cap_runs_alone(fake) -> None:
    front, _, _ = _front(fake.url, cap=2)
    with serve_in_thread(front.app) as base:
        events = _stream(base, {"max_tokens": 2, "n": 5})
    assert events[-1] == "[DONE]" and fake.state.max_running == 5


def test_cap_raised_from_another_thread_admits_waiters(fake) -> None:
    fake.state.token_s = 0.05
    front, _, _ = _front(fake.url, cap=1)
    with serve_in_thread(front.app) as base:
        threads = [
            threading.Thread(target=_stream, args=(base, {"max_tokens": 20})) for _ in range(3)
        ]
        for t in threads:
            t.start()
        time.sleep(0.3)
        front.admission.set_max_num_seqs(3)
        for t in threads:
            t.join()
    assert fake.state.max_running >= 2


def test_client_disconnect_aborts_upstream_and_frees_its_slot(fake) -> None:
    fake.state.token_s = 0.05
    front, _, _ = _front(fake.url, cap=4)
    with serve_in_thread(front.app) as base:
        with httpx.Client(base_url=base, timeout=30) as c:
            body = {"prompt": "hi", "stream": True, "max_tokens": 400, "n": 3}
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        # Asked before the break: leaving iter_lines closes the connection.
                        in_flight_while_streaming = front.admission.in_flight_seqs
                        break
        assert in_flight_while_streaming == 3
        deadline = time.monotonic() + 10
        while (fake.state.aborted == 0 or front.admission.in_flight_seqs) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
    assert fake.state.aborted == 1
    assert front.admission.in_flight_seqs == 0
    assert fake.state.running == 0


def test_bad_n_is_a_400_in_openai_shape(fake) -> None:
    front, _, _ = _front(fake.url)
    with serve_in_thread(front.app) as base, httpx.Client(base_url=base, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "n": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"
    assert fake.state.bodies == []


def test_server_down_is_a_502_in_openai_shape() -> None:
    front, _, _ = _front(f"http://127.0.0.1:{free_port()}")
    with serve_in_thread(front.app) as base, httpx.Client(base_url=base, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_unavailable"
        assert front.admission.in_flight_seqs == 0


def test_a_body_that_is_not_json_is_a_400_and_not_forwarded(fake) -> None:
    front, _, _ = _front(fake.url)
    with serve_in_thread(front.app) as base, httpx.Client(base_url=base, timeout=30) as c:
        r = c.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"
    assert fake.state.bodies == []
    assert front.admission.in_flight_seqs == 0
