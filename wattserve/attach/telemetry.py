"""An attached server's telemetry in the daemon's MQTT payload: the same topic and schema.

The serving figures come from the runner's last window (the server's own counters and
histograms), the device figures from its GPU group, the knobs from the control loop's
decision. It must not publish (the MQTT link does) nor keep state.
"""

from __future__ import annotations

from wattserve.attach.runner import OK, AttachRunner
from wattserve.controller.schema import to_model
from wattserve.daemon.mqtt.payloads import (
    DeviceFigures,
    KnobFigures,
    LatencyFigures,
    ServingFigures,
    TelemetryPayload,
)


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else value_s * 1e3


def telemetry_payload(runner: AttachRunner) -> TelemetryPayload:
    """One telemetry message now."""
    w = runner.last_window
    read = runner.device.read()
    adm = runner.admission
    serving = ServingFigures(requests_in_flight=None if adm is None else adm.in_flight_requests)
    latency = LatencyFigures()
    if w is not None and runner.health == OK:
        serving = ServingFigures(
            requests_running=int(w.running),
            requests_waiting=int(w.waiting),
            requests_in_flight=None if adm is None else adm.in_flight_requests,
            generation_tokens_per_s=w.generation_tok_s,
            prompt_tokens_per_s=w.prompt_tok_s,
            kv_cache_usage_ratio=w.kv_usage,
        )
        latency = LatencyFigures(
            ttft_p50_ms=_ms(w.ttft_p50_s),
            ttft_p99_ms=_ms(w.ttft_p99_s),
            tpot_p50_ms=_ms(w.itl_p50_s),
            tpot_p99_ms=_ms(w.itl_p99_s),
        )
    return TelemetryPayload(
        window_s=None if w is None else w.duration_s,
        phase="ready" if runner.health == OK else runner.health,
        device=DeviceFigures.from_telemetry(read),
        serving=serving,
        latency=latency,
        knobs=KnobFigures(
            max_num_seqs=None if adm is None else adm.max_num_seqs,
            quant_level=None,
            sm_clock_lock_mhz=read.sm_clock_lock_mhz,
            power_limit_w=read.power_limit_w,
        ),
        policy=to_model(runner.control.controller.policy).model_dump(),
    )
