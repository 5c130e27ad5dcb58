"""Assemble an attached server's controller, control loop and runner from [controller].

The controller is the daemon's, with the knobs that exist here: the SM clock lock and the
power limit of the server's GPUs, and the front's admission cap (max_num_seqs) when there
is a front; a single `native` quantization level, so it never switches. It must not open
devices or sockets (the service does) nor decide anything beyond AttachController's one
rule.
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


class AttachController(Controller):
    """The daemon's controller, learning from a lower clock when the board cannot hold the
    budget.

    The daemon's controller learns at the top clock, trusting the board power limit to hold
    the budget meanwhile. Below the limit's floor (a 160 W budget on a GPU whose limit goes
    down to 200 W) nothing holds it until the power guard has measured it over: the bench
    saw 0.4-1 s over the budget at the top clock on the busy fake server, the vLLM run
    3-5 s (its peaks sat at the 200 W floor). Here its first half runs where the daemon's
    second half does (learning_low_clock_fraction x the top clock), so learning sees one
    clock, never the top; the power guard still acts on what it measures, and once the
    models are trusted the outlook's safe clock and the guards take over as in the daemon.
    """

    def _learning(self, base: Knobs, level: str, ceiling: int | None):  # type: ignore[override]
        budget_w = self._policy.power_budget_w * self.power_guard.derate
        first_half = (
            self.learner.step_model(level).samples < self.params.learning.learning_min_steps // 2
        )
        if first_half and not self.limits.hw_limit_enforces(budget_w):
            start = self.limits.snap(
                self.params.learning.learning_low_clock_fraction * self.device.sm_clock_max_mhz
            )
            ceiling = start if ceiling is None else min(ceiling, start)
        return super()._learning(base, level, ceiling)


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
    controller = AttachController(
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
