"""wattserve attach's live feed: what the dashboard on the front shows.

Each period a snapshot of the attached server in the daemon's telemetry schema (the MQTT
payload, wattserve/attach/telemetry.py), with what only a window over time gives: the
device energy of the window, J per generated token, and the requests the front saw end
with their SLO attainment (the policy's SLOs, judged on the front's own TTFT/TPOT). The
controller's decisions come in as events (a control-loop sink). It must not decide,
apply knobs or serve HTTP (the front serves the dashboard's routes over it).
"""

from __future__ import annotations

import time

from wattserve.attach.front import RequestTiming
from wattserve.attach.runner import AttachRunner
from wattserve.attach.telemetry import telemetry_payload
from wattserve.daemon.feed import FeedHub
from wattserve.daemon.mqtt.payloads import TelemetryPayload
from wattserve.daemon.mqtt.window import TelemetryWindow


class AttachFeed(FeedHub):
    """Snapshots of one attached server; follow(runner) before run()."""

    def __init__(self, *, period_s: float = 1.0, history_s: float = 300.0) -> None:
        super().__init__(period_s=period_s, history_s=history_s)
        self._runner: AttachRunner | None = None
        self._window = TelemetryWindow()

    def follow(self, runner: AttachRunner) -> None:
        self._runner = runner
        energy_j = runner.device.read().energy_j
        self._window.start(now_s=time.monotonic(), **self._counters(runner, energy_j))

    def on_request(self, timing: RequestTiming) -> None:
        """Front hook: a streamed request the front saw end, with a first token, is one
        latency sample (an aborted one is not)."""
        if not timing.aborted and timing.ttft_s is not None:
            self._window.record_request(
                timing.ttft_s * 1e3, None if timing.tpot_s is None else timing.tpot_s * 1e3
            )

    @staticmethod
    def _counters(runner: AttachRunner, energy_j: float | None) -> dict:
        counters = runner.engine.counters
        return {
            "generation_tokens": counters.generation_tokens,
            "prompt_tokens": counters.prompt_tokens,
            "energy_j": energy_j,
        }

    def snapshot(self) -> TelemetryPayload:
        runner = self._runner
        if runner is None:
            raise RuntimeError("AttachFeed.follow(runner) was not called")
        payload = telemetry_payload(runner)  # the one GPU read of the snapshot
        policy = runner.control.controller.policy
        figures = self._window.close(
            now_s=time.monotonic(),
            **self._counters(runner, payload.device.energy_j),
            ttft_slo_ms=policy.ttft_slo_ms,
            tpot_slo_ms=policy.tpot_slo_ms,
        )
        serving = payload.serving.model_copy(
            update={
                "requests_finished": figures.requests_finished,
                "energy_window_j": figures.energy_window_j,
                "energy_per_token_j": figures.energy_per_token_j,
            }
        )
        latency = payload.latency.model_copy(
            update={"slo_attainment_ratio": figures.latency.slo_attainment_ratio}
        )
        return payload.model_copy(update={"serving": serving, "latency": latency})
