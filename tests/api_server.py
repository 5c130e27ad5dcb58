"""Run a real wattserve Daemon (uvicorn on a random loopback port) in a thread, for tests.

The daemon is the one `wattserve serve` runs, through wattserve.bench.serve.in_process_daemon (no
signal handlers: those only work on the main thread), with the engine built from an
already loaded test model. Leaving the context drains and stops it, and raises unless it
exited 0 (or expect_exit_code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from wattserve.bench.serve import in_process_daemon
from wattserve.daemon.config import Config, load_config
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import LoadedModel
from wattserve.daemon.server import Daemon

START_TIMEOUT_S = 60.0


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

    with in_process_daemon(cfg, build, environ, START_TIMEOUT_S, expect_exit_code) as (
        daemon,
        base_url,
    ):
        yield RunningServer(daemon, base_url)
