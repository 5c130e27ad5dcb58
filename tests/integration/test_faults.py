"""Faults on a running daemon: the engine loop dying, a state file that takes no writes.

The engine fault is injected by making the scheduler raise on the engine thread (outside
a batch's forward) while a streaming and a non-streaming request are in flight. The
shutdown that follows is held until the test has looked at the server in its failed
phase, then released; the daemon's run() must return EXIT_ENGINE_FAULT. The state-file
fault makes every write of it fail before a clean shutdown (a real Mosquitto broker
watches): the GPU must still be restored, `stop` and `offline` still go out, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx

from tests.api_server import api_config, running_server
from tests.mqtt_broker import Recorder, is_status, run
from wattserve.daemon.api.state import Phase
from wattserve.daemon.device.protocol import StateFileError
from wattserve.daemon.device.state import StateFile
from wattserve.daemon.mqtt import Topics
from wattserve.daemon.server import EXIT_ENGINE_FAULT

WAIT_S = 30.0


def _wait_until(what: str, condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_engine_loop_death_fails_requests_refuses_work_and_exits_non_zero(tiny_llama) -> None:
    release_shutdown = threading.Event()
    second_admitted = threading.Event()
    with running_server(api_config(), tiny_llama, expect_exit_code=EXIT_ENGINE_FAULT) as srv:
        daemon, engine = srv.daemon, srv.engine
        held_drain = daemon._drain

        async def drain_when_released() -> None:
            await asyncio.to_thread(release_shutdown.wait, WAIT_S)
            await held_drain()

        daemon._drain = drain_when_released  # type: ignore[method-assign]
        schedule = engine.scheduler.schedule
        tokens_before = engine.counters.generation_tokens  # the start's warm-up counts too

        def faulty_schedule(*args, **kwargs):
            held = engine.num_running + engine.num_waiting
            if held >= 2:
                raise RuntimeError("injected scheduler fault")
            # Once the first request has its first token out (the stream's first chunk goes
            # with it), keep it running until the second is admitted.
            if held == 1 and engine.counters.generation_tokens > tokens_before:
                second_admitted.wait(WAIT_S)
            return schedule(*args, **kwargs)

        engine.scheduler.schedule = faulty_schedule  # type: ignore[method-assign]
        results: dict[str, httpx.Response] = {}
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100,
            "ignore_eos": True,
            "temperature": 0,
        }
        with httpx.Client(base_url=srv.base_url, timeout=WAIT_S) as client:
            with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}
            ) as streamed:
                assert streamed.status_code == 200
                lines = (line for line in streamed.iter_lines() if line)
                first = next(lines)  # the first token's chunk: the stream is open and in flight
                assert first.startswith("data: {")
                other = threading.Thread(
                    target=lambda: results.update(
                        plain=httpx.post(
                            f"{srv.base_url}/v1/chat/completions", json=body, timeout=WAIT_S
                        )
                    )
                )
                other.start()
                _wait_until("two requests in flight", lambda: daemon.state.in_flight == 2)
                second_admitted.set()
                rest = list(lines)
            other.join(WAIT_S)

            # The streaming request ends with an OpenAI-shaped error chunk, not a finish.
            events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
            assert events and "error" in events[-1], rest
            assert events[-1]["error"]["code"] == "engine_error"
            assert events[-1]["error"]["type"] == "server_error"
            assert not any(e.get("choices", [{}])[0].get("finish_reason") for e in events[:-1])
            # The non-streaming one gets a 500 with the same shape.
            plain = results["plain"]
            assert plain.status_code == 500
            assert plain.json()["error"]["code"] == "engine_error"
            assert set(plain.json()["error"]) == {"message", "type", "param", "code"}

            _wait_until("the failed phase", lambda: daemon.state.phase is Phase.FAILED)
            assert engine.fault is not None
            # The fault hooks run on the loop thread before it returns: the phase can turn
            # FAILED a moment before the thread has ended.
            _wait_until("the engine thread's end", lambda: not engine.is_running)
            ready = client.get("/ready")
            assert ready.status_code == 503
            refused = client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "engine_failed"
            assert "retry-after" in refused.headers
        faults = [e for e in daemon.feed.recent_events() if e.kind == "engine_fault"]
        assert len(faults) == 1 and faults[0].data["exit_code"] == EXIT_ENGINE_FAULT
        release_shutdown.set()
    # Leaving the context checked that run() returned EXIT_ENGINE_FAULT.
    stops = [e for e in daemon.feed.recent_events() if e.kind == "stop"]
    assert stops and stops[-1].data["exit_code"] == EXIT_ENGINE_FAULT


def test_shutdown_restores_the_device_and_goes_offline_when_the_state_file_fails(
    broker, tiny_llama, tmp_path, monkeypatch, caplog
) -> None:
    node = "faults-state-file"
    t = Topics.for_node("wattserve", node)
    cfg = api_config(
        device={"backend": "virtual", "mode": "control", "state_dir": str(tmp_path)},
        controller={"mode": "observe"},
        mqtt={
            "enabled": True,
            "host": "127.0.0.1",
            "port": broker.port,
            "node_id": node,
            "shutdown_timeout_ms": 5000,
        },
    )

    def refuse(self, *args, **kwargs):
        raise StateFileError(f"cannot write state file {self.path}: Read-only file system")

    async def body() -> None:
        async with Recorder(broker, t.status, t.events) as sub:
            cm = running_server(cfg, tiny_llama)  # asserts run() returned 0 on leaving
            srv = await asyncio.to_thread(cm.__enter__)
            try:
                device = srv.daemon.state.device
                gpu = device.backend
                assert device.set_power_limit_w(400).in_force
                assert device.lock_sm_clocks_mhz(1005, 1500).in_force
                # From now on the state directory takes no writes (read-only, full, gone).
                monkeypatch.setattr(StateFile, "_write", refuse)
                monkeypatch.setattr(StateFile, "clear", refuse)
            finally:
                with caplog.at_level(logging.ERROR):
                    await asyncio.to_thread(cm.__exit__, None, None, None)
            assert gpu.current_power_limit_w() == 700.0
            assert gpu.current_sm_clock_lock_mhz() is None
            await sub.wait_for(t.status, is_status("offline", "shutdown"))
            order = [m.json().get("kind") or m.json().get("state") for m in sub.messages]
            assert order.index("stop") < order.index("offline")
            stop = next(m.json() for m in sub.on(t.events) if m.json()["kind"] == "stop")
            assert stop["data"]["exit_code"] == 0
        failures = [r for r in caplog.records if "Read-only file system" in r.getMessage()]
        assert len(failures) == 1, [r.getMessage() for r in failures]

    run(body, 120.0)
