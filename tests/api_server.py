"""Run a real wattserve Daemon (uvicorn on a random loopback port) in a thread, for tests.

The daemon is the one `wattserve serve` runs, minus signal handlers (those only work on
the main thread) and with the engine built from an already loaded test model. Leaving
the context drains and stops it, and checks that it exited 0 (or expect_exit_code).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from daemon.api.state import Phase
from daemon.config import Config, load_config
from daemon.engine.engine import Engine, EngineOptions
from daemon.engine.loader import LoadedModel
from daemon.server import Daemon, bind_socket

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


@dataclass
class RunningServer:
    daemon: Daemon
    base_url: str

    @property
    def engine(self) -> Engine:
        engine = self.daemon.state.engine
        assert engine is not None
        return engine


def api_config(
    server: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    **sections: dict[str, Any],
) -> Config:
    """Defaults sized for a tiny model: a small KV pool and context. Other sections
    (device=, controller=, mqtt=) pass through; MQTT is off unless mqtt={"enabled": True}."""
    engine_cfg = {"kv_cache_bytes": 8 << 20, "max_model_len": 256, "default_max_tokens": 16}
    server_cfg = {"port": 0, "drain_timeout_s": 5.0, "log_level": "warning"}
    return load_config(
        None,
        {
            **sections,
            "server": {**server_cfg, **(server or {})},
            "engine": {**engine_cfg, **(engine or {})},
            "mqtt": {"enabled": False, **sections.get("mqtt", {})},
        },
    )


@contextmanager
def running_server(
    cfg: Config,
    loaded: LoadedModel,
    environ: dict[str, str] | None = None,
    before_start: Callable[[Engine], None] | None = None,
    expect_exit_code: int = 0,
) -> Iterator[RunningServer]:
    def build() -> Engine:
        engine = Engine(loaded, EngineOptions.from_config(cfg.engine))
        if before_start is not None:
            before_start(engine)
        return engine

    daemon = Daemon(cfg, build_engine=build, environ=environ or {})
    sock = bind_socket("127.0.0.1", 0)
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(asyncio.run(daemon.run(sock, install_signals=False))),
        name="test-daemon",
        daemon=True,
    )
    thread.start()
    try:
        assert daemon.ready.wait(START_TIMEOUT_S), "daemon did not become ready"
        assert daemon.state.phase is Phase.READY, f"daemon failed to start: {daemon.state.phase}"
        host, port = daemon.address  # type: ignore[misc]
        yield RunningServer(daemon, f"http://{host}:{port}")
    finally:
        daemon.request_shutdown()
        thread.join(STOP_TIMEOUT_S)
    assert not thread.is_alive(), "daemon did not stop"
    assert codes == [expect_exit_code], f"daemon exit code {codes}"
