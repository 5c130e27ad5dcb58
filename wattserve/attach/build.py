"""Assemble an attached server's controller, control loop and runner from [controller].

The controller is the daemon's, with the knobs that exist here: the SM clock lock and the
power limit of the server's GPUs, and the front's admission cap (max_num_seqs) when there
is a front; a single `native` quantization level, so it never switches. It must not open
devices or sockets (the service does) nor decide anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wattserve.attach.admission import Admission
from wattserve.attach.engine import QUANT_LEVEL, AttachedEngine
from wattserve.attach.gpus import GpuGroup
from wattserve.attach.names import MetricNames
from wattserve.attach.runner import AttachRunner
from wattserve.controller.controller import Controller
from wattserve.controller.policy import Knobs, QuantOption
from wattserve.controller.schema import to_policy
from wattserve.controller.signals import EngineConstraints
from wattserve.daemon.config import ControllerConfig
from wattserve.daemon.control_loop import ControlLoop, device_constraints, params_from_config

# The batch-token cap is the server's own; the controller gets one it cannot change.
_BATCHED_TOKENS = 8192


def build_runner(
    cfg: ControllerConfig,
    names: MetricNames,
    fetch: Callable[[], str],
    device: GpuGroup,
    *,
    admission: Admission | None,
    max_num_seqs: int,
    server_url: str = "",
    period_s: float = 1.0,
    flops_per_token: float = 0.0,
    weight_bytes_per_step: float = 0.0,
    **loop_kwargs: Any,
) -> AttachRunner:
    """The runner over one server; `admission` is the front's (None: no front)."""
    if max_num_seqs < 1:
        raise ValueError("--max-num-seqs must be >= 1")
    engine = AttachedEngine(admission, max_num_seqs, _BATCHED_TOKENS)
    telemetry = device.read()
    constraints = EngineConstraints(
        max_num_seqs_max=max_num_seqs,
        max_num_batched_tokens_max=_BATCHED_TOKENS,
        max_num_batched_tokens_min=_BATCHED_TOKENS,
        quant_options=(QuantOption(QUANT_LEVEL),),
        full_precision_level=QUANT_LEVEL,
        decode_interval_max_ms=0.0,
    )
    initial = Knobs(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=_BATCHED_TOKENS, quant_level=QUANT_LEVEL
    )
    controller = Controller(
        to_policy(cfg),
        device_constraints(device, telemetry),
        constraints,
        initial,
        params_from_config(cfg),
    )
    clock = loop_kwargs.get("clock")
    control = ControlLoop(controller, engine, device, kv_bytes_per_token=1, **loop_kwargs)
    extra = {"clock": clock} if clock is not None else {}
    return AttachRunner(
        names,
        fetch,
        engine,
        control,
        device,
        admission=admission,
        server_url=server_url,
        period_s=period_s,
        flops_per_token=flops_per_token,
        weight_bytes_per_step=weight_bytes_per_step,
        **extra,
    )
