"""Per-window figures for telemetry: rates from cumulative counters, latency percentiles.

The daemon keeps cumulative counters (tokens generated, device energy) and sees each
finished request's TTFT/TPOT once. A telemetry tick closes the window: energy and tokens
over it give J/token and tokens/s, and the requests finished within it give p50/p99
and SLO attainment. A counter that went backwards (device re-initialised) gives None
for that window rather than a negative figure. Pure: the caller passes the clock.
It must not read the engine or the device itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from wattserve.controller.models import percentile_of
from wattserve.daemon.mqtt.payloads import LatencyFigures


@dataclass(frozen=True)
class WindowFigures:
    """What happened between two telemetry ticks. None: not measurable in this window."""

    window_s: float | None
    requests_finished: int
    generation_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    energy_window_j: float | None
    energy_per_token_j: float | None
    latency: LatencyFigures


@dataclass(frozen=True)
class _Mark:
    now_s: float
    generation_tokens: int
    prompt_tokens: int
    energy_j: float | None


class TelemetryWindow:
    """record_request() from any thread; close() once per telemetry tick."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ttft_ms: list[float] = []
        self._tpot_ms: list[float | None] = []
        self._last: _Mark | None = None

    def start(
        self, *, now_s: float, generation_tokens: int, prompt_tokens: int, energy_j: float | None
    ) -> None:
        """Set the baseline for rates, so the first close() covers the time since now_s."""
        self._last = _Mark(now_s, generation_tokens, prompt_tokens, energy_j)

    def record_request(self, ttft_ms: float, tpot_ms: float | None) -> None:
        """One finished request; tpot_ms is None for a request of one output token."""
        with self._lock:
            self._ttft_ms.append(ttft_ms)
            self._tpot_ms.append(tpot_ms)

    def close(
        self,
        *,
        now_s: float,
        generation_tokens: int,
        prompt_tokens: int,
        energy_j: float | None,
        ttft_slo_ms: float | None = None,
        tpot_slo_ms: float | None = None,
    ) -> WindowFigures:
        """End the window at now_s (monotonic seconds) given the cumulative counters.

        Without start(), the first call only sets the baseline for rates (they come back None).
        """
        with self._lock:
            ttft, tpot = self._ttft_ms, self._tpot_ms
            self._ttft_ms, self._tpot_ms = [], []
        mark = _Mark(now_s, generation_tokens, prompt_tokens, energy_j)
        last, self._last = self._last, mark
        window_s = gen_rate = prompt_rate = energy_window_j = energy_per_token_j = None
        if last is not None and now_s > last.now_s:
            window_s = now_s - last.now_s
            gen = generation_tokens - last.generation_tokens
            prompt = prompt_tokens - last.prompt_tokens
            gen_rate = gen / window_s if gen >= 0 else None
            prompt_rate = prompt / window_s if prompt >= 0 else None
            if energy_j is not None and last.energy_j is not None and energy_j >= last.energy_j:
                energy_window_j = energy_j - last.energy_j
                if gen > 0:
                    energy_per_token_j = energy_window_j / gen
        return WindowFigures(
            window_s=window_s,
            requests_finished=len(ttft),
            generation_tokens_per_s=gen_rate,
            prompt_tokens_per_s=prompt_rate,
            energy_window_j=energy_window_j,
            energy_per_token_j=energy_per_token_j,
            latency=_latency(ttft, tpot, ttft_slo_ms, tpot_slo_ms),
        )


def percentile(values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile (the controller's own definition); None when empty."""
    return percentile_of(values, pct) if values else None


def _latency(
    ttft: list[float],
    tpot: list[float | None],
    ttft_slo_ms: float | None,
    tpot_slo_ms: float | None,
) -> LatencyFigures:
    tpots = [v for v in tpot if v is not None]
    attainment = None
    if ttft and ttft_slo_ms is not None and tpot_slo_ms is not None:
        met = sum(
            1
            for t, p in zip(ttft, tpot, strict=True)
            if t <= ttft_slo_ms and (p is None or p <= tpot_slo_ms)
        )
        attainment = met / len(ttft)
    return LatencyFigures(
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        slo_attainment_ratio=attainment,
    )
