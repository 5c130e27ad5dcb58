"""Operational endpoints: /health, /ready, /v1/status, and the token-guarded /v1/control/*.

/health says the process serves; /ready says it can take generation requests (model
loaded and warmed up, not draining). /v1/status is one JSON snapshot for people and
scripts. The control endpoints need `Authorization: Bearer <token>` compared in constant
time; with no token configured they are disabled (403), never open. A PUT policy goes
through ServingState.apply_policy; a PUT knobs (never above the configured bounds) is
handed to the control loop, which writes it: no handler writes to the engine or device.
This module must not make control decisions itself.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from wattserve.controller.schema import PolicyModel, to_model
from wattserve.daemon.api.errors import APIError
from wattserve.daemon.api.openai import require_engine, serving, unavailable_error
from wattserve.daemon.api.schemas import (
    HealthResponse,
    Knobs,
    KnobsUpdate,
    ReadyResponse,
    StatusResponse,
)
from wattserve.daemon.api.state import Phase, Unavailable
from wattserve.daemon.config import Config
from wattserve.daemon.control_loop import QuantLevelRefused
from wattserve.daemon.device.protocol import IN_FORCE

router = APIRouter()

# Declares the bearer scheme in the OpenAPI document; the checks are ours (require_token).
_bearer = HTTPBearer(auto_error=False, description="server.api_token / WATTSERVE_API_TOKEN")

_HOW_TO_ENABLE = (
    "control endpoints are disabled because no API token is configured; set "
    "WATTSERVE_API_TOKEN, server.api_token or server.api_token_file and restart"
)


async def require_token(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    token = serving(request).api_token
    if token is None:
        raise APIError(403, _HOW_TO_ENABLE, code="control_disabled")
    challenge = {"WWW-Authenticate": "Bearer"}
    if creds is None:
        raise APIError(401, "missing bearer token", code="missing_token", headers=challenge)
    if not secrets.compare_digest(creds.credentials.encode(), token.encode()):
        raise APIError(401, "invalid bearer token", code="invalid_token", headers=challenge)


@router.get("/health", response_model=HealthResponse, tags=["ops"])
async def health(request: Request) -> HealthResponse:
    return HealthResponse(phase=serving(request).phase.value)


@router.get("/ready", response_model=ReadyResponse, tags=["ops"])
async def ready(request: Request) -> ReadyResponse:
    state = serving(request)
    if state.phase is Phase.DRAINING or state.phase is Phase.STOPPED:
        raise unavailable_error(Unavailable("draining", "the server is shutting down", 1))
    if not state.is_ready or state.served_model_name is None:
        raise unavailable_error(Unavailable("not_ready", f"not ready: {state.phase.value}", 5))
    return ReadyResponse(model=state.served_model_name)


@router.get("/v1/status", response_model=StatusResponse, tags=["ops"])
async def status(request: Request) -> StatusResponse:
    state = serving(request)
    engine = state.engine
    server = {
        "in_flight": state.in_flight,
        "admission_cap": state.admission_cap,
        "max_waiting_requests": state.cfg.server.max_waiting_requests,
        "control_enabled": state.api_token is not None,
        # policy/set over MQTT: "off", or the kind of connection it is taken over.
        "mqtt_remote_policy": state.cfg.mqtt.remote_policy,
        "fleet": state.fleet.status() if state.fleet is not None else {"enabled": False},
    }
    engine_info = None
    if engine is not None:
        c = engine.counters
        last = engine.last_step
        engine_info = {
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "max_model_len": engine.max_model_len,
            "limits": {
                "max_num_seqs": engine.limits.max_num_seqs,
                "max_num_batched_tokens": engine.limits.max_num_batched_tokens,
                "decode_interval_ms": engine.limits.decode_interval_ms,
            },
            "kv_cache": {
                "used_blocks": engine.kv.num_used_blocks,
                "total_blocks": engine.kv.num_blocks,
                "usage_ratio": engine.kv.usage,
                "cached_free_blocks": engine.kv.num_evictable_blocks,
            },
            "prefix_cache": {
                "enabled": engine.kv.enable_prefix_caching,
                "hit_tokens": c.prefix_cache_hit_tokens,
                "queried_tokens": c.prefix_cache_queried_tokens,
                "hit_ratio": c.prefix_cache_hit_ratio,
            },
            "counters": {
                "requests_finished": dict(c.requests_finished),
                "prompt_tokens": c.prompt_tokens,
                "generation_tokens": c.generation_tokens,
                "steps": c.steps,
                "preemptions": c.preemptions,
            },
            "last_step": None
            if last is None
            else {
                "step": last.step,
                "duration_ms": last.duration_s * 1000.0,
                "prefill_tokens": last.prefill_tokens,
                "decode_tokens": last.decode_tokens,
                "num_running": last.num_running,
                "num_waiting": last.num_waiting,
            },
        }
    if engine is not None:
        engine_info["quantization"] = engine.quant_status()
    device_info = None
    if state.device is not None:
        latest = state.device_sampler.latest() if state.device_sampler is not None else None
        device_info = {
            "capabilities": state.device.capabilities().to_dict(),
            "telemetry": latest.to_dict() if latest is not None else None,
        }
    loop = state.control_loop
    return StatusResponse(
        phase=state.phase.value,
        model=state.served_model_name,
        server=server,
        engine=engine_info,
        policy=to_model(state.policy),
        device=device_info,
        controller=loop.status() if loop is not None else None,
    )


@router.get(
    "/v1/control/policy",
    response_model=PolicyModel,
    dependencies=[Depends(require_token)],
    tags=["control"],
)
async def get_policy(request: Request) -> PolicyModel:
    return to_model(serving(request).policy)


@router.put(
    "/v1/control/policy",
    response_model=PolicyModel,
    dependencies=[Depends(require_token)],
    tags=["control"],
)
async def put_policy(body: PolicyModel, request: Request) -> PolicyModel:
    return serving(request).apply_policy(body, changed_by="http")


def _check_configured_bounds(body: KnobsUpdate, cfg: Config) -> None:
    """Manual knobs stay within what the operator configured: [engine] caps are upper
    bounds (buffers and the KV pool are sized for them), and decode pacing is bounded by
    controller.decode_interval_max_ms (so paced steps always feed the watchdog)."""
    bounds = (
        ("max_num_seqs", body.max_num_seqs, "engine.max_num_seqs", cfg.engine.max_num_seqs),
        (
            "max_num_batched_tokens",
            body.max_num_batched_tokens,
            "engine.max_num_batched_tokens",
            cfg.engine.max_num_batched_tokens,
        ),
        (
            "decode_interval_ms",
            body.decode_interval_ms,
            "controller.decode_interval_max_ms",
            cfg.controller.decode_interval_max_ms,
        ),
    )
    for param, value, key, bound in bounds:
        if value is not None and value > bound:
            raise APIError(
                400,
                f"{param} {value:g} is above its configured bound {key} = {bound:g}",
                param=param,
                code="above_configured_bound",
            )


def _knobs(request: Request) -> Knobs:
    state = serving(request)
    engine = require_engine(state)
    limits = engine.limits
    latest = state.device_sampler.latest() if state.device_sampler is not None else None
    held = latest.sm_clock_lock_mhz if latest is not None else None
    lock = list(held) if held is not None else None
    return Knobs(
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        quant_level=engine.quant_status()["requested"],  # lands at the next engine step
        sm_clock_lock_mhz=lock,
        decode_interval_ms=limits.decode_interval_ms,
    )


@router.get(
    "/v1/control/knobs",
    response_model=Knobs,
    dependencies=[Depends(require_token)],
    tags=["control"],
)
async def get_knobs(request: Request) -> Knobs:
    return _knobs(request)


@router.put(
    "/v1/control/knobs",
    response_model=Knobs,
    dependencies=[Depends(require_token)],
    tags=["control"],
)
async def put_knobs(body: KnobsUpdate, request: Request) -> Knobs:
    state = serving(request)
    require_engine(state)
    _check_configured_bounds(body, state.cfg)  # before anything changes
    if body.clock_mhz is not None and state.device is None:
        raise APIError(409, "no device is open", param="clock_mhz", code="no_device")
    loop = state.control_loop
    if loop is None:  # the daemon starts it before the engine serves
        raise APIError(409, "the control loop is not running", code="no_control_loop")
    # The knobs are an input to the control loop, the one actuator: it writes them now
    # (off the event loop: building a level the first time takes seconds) and holds them.
    try:
        result = await asyncio.to_thread(
            functools.partial(
                loop.put_manual_knobs,
                max_num_seqs=body.max_num_seqs,
                max_num_batched_tokens=body.max_num_batched_tokens,
                quant_level=body.quant_level,
                clock_mhz=body.clock_mhz,
                decode_interval_ms=body.decode_interval_ms,
            )
        )
    except QuantLevelRefused as e:
        raise APIError(400, str(e), param="quant_level", code="invalid_quant_level") from None
    if result is not None and result.outcome not in IN_FORCE:
        raise APIError(
            409,
            f"clock lock not applied ({result.outcome.value}): {result.detail}",
            param="clock_mhz",
            code="knob_not_applied",
        )
    return _knobs(request)
