"""The serving process: bind, load the model, warm up, serve, drain on SIGTERM, exit 0.

Order of a life: the socket is bound and uvicorn serves at once (/health 200, /ready and
generation 503 "not_ready"); the model loads on a helper thread and the engine starts
its loop thread; one short warm-up generation must succeed before /ready turns 200. On
the first SIGTERM or SIGINT, /ready and new requests get 503 at once, in-flight requests
get `drain_timeout_s` to finish and are then aborted (their answers end with
finish_reason "abort"); uvicorn and the engine thread are stopped and the process exits
0 with no threads left behind. A second signal exits at once. Signal handling is ours,
not uvicorn's, because uvicorn would close the listening socket immediately and
refuse new connections instead of answering them 503.
With [mqtt] enabled, the MQTT link starts first (the broker sees `online`, phase
loading), follows the phase, publishes the live feed's events and telemetry, takes live
`policy/set` messages (only with mqtt.accept_policy) through the same path as HTTP PUT,
and says `offline` last. With [fleet] enabled, the fleet link (wattserve/fleet/node.py)
publishes the node's demand and turns live grants into power_budget_w on that same path
(changed_by "fleet"), at the safe floor until the first grant and after a lease expires.
If the engine loop dies, its requests end with an error, /ready and new requests get 503,
an `engine_fault` event goes out, and the process exits EXIT_ENGINE_FAULT after the same
shutdown (device restored, `stop`, `offline`) so that systemd restarts it. Each shutdown
step runs even when one before it failed.
This module wires parts together; it must not hold API or engine logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from wattserve.controller.schema import PolicyModel, PolicyPatch, to_model
from wattserve.daemon.api.app import create_app
from wattserve.daemon.api.connection import ConnectionLimits, protocol_factory
from wattserve.daemon.api.state import Phase, ServingState, resolve_api_token
from wattserve.daemon.config import Config, default_cache_dir
from wattserve.daemon.control_loop import ControlLoop
from wattserve.daemon.coupling import device_step_hook
from wattserve.daemon.device import TelemetrySampler, open_device
from wattserve.daemon.device.protocol import DeviceError
from wattserve.daemon.engine.cache_prune import prune_engine_caches
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import LoadError, load_model
from wattserve.daemon.engine.placement import (
    GpuIdentity,
    Placement,
    PlacementError,
    check_controlled,
    resolve_placement,
)
from wattserve.daemon.engine.request import SamplingParams
from wattserve.daemon.feed import LiveFeed
from wattserve.daemon.mqtt import DeviceSummary, EventPayload, MqttLink
from wattserve.daemon.mqtt.metrics import MqttCollector
from wattserve.daemon.quant_table import load_quality_table, quality_table_path
from wattserve.daemon.sdnotify import Notifier, ProgressProbe, Watchdog, status_line
from wattserve.daemon.uvicorn_server import QuietSignalsServer
from wattserve.fleet.node import FleetNodeLink

log = logging.getLogger("wattserve.server")

WARMUP_PROMPT = "Hello"
# After the drain deadline aborts what is left, how long its final answers get to flush.
_ABORT_FLUSH_S = 5.0
_POLL_S = 0.05
# How often systemd's STATUS= line is refreshed.
_STATUS_INTERVAL_S = 5.0
# The live feed's tick (the dashboard's stream, /metrics' window figures).
_FEED_PERIOD_S = 1.0
# The window the MQTT telemetry closes on the live feed (its own period, mqtt.*_ms).
_MQTT_WINDOW = "mqtt"
_FLEET_WINDOW = "fleet"
# The exit code after the engine loop died (EX_SOFTWARE): non-zero, so systemd restarts us.
EXIT_ENGINE_FAULT = 70


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound, not yet listening TCP socket; port 0 picks a free port."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class Daemon:
    """One serving process. `await run()` returns the exit code."""

    def __init__(
        self,
        cfg: Config,
        *,
        build_engine: Callable[[], Engine] | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.state = ServingState(cfg, resolve_api_token(cfg, environ))
        self.feed = self.state.feed = LiveFeed(self.state, period_s=_FEED_PERIOD_S)
        self.state.request_events.subscribe(self.feed)
        self._build_engine = build_engine or self._load_and_build
        self._placement: Placement | None = None  # set by _load_and_build
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None
        self._signals = 0
        self._engine_fault: BaseException | None = None
        self.address: tuple[str, int] | None = None
        # For callers on other threads (tests): set once ready, or once run() gave up.
        self.ready = threading.Event()
        self.stopped = threading.Event()
        # systemd: a no-op without $NOTIFY_SOCKET (tests pass their own environ).
        self.notifier = Notifier.from_environ(environ)
        self.watchdog = Watchdog(self.notifier)
        self._last_status: tuple[int, float] | None = None  # (requests finished, time)
        # Built here so that an unreadable password or TLS file stops the start, unbound.
        self.mqtt = self._build_mqtt() if cfg.mqtt.enabled else None
        self.fleet = self.state.fleet = self._build_fleet() if cfg.fleet.enabled else None

    # ---- MQTT ---------------------------------------------------------------------------------
    def _build_mqtt(self) -> MqttLink:
        feed = self.feed
        # Opened now, not at the first tick: a request that finishes before it still counts.
        feed.open_window(_MQTT_WINDOW)
        link = MqttLink(
            self.cfg.mqtt,
            policy_handler=self._mqtt_policy_set,
            telemetry_source=lambda: feed.snapshot(_MQTT_WINDOW),
            # Rejections go through the feed like every event (the dashboard sees them too).
            event_sink=lambda e: feed.publish_event(e.kind, e.message, e.data),
        )
        feed.add_listener(on_event=self._on_feed_event)
        self.state.metrics.registry.register(MqttCollector(link))
        link.set_policy(to_model(self.state.policy))
        return link

    def _build_fleet(self) -> FleetNodeLink:
        self.feed.open_window(_FLEET_WINDOW)

        def demand_source() -> Any:
            sampler = self.state.device_sampler
            latest = sampler.latest() if sampler is not None else None
            if latest is None:
                return None  # no device yet: nothing to ask for
            snapshot = self.feed.snapshot(_FLEET_WINDOW)
            return snapshot, latest.power_limit_min_w, latest.power_limit_max_w

        return FleetNodeLink(
            self.cfg.mqtt,
            self.cfg.fleet,
            demand_source=demand_source,
            apply_budget=self._fleet_budget,
        )

    def _fleet_budget(self, power_budget_w: float, why: str) -> None:
        """A grant (or the safe floor) as power_budget_w: the HTTP PUT's path, by "fleet".

        Called on every renewal too: a budget already in force changes nothing (no event),
        one set otherwise since (an HTTP PUT) is put back to the grant."""
        if to_model(self.state.policy).power_budget_w == power_budget_w:
            return
        self.state.apply_policy(PolicyPatch(power_budget_w=power_budget_w), changed_by="fleet")
        log.info("%s: power budget %.0f W", why, power_budget_w)

    def _mqtt_policy_set(self, fields: dict[str, Any]) -> PolicyModel:
        """policy/set: the HTTP control body's model, applied as a PUT is. The feed reports
        the change (policy_changed, changed_by "mqtt"); a ValidationError rejects it."""
        return self.state.apply_policy(PolicyModel.model_validate(fields), changed_by="mqtt")

    def _on_feed_event(self, event: EventPayload) -> None:
        assert self.mqtt is not None
        self.mqtt.publish_event(event)
        if event.kind == "policy_changed":  # over HTTP or MQTT: the retained policy follows
            self.mqtt.set_policy(to_model(self.state.policy))

    def _set_phase(self, phase: Phase) -> None:
        """The serving phase, for the API and for MQTT's retained status."""
        self.state.phase = phase
        if self.mqtt is not None:
            device = self.state.device
            self.mqtt.set_status(
                phase=phase.value,
                model=self._model_name(),
                device=DeviceSummary.from_capabilities(device.capabilities())
                if device is not None
                else None,
            )

    def _model_name(self) -> str:
        return self.state.served_model_name or self.cfg.engine.model

    # ---- engine construction (runs on a helper thread) ---------------------------------
    def _load_and_build(self) -> Engine:
        e, d = self.cfg.engine, self.cfg.device
        placement = resolve_placement(e.device, d.gpu, d.backend)
        log.info("engine device: %s (%s)", placement.device, placement.why)
        self._placement = placement
        cache_dir = e.cache_dir or default_cache_dir()
        loaded = load_model(e.model, cache_dir, e.dtype, placement.device.type)
        engine = Engine(loaded, EngineOptions.from_config(e), placement.device)
        try:  # after the engine: its kernel build (CPU) is then in place and in use
            prune_engine_caches(cache_dir, e.cache_max_bytes, loaded.cache_entry)
        except Exception:  # pruning a cache must never stop a start
            log.exception("cache pruning failed; continuing")
        return engine

    # ---- shutdown requests -----------------------------------------------------------------
    def request_shutdown(self) -> None:
        """Begin the drain, as SIGTERM does; callable from any thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._begin_shutdown, "shutdown requested")

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals > 1:
            log.warning("second signal (%s): exiting at once", name)
            sys.stderr.flush()
            os._exit(128 + signum)
        self._begin_shutdown(f"{name} received")

    def _begin_shutdown(self, why: str) -> None:
        if self._shutdown is None or self._shutdown.is_set():
            return
        # Refuse new work right here, before any await: /ready and new requests get 503 now.
        self._set_phase(Phase.DRAINING)
        self.state.drain_deadline_s = time.monotonic() + self.cfg.server.drain_timeout_s
        log.info(
            "%s: draining %d in-flight request(s) for up to %.0f s (signal again to exit now)",
            why,
            self.state.in_flight,
            self.cfg.server.drain_timeout_s,
        )
        self.notifier.stopping(f"draining {self.state.in_flight} request(s)")
        self.feed.publish_event(
            "drain",
            f"{why}: draining {self.state.in_flight} request(s)",
            {"in_flight": self.state.in_flight},
        )
        self._shutdown.set()

    def _engine_died(self, error: BaseException) -> None:
        """The engine's fault hook (engine thread): its requests have ended with an error."""
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._on_engine_fault, error)

    def _on_engine_fault(self, error: BaseException) -> None:
        if self._engine_fault is not None:
            return
        self._engine_fault = error
        self._set_phase(Phase.FAILED)  # /ready and new requests: 503 from here on
        log.error(
            "the engine loop died (%s: %s): exiting with code %d for a restart",
            type(error).__name__,
            error,
            EXIT_ENGINE_FAULT,
        )
        self.notifier.stopping("engine fault")
        self.feed.publish_event(
            "engine_fault",
            f"the engine loop died ({type(error).__name__}); exiting for a restart",
            {"error": type(error).__name__, "exit_code": EXIT_ENGINE_FAULT},
        )
        if self._shutdown is not None and not self._shutdown.is_set():
            # The engine already ended every request; the drain lets their errors flush.
            self.state.drain_deadline_s = time.monotonic() + self.cfg.server.drain_timeout_s
            self._shutdown.set()

    # ---- the life ----------------------------------------------------------------------------
    async def run(self, sock: socket.socket | None = None, install_signals: bool = True) -> int:
        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()
        server_cfg = self.cfg.server
        sock = sock or bind_socket(server_cfg.host, server_cfg.port)
        self.address = sock.getsockname()[:2]
        app = create_app(self.state, bound_host=server_cfg.host)
        uv_config = uvicorn.Config(
            app,
            log_config=None,
            log_level=server_cfg.log_level,
            access_log=server_cfg.log_level == "debug",
            lifespan="off",
            timeout_graceful_shutdown=int(_ABORT_FLUSH_S),
            server_header=False,
            # httptools, with the connection bounds of wattserve/daemon/api/connection.py around it.
            http=protocol_factory(ConnectionLimits.from_config(server_cfg)),
        )
        server = QuietSignalsServer(uv_config)
        serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        code = 1
        background: list[asyncio.Task[None]] = [
            asyncio.create_task(self.feed.run(), name="live-feed")
        ]
        try:
            if self.mqtt is not None:
                self._set_phase(self.state.phase)  # `online`, loading, once it connects
                await self.mqtt.start()
            if self.fleet is not None:
                await self.fleet.start()
            while not server.started and not serve_task.done():
                await asyncio.sleep(0.01)
            if serve_task.done():
                serve_task.result()  # uvicorn failed to start: raise its error
                return 1
            host, port = self.address
            log.info("wattserve listening on http://%s:%d", _url_host(host), port)
            async with self.notifier.extending_timeout():
                code = await self._bring_up()
            if code is None:
                background += [
                    asyncio.create_task(self.watchdog.run(), name="sd-watchdog"),
                    asyncio.create_task(
                        self.notifier.report_status(self._status, _STATUS_INTERVAL_S),
                        name="sd-status",
                    ),
                ]
                await self._shutdown.wait()
                await self._drain()
                code = 0
            if self._engine_fault is not None:
                code = EXIT_ENGINE_FAULT  # also when the fault came during the warm-up
            return code
        finally:
            self._set_phase(Phase.DRAINING)  # whatever arrives while uvicorn stops gets 503
            server.should_exit = True
            with contextlib.suppress(Exception):
                await serve_task
            if install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(sig)
            # Each step on its own: a failure in one must not skip the device restore,
            # the `stop` event or `offline` (each failure is logged where it happens).
            engine, device = self.state.engine, self.state.device
            if self.state.control_loop is not None:
                _shutdown_step("control loop stop", self.state.control_loop.stop)
            if engine is not None:
                _shutdown_step("engine stop", lambda: engine.stop(abort_pending=True))
            if self.state.device_sampler is not None:
                _shutdown_step("device sampler stop", self.state.device_sampler.stop)
            if device is not None:
                # Settings this run changed go back.
                _shutdown_step("device restore", lambda: device.close(restore=True))
            if self.fleet is not None:
                try:
                    await self.fleet.stop()
                except Exception:
                    log.exception("shutdown: fleet link stop failed")
            self.feed.publish_event("stop", f"stopped (exit code {code})", {"exit_code": code})
            if self.mqtt is not None:
                try:
                    await self.mqtt.stop()  # the stop event goes out, then `offline`
                except Exception:
                    log.exception("shutdown: MQTT stop failed")
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self.notifier.close()
            self.state.phase = Phase.STOPPED
            self.ready.set()
            self.stopped.set()
            log.info("stopped")

    async def _bring_up(self) -> int | None:
        """Load, start and warm up the engine; None on success, else the exit code."""
        assert self._shutdown is not None
        built: asyncio.Future[Engine] = self._loop.create_future()  # type: ignore[union-attr]

        def build() -> None:
            try:
                engine = self._build_engine()
            except BaseException as e:  # noqa: BLE001 - handed to the loop, reported there
                self._deliver(built, None, e)
            else:
                self._deliver(built, engine, None)

        # A daemon thread: a SIGTERM during a long first conversion must not wait for it
        # (the loader writes its cache atomically, so abandoning it is safe).
        threading.Thread(target=build, name="wattserve-load", daemon=True).start()
        engine = await self._until_shutdown(built)
        if engine is None:
            log.info("shutdown before the model finished loading")
            return 0
        if isinstance(engine, BaseException):
            if isinstance(engine, (LoadError, ValueError, PlacementError)):
                log.error("cannot serve: %s", engine)
            else:
                log.error("cannot serve: %s", engine, exc_info=engine)
            return 1
        if not self._attach_device(engine):
            return 1
        engine.add_step_hook(self.state.metrics.on_step)
        engine.add_fault_hook(self._engine_died)
        engine.start()
        self.state.engine = engine
        self._set_phase(Phase.WARMING)
        outcome = await self._until_shutdown(self._warm_up(engine))
        if outcome is None:
            return 0
        if outcome != "ok":
            log.error("cannot serve: warm-up generation failed (%s)", outcome)
            return 1
        _freeze_start_up_heap()
        self._set_phase(Phase.READY)
        self.watchdog.add_probe(
            "engine loop",
            ProgressProbe(
                lambda: engine.counters.steps,
                idle=lambda: engine.is_running and not engine.has_work(),
            ),
        )
        control_loop = self.state.control_loop
        if control_loop is not None:
            control_loop.start()
            # A hung control thread would leave the knobs wherever they were: restart.
            self.watchdog.add_probe("control loop", ProgressProbe(lambda: control_loop.ticks))
        self.notifier.ready(self._status())
        self.feed.publish_event(
            "start",
            f"serving {self.state.served_model_name}",
            {"model": self.state.served_model_name, "max_model_len": engine.max_model_len},
        )
        log.info(
            "ready: model %s, context %d tokens, batch cap %d",
            self.state.served_model_name,
            engine.max_model_len,
            engine.limits.max_num_seqs,
        )
        self.ready.set()
        return None

    def _status(self) -> str:
        """systemd's one-line STATUS=: phase, model, finished requests per second, budget."""
        engine = self.state.engine
        finished = sum(engine.counters.requests_finished.values()) if engine else 0
        now_s = time.monotonic()
        rate = None
        if self._last_status is not None:
            rate = (finished - self._last_status[0]) / max(now_s - self._last_status[1], 1e-3)
        self._last_status = (finished, now_s)
        return status_line(
            self._model_name(),
            requests_per_s=rate,
            power_budget_w=self.state.policy.power_budget_w,
            phase=self.state.phase.value,
        )

    def _attach_device(self, engine: Engine) -> bool:
        """Open the GPU (or the virtual one), start sampling it, and the control loop."""
        try:
            device = open_device(self.cfg.device)
        except DeviceError as e:
            log.error("cannot serve: device: %s", e)
            return False
        sampler = TelemetrySampler(device, rate_hz=self.cfg.device.sample_hz)
        sampler.start()
        self.state.device, self.state.device_sampler = device, sampler
        if self._placement is not None:
            try:
                ident = device.capabilities()
                check_controlled(
                    self._placement,
                    GpuIdentity(ident.uuid, ident.pci_bus_id, ident.name),
                    ident.is_virtual,
                )
            except PlacementError as e:
                log.error("cannot serve: %s", e)
                return False
        if device.capabilities().is_virtual:
            # The simulated clock acts on real steps: the engine waits out the stretch.
            engine.add_step_hook(device_step_hook(engine, device))
        loop = ControlLoop.build(
            self.cfg.controller,
            engine,
            device,
            quality=self._quality_table(engine),
            sinks=[self.feed.on_decision],
            event_sink=self.feed.publish_event,  # knob_drift
        )
        engine.add_step_hook(loop.on_step)  # after the stretch, so durations include it
        # A policy set while the model loaded (a PUT, a retained policy/set) holds.
        loop.set_policy(self.state.policy)
        self.state.control_loop = loop
        self.state.request_events.subscribe(loop)
        return True

    def _quality_table(self, engine: Engine) -> dict | None:
        """bench quant's table for the model served, from the cache (its perplexity
        figures let max_ppl_increase_pct allow levels; its speeds order the controller's
        trials), or None: none saved, or one measured with another full-precision level."""
        path = quality_table_path(
            self.cfg.engine.cache_dir or default_cache_dir(), engine.model_name
        )
        table = load_quality_table(path)
        full = engine.quant_status()["full_precision"]
        if table is None:
            log.info(
                "quantization: no quality table at %s (`wattserve bench quant` writes it): "
                "levels have no measured quality or speed%s",
                path,
                "; max_ppl_increase_pct allows full precision only"
                if self.cfg.controller.max_ppl_increase_pct is not None
                else "",
            )
            return None
        if table.get("full_precision") != full:
            log.warning(
                "quantization: ignoring %s: measured against %s, the model is loaded as %s",
                path,
                table.get("full_precision"),
                full,
            )
            return None
        log.info("quantization: quality and speed table %s", path)
        return table

    def _deliver(self, fut: asyncio.Future, value: object, error: BaseException | None) -> None:
        def settle() -> None:
            if not fut.done():
                fut.set_result(error if error is not None else value)

        with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting
            self._loop.call_soon_threadsafe(settle)  # type: ignore[union-attr]

    async def _warm_up(self, engine: Engine) -> str:
        done: asyncio.Future[str] = self._loop.create_future()  # type: ignore[union-attr]

        def sink(out) -> None:  # engine thread
            if out.finished:
                result = (
                    "ok"
                    if out.finish_reason in ("stop", "length")
                    else (out.error or out.finish_reason or "error")
                )
                self._deliver(done, result, None)

        ids = engine.tokenize(WARMUP_PROMPT) or [next(iter(engine.eos_token_ids), 0)]
        engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0.0), sink, "warmup")
        return await done

    async def _until_shutdown(self, aw):
        """Await `aw` unless shutdown comes first (then None)."""
        assert self._shutdown is not None
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._shutdown.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return None

    async def _drain(self) -> None:
        state = self.state
        deadline = state.drain_deadline_s or time.monotonic()
        while state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if state.in_flight > 0:
            log.warning("drain timeout: aborting %d request(s)", state.in_flight)
            for stream in list(state.live.values()):
                stream.abort()
            flush_until = time.monotonic() + _ABORT_FLUSH_S
            while state.in_flight > 0 and time.monotonic() < flush_until:
                await asyncio.sleep(_POLL_S)
        log.info("drained")


def _freeze_start_up_heap() -> None:
    """Move every object alive after warm-up (torch, transformers, the tokenizer: millions)
    out of the collector's reach. A full collection otherwise walks them all, holding the GIL
    for 0.2-0.3 s on whichever thread's allocation triggers it, the event loop's included.
    What is allocated while serving is still collected as before."""
    gc.collect()
    gc.freeze()
    log.info("start-up heap frozen: %d objects kept out of collection", gc.get_freeze_count())


def _shutdown_step(what: str, step: Callable[[], object]) -> None:
    try:
        step()
    except Exception:
        log.exception("shutdown: %s failed; continuing", what)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(cfg: Config) -> int:
    """`wattserve serve`: run until drained; returns the process exit code."""
    daemon = Daemon(cfg)  # raises ConfigError for a bad token setting, before binding
    try:
        code = asyncio.run(daemon.run())
    except OSError as e:  # the address is taken or not ours to bind
        log.error("cannot listen on %s:%d: %s", cfg.server.host, cfg.server.port, e.strerror or e)
        return 1
    leftover = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and t.name != "wattserve-load"
    ]
    if leftover:
        log.warning("threads left at exit: %s", ", ".join(leftover))
    return code
