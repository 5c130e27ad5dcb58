"""`wattserve attach URL`: run the controller over an unmodified vLLM or SGLang server.

Life: wait for the server's /metrics (it may still be loading), tell its kind unless given,
open every GPU it uses through the device layer ([device]: backend, mode, state files),
build the runner ([controller]) and start it. Until SIGTERM/SIGINT (our handlers, not
uvicorn's) it serves the front with --front-port on [server].host (with the daemon's
dashboard at / unless [server] dashboard_enabled is false), the daemon's MQTT link
with [mqtt] enabled (telemetry, status, policy) and its fleet link with [fleet] enabled
(the server is one node). At exit the runner stops and every GPU gets back the settings
recorded when they were first changed (the daemon's restore). Errors a user can fix end
as one line and exit 1. It wires; it decides nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from wattserve.attach.admission import Admission
from wattserve.attach.build import build_runner
from wattserve.attach.detect import DetectError, detect_kind
from wattserve.attach.feed import AttachFeed
from wattserve.attach.front import Front, FrontHooks
from wattserve.attach.gpus import GpuGroup
from wattserve.attach.names import BY_KIND
from wattserve.attach.runner import OK, AttachRunner, http_fetcher
from wattserve.attach.telemetry import telemetry_payload
from wattserve.controller.schema import PolicyModel, PolicyPatch, to_model, to_policy
from wattserve.daemon.api.dashboard import dashboard_router
from wattserve.daemon.config import Config
from wattserve.daemon.device import open_device
from wattserve.daemon.device.protocol import DeviceError
from wattserve.daemon.mqtt import DeviceSummary, MqttLink
from wattserve.daemon.mqtt.payloads import TelemetryPayload
from wattserve.daemon.uvicorn_server import QuietSignalsServer
from wattserve.fleet.node import FleetNodeLink

log = logging.getLogger("wattserve.attach")


class AttachError(RuntimeError):
    """A problem the user can fix; the message is one line."""


@dataclass(frozen=True)
class AttachOptions:
    url: str
    server_kind: str = "auto"  # vllm | sglang | auto
    gpus: tuple[str, ...] = ()  # empty: [device].gpu
    front_port: int | None = None
    period_s: float = 1.0
    wait_s: float = 600.0
    flops_per_token: float = 0.0  # > 0: book the server's work on the (virtual) GPUs


def wait_for_metrics(url: str, wait_s: float, poll_s: float = 2.0) -> str:
    """The server's first exposition; raises AttachError after wait_s without one."""
    fetch = http_fetcher(url)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return fetch()
        except (httpx.HTTPError, OSError) as e:
            if time.monotonic() >= deadline:
                raise AttachError(
                    f"{url}/metrics did not answer within {wait_s:.0f} s: {e}"
                ) from None
        time.sleep(poll_s)


def open_gpus(cfg: Config, gpus: Sequence[str]) -> GpuGroup:
    """Every GPU of the server through open_device (one state file each)."""
    devices = []
    try:
        for i, gpu in enumerate(gpus or (cfg.device.gpu,)):
            update = {"gpu": gpu, "virtual_seed": cfg.device.virtual_seed + i}
            devices.append(open_device(cfg.device.model_copy(update=update)))
    except DeviceError as e:
        for d in devices:
            d.close()
        raise AttachError(f"device: {e}") from None
    return GpuGroup(devices)


def _mqtt_link(cfg: Config, runner: AttachRunner, url: str, kind: str) -> MqttLink:
    """The daemon's MQTT link over this runner: telemetry, status, policy in and out."""
    control = runner.control

    def policy_set(fields: dict[str, Any]) -> PolicyModel:
        # policy/set (only with mqtt.accept_policy): the same path as the daemon's.
        policy = to_policy(PolicyModel.model_validate(fields), base=control.controller.policy)
        control.set_policy(policy)
        link.set_policy(to_model(policy), changed_by="mqtt")
        return to_model(policy)

    link = MqttLink(
        cfg.mqtt, policy_handler=policy_set, telemetry_source=lambda: telemetry_payload(runner)
    )
    link.set_policy(to_model(control.controller.policy))
    link.set_status(
        phase="ready",
        model=f"{kind} at {url}",
        device=DeviceSummary.from_capabilities(runner.device.capabilities()),
    )
    return link


def _fleet_link(cfg: Config, runner: AttachRunner) -> FleetNodeLink:
    """The server as one fleet node: its demand from the telemetry, grants as its budget."""
    control = runner.control

    def demand_source() -> tuple[TelemetryPayload, float | None, float | None] | None:
        if runner.last_window is None:
            return None  # nothing read yet: nothing to ask for
        read = runner.device.read()
        return telemetry_payload(runner), read.power_limit_min_w, read.power_limit_max_w

    def apply_budget(power_budget_w: float, why: str) -> None:
        patch = PolicyPatch(power_budget_w=power_budget_w)
        control.set_policy(to_policy(patch, base=control.controller.policy))
        log.info("%s: power budget %.0f W", why, power_budget_w)

    return FleetNodeLink(
        cfg.mqtt, cfg.fleet, demand_source=demand_source, apply_budget=apply_budget
    )


def _status(runner: AttachRunner, url: str, kind: str) -> dict[str, Any]:
    """GET /v1/status on the front: the runner's, with what the dashboard's header reads
    where the daemon's status has it (model, phase, device, policy, control API)."""
    return {
        "phase": "ready" if runner.health == OK else runner.health,
        "model": f"{kind} at {url}",
        "policy": to_model(runner.control.controller.policy).model_dump(mode="json"),
        "device": {"capabilities": runner.device.capabilities().to_dict()},
        # Policy changes reach attach over MQTT (policy/set), not the page's form.
        "server": {"control_enabled": False, "policy_over_mqtt": True},
        **runner.status(),
    }


async def _serve(
    cfg: Config,
    runner: AttachRunner,
    url: str,
    kind: str,
    front_port: int | None,
    feed: AttachFeed | None,
) -> None:
    """Until SIGTERM/SIGINT: the front (if any) with the dashboard (if
    [server] dashboard_enabled), and the MQTT link (if [mqtt] enabled)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    server: uvicorn.Server | None = None

    def on_signal() -> None:
        stop.set()
        if server is not None:
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    link = _mqtt_link(cfg, runner, url, kind) if cfg.mqtt.enabled else None
    fleet = _fleet_link(cfg, runner) if cfg.fleet.enabled else None
    if link is not None:
        await link.start()
    if fleet is not None:
        await fleet.start()
    feed_task = asyncio.create_task(feed.run()) if feed is not None else None
    try:
        if front_port is not None and runner.admission is not None:
            control = runner.control
            hooks = FrontHooks(
                on_ttft_s=control.record_ttft_s,
                on_tpot_s=control.record_tpot_s,
                status=lambda: _status(runner, url, kind),
            )
            routers = []
            if feed is not None:
                hooks.on_request = feed.on_request
                # The daemon's page over this feed. Its streams end at a signal: uvicorn's
                # graceful stop waits for every open connection.
                def stream_over() -> str | None:
                    return "stopped" if stop.is_set() else None

                routers.append(dashboard_router(feed, stream_over, cfg.server.max_event_streams))
            front = Front(url, runner.admission, hooks, routers=routers)
            server = QuietSignalsServer(
                uvicorn.Config(
                    front.app, host=cfg.server.host, port=front_port, log_level="warning"
                )
            )
            await server.serve()
        else:
            await stop.wait()
    finally:
        if feed_task is not None:
            feed_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feed_task
        if fleet is not None:
            await fleet.stop()
        if link is not None:
            await link.stop()


def run(cfg: Config, opts: AttachOptions) -> int:
    url = opts.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise AttachError(f"{opts.url!r} is not an http(s) URL")
    if not opts.period_s > 0:
        raise AttachError(f"--period-s {opts.period_s}: must be > 0")
    if opts.front_port is not None and not 0 < opts.front_port < 65536:
        raise AttachError(f"--front-port {opts.front_port}: not a port")
    text = wait_for_metrics(url, opts.wait_s)
    if opts.server_kind == "auto":
        try:
            kind = detect_kind(text, url)
        except DetectError as e:
            raise AttachError(str(e)) from None
    elif opts.server_kind in BY_KIND:
        kind = opts.server_kind
    else:
        raise AttachError(f"--server-kind {opts.server_kind!r}: one of vllm, sglang, auto")
    names = BY_KIND[kind]  # type: ignore[index]
    device = open_gpus(cfg, opts.gpus)
    admission = Admission(cfg.engine.max_num_seqs) if opts.front_port is not None else None
    dashboard = opts.front_port is not None and cfg.server.dashboard_enabled
    feed = AttachFeed() if dashboard else None
    runner = build_runner(
        cfg.controller,
        names,
        http_fetcher(url),
        device,
        admission=admission,
        max_num_seqs=cfg.engine.max_num_seqs,
        server_url=url,
        period_s=opts.period_s,
        flops_per_token=opts.flops_per_token,
        sinks=(feed.on_decision,) if feed is not None else (),
    )
    if feed is not None:
        feed.follow(runner)
    log.info(
        "attach: %s server at %s, %d GPU(s), controller %s, front %s",
        kind,
        url,
        len(device.devices),
        cfg.controller.mode,
        "off" if opts.front_port is None else f"on {cfg.server.host}:{opts.front_port}",
    )
    runner.start()
    try:
        asyncio.run(_serve(cfg, runner, url, kind, opts.front_port, feed))
    finally:
        runner.stop()
        device.close()
        log.info("attach: stopped; GPU settings restored")
    return 0
