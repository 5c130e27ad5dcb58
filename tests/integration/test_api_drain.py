"""Drain: SIGTERM (or its in-process equivalent) during an in-flight stream.

In process: /ready and new requests get 503 at once while a stream is in flight; a stream
that outlives drain_timeout_s ends with finish_reason "abort". As a real `wattserve
serve` subprocess: SIGTERM mid-stream lets the stream complete, and the process exits 0
with no threads left behind; a second signal exits at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.api_server import api_config, running_server
from wattserve.daemon.api.state import Phase

STEP_SLEEP_S = 0.02
START_TIMEOUT_S = 90.0


def _sse_json(lines: list[str]) -> list[dict]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def test_drain_refuses_new_work_and_aborts_after_timeout(tiny_llama) -> None:
    cfg = api_config(server={"drain_timeout_s": 0.5})
    body = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with running_server(cfg, tiny_llama) as srv:
        # 200 tokens at >= 20 ms a step outlast the 0.5 s drain by far.
        srv.engine.add_step_hook(lambda _stats: time.sleep(STEP_SLEEP_S))
        with httpx.Client(base_url=srv.base_url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line)
                assert first.startswith("data: {")
                srv.daemon.request_shutdown()
                deadline = time.monotonic() + 10
                while srv.daemon.state.phase is not Phase.DRAINING and time.monotonic() < deadline:
                    time.sleep(0.01)
                with httpx.Client(base_url=srv.base_url, timeout=10) as other:
                    ready = other.get("/ready")
                    assert ready.status_code == 503
                    assert ready.json()["error"]["code"] == "draining"
                    refused = other.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                    assert refused.status_code == 503
                    assert refused.json()["error"]["code"] == "draining"
                    assert "retry-after" in refused.headers
                rest = [first, *(line for line in lines if line)]
    chunks = _sse_json(rest)
    assert rest[-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"


def _serve(tmp_path: Path, model_dir: Path, cache_dir: Path, drain_timeout_s: float):
    config = tmp_path / "wattserve.toml"
    config.write_text(
        f"[server]\nport = 0\ndrain_timeout_s = {drain_timeout_s}\n"
        f'[engine]\nmodel = "{model_dir}"\nkv_cache_bytes = 8388608\nmax_model_len = 512\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WATTSERVE_")}
    env.update(WATTSERVE_CACHE=str(cache_dir), WATTSERVE_CONFIG=str(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "wattserve.daemon.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    url = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = [m for line in list(log) if (m := re.search(r"listening on (http://\S+)", line))]
        if found:
            url = found[0].group(1)
            try:
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    return proc, url, log, reader
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server did not become ready at {url}: {''.join(log)[-2000:]}")


@pytest.fixture()
def served(tmp_path, tiny_dirs, cache_dir):
    procs = []

    def start(drain_timeout_s: float = 30.0):
        proc, url, log, reader = _serve(tmp_path, tiny_dirs["llama"], cache_dir, drain_timeout_s)
        procs.append(proc)
        return proc, url, log, reader

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sigterm_mid_stream_completes_and_exits_zero(served) -> None:
    proc, url, log, reader = served()
    body = {
        "prompt": "abc",
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)
            rest = [first, *(line for line in lines if line)]
    code = proc.wait(60)
    reader.join(10)
    text = "".join(log)
    assert code == 0, text[-2000:]
    chunks = _sse_json(rest)
    assert rest[-1] == "data: [DONE]"
    assert chunks[-1]["usage"]["completion_tokens"] == 100
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    assert "draining 1 in-flight" in text and "threads left" not in text and "Traceback" not in text


def test_second_signal_exits_at_once(served) -> None:
    proc, url, log, reader = served(drain_timeout_s=60.0)
    body = {"prompt": "abc", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while "draining" not in "".join(log) and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(10)
    assert code == 128 + signal.SIGINT
    assert "exiting at once" in "".join(log)
