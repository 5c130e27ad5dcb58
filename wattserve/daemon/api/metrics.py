"""Prometheus metrics of one serving process, on a registry owned by the app (no globals).

Request-level figures (outcomes, tokens, TTFT/TPOT/ITL/E2E histograms) are recorded by
the API as each request's events arrive; engine-level figures (running/waiting, KV-cache
usage, batch caps, step durations) are read from the engine at scrape time or from its
step hook. Names carry the `wattserve_` prefix and their unit. Device and controller
figures are read at scrape time from the latest reading and decision; nothing here
invents values it cannot measure.
This module only writes metrics: nothing may read serving state back from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wattserve.daemon.engine.engine import Engine, StepStats
from wattserve.daemon.request_events import FirstToken, RequestFinished

PREFIX = "wattserve"
OUTCOMES = (
    "stop",
    "length",
    "abort",
    "error",
    "rejected_invalid",
    "rejected_overload",
    "rejected_unavailable",
)

# CPU-scale latencies: a prompt can take seconds to prefill, a token tens of milliseconds.
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80)
_TOKEN_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class _EngineCollector(Collector):
    """Gauges read from the live engine at scrape time."""

    def __init__(
        self,
        engine: Callable[[], Engine | None],
        in_flight: Callable[[], int],
        ready: Callable[[], bool],
    ) -> None:
        self._engine = engine
        self._in_flight = in_flight
        self._ready = ready

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}_ready",
            "1 once the model is loaded and warmed up, 0 before that and while draining",
            value=1.0 if self._ready() else 0.0,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_requests_in_flight",
            "Generation requests admitted by the API and not yet answered",
            value=self._in_flight(),
        )
        engine = self._engine()
        if engine is None:
            return
        yield GaugeMetricFamily(
            f"{PREFIX}_requests_running", "Sequences in the running batch", value=engine.num_running
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_requests_waiting", "Sequences queued in the engine", value=engine.num_waiting
        )
        kv = engine.kv
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", value=kv.usage
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_used_blocks", "KV-cache blocks in use", value=kv.num_used_blocks
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_total_blocks", "KV-cache blocks in the pool", value=kv.num_blocks
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_cached_free_blocks",
            "Unreferenced KV-cache blocks still holding a reusable prefix",
            value=kv.num_evictable_blocks,
        )
        counters = engine.counters
        yield CounterMetricFamily(
            f"{PREFIX}_prefix_cache_queried_tokens",
            "Tokens of admitted sequences looked up in the prefix cache",
            value=counters.prefix_cache_queried_tokens,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_prefix_cache_hit_tokens",
            "Tokens found in the prefix cache and not computed",
            value=counters.prefix_cache_hit_tokens,
        )
        limits = engine.limits
        yield GaugeMetricFamily(
            f"{PREFIX}_batch_cap_seqs",
            "Batch cap: most sequences per step",
            value=limits.max_num_seqs,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_batch_cap_tokens",
            "Token budget of one engine step",
            value=limits.max_num_batched_tokens,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_decode_interval_seconds",
            "Decode pacing: least time between decode-only steps while none waits (0: off)",
            value=limits.decode_interval_ms / 1000.0,
        )


class _DeviceCollector(Collector):
    """Device and controller gauges read at scrape time (absent until the device is open)."""

    def __init__(self, state: Callable[[], Any]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        policy = state.policy
        yield GaugeMetricFamily(
            f"{PREFIX}_power_budget_watts",
            "Power budget of the policy in force",
            value=policy.power_budget_w,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_ttft_slo_seconds",
            "TTFT SLO of the policy in force",
            value=policy.ttft_slo_ms / 1000.0,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_tpot_slo_seconds",
            "TPOT SLO of the policy in force",
            value=policy.tpot_slo_ms / 1000.0,
        )
        sampler = state.device_sampler
        reading = sampler.latest() if sampler is not None else None
        if reading is not None:
            for name, help_text, value in (
                ("gpu_power_watts", "GPU board power (latest reading)", reading.power_w),
                ("gpu_temperature_celsius", "GPU core temperature", reading.gpu_temp_c),
                (
                    "gpu_thermal_margin_celsius",
                    "Degrees left before slowdown",
                    reading.thermal_margin_c,
                ),
                (
                    "gpu_sm_clock_hertz",
                    "SM clock",
                    None if reading.sm_clock_mhz is None else reading.sm_clock_mhz * 1e6,
                ),
                ("gpu_power_limit_watts", "Power limit in force", reading.power_limit_w),
                (
                    "gpu_utilization_ratio",
                    "GPU busy fraction",
                    None if reading.gpu_util_pct is None else reading.gpu_util_pct / 100.0,
                ),
            ):
                if value is not None:
                    yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
            if reading.energy_j is not None:
                yield CounterMetricFamily(
                    f"{PREFIX}_gpu_energy_joules", "GPU energy counter", value=reading.energy_j
                )
            yield GaugeMetricFamily(
                f"{PREFIX}_gpu_telemetry_stale",
                "1 while the device reading is stale or lost",
                value=1.0 if (reading.stale or reading.device_lost) else 0.0,
            )
        feed = getattr(state, "feed", None)
        latest = feed.latest() if feed is not None else None
        if latest is not None:
            for name, help_text, value in (
                (
                    "energy_per_token_joules",
                    "GPU energy per generated token over the last feed window",
                    latest.serving.energy_per_token_j,
                ),
                (
                    "slo_attainment_ratio",
                    "Share of requests finished in the last feed window that met both SLOs",
                    latest.latency.slo_attainment_ratio,
                ),
            ):
                if value is not None:
                    yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
        engine = state.engine
        if engine is not None:
            level = GaugeMetricFamily(
                f"{PREFIX}_quant_level_info",
                "1 for the weight quantization level in use",
                labels=["level"],
            )
            level.add_metric([engine.quant_level], 1.0)
            yield level
        loop = state.control_loop
        if loop is not None:
            drift = CounterMetricFamily(
                f"{PREFIX}_knob_drift",
                "Device knobs found changed behind the control loop (read back otherwise, or "
                "lost to a device re-initialisation) and re-applied, by knob",
                labels=["knob"],
            )
            for knob in ("power_limit_w", "sm_clock_lock_mhz"):
                drift.add_metric([knob], loop.knob_drift.get(knob, 0))
            yield drift
            last = loop.controller.last_decision
            if last is not None:
                yield GaugeMetricFamily(
                    f"{PREFIX}_controller_effective_budget_watts",
                    "Power budget after thermal derating",
                    value=last.effective_budget_w,
                )
                if last.knobs.sm_clock_mhz is not None:
                    yield GaugeMetricFamily(
                        f"{PREFIX}_controller_sm_clock_target_hertz",
                        "SM clock the controller chose",
                        value=last.knobs.sm_clock_mhz * 1e6,
                    )


class Metrics:
    """All metrics of one app; `render()` gives the Prometheus text format."""

    def __init__(self) -> None:
        # Request counters and latencies come from request events (on_first_token,
        # on_request_finished); the ITL histogram is observed per token by the API.
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "Generation requests by outcome", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros so rates work from the first scrape
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of answered requests", registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated for answered requests", registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "(E2E - TTFT) / (output tokens - 1), per request",
            buckets=_TOKEN_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Gap between consecutive tokens of a request",
            buckets=_TOKEN_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_E2E_BUCKETS_S,
            registry=r,
        )
        self.step_duration = Histogram(
            f"{PREFIX}_engine_step_duration_seconds",
            "Wall time of one engine step",
            buckets=_STEP_BUCKETS_S,
            registry=r,
        )
        self.preemptions = Counter(
            f"{PREFIX}_engine_preemptions", "Sequences preempted for KV-cache room", registry=r
        )
        self.decisions = Counter(
            f"{PREFIX}_controller_decisions",
            "Controller decisions that changed a knob, the mode or the reason, by reason code",
            ["reason"],
            registry=r,
        )
        self.events = Counter(
            f"{PREFIX}_events", "Events published on the live feed, by kind", ["kind"], registry=r
        )

    def bind(
        self,
        engine: Callable[[], Engine | None],
        in_flight: Callable[[], int],
        ready: Callable[[], bool],
    ) -> None:
        """Register the scrape-time gauges; called once by the app factory."""
        self.registry.register(_EngineCollector(engine, in_flight, ready))

    def bind_device(self, state: Callable[[], Any]) -> None:
        """Register the device and controller gauges (state() is the ServingState)."""
        self.registry.register(_DeviceCollector(state))

    def on_step(self, stats: StepStats) -> None:
        """Engine step hook (runs on the engine thread; prometheus-client is thread-safe)."""
        self.step_duration.observe(stats.duration_s)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)

    def on_first_token(self, event: FirstToken) -> None:
        self.ttft.observe(event.ttft_s)

    def on_request_finished(self, event: RequestFinished) -> None:
        self.requests.labels(event.finish_reason).inc()
        self.prompt_tokens.inc(event.prompt_tokens)
        self.generation_tokens.inc(event.completion_tokens)
        if event.e2e_s is not None:
            self.e2e.observe(event.e2e_s)
        if event.tpot_s is not None:
            self.tpot.observe(event.tpot_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
