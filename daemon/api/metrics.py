"""Prometheus metrics of one serving process, on a registry owned by the app (no globals).

Request-level figures (outcomes, tokens, TTFT/TPOT/ITL/E2E histograms) are recorded by
the API as each request's events arrive; engine-level figures (running/waiting, KV-cache
usage, batch caps, step durations) are read from the engine at scrape time or from its
step hook. Names carry the `wattserve_` prefix and their unit. Device and controller
figures join here when those parts exist; nothing here invents values it cannot measure.
This module only writes metrics: nothing may read serving state back from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from daemon.engine.engine import Engine, StepStats

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


class Metrics:
    """All metrics of one app; `render()` gives the Prometheus text format."""

    def __init__(self) -> None:
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

    def bind(
        self,
        engine: Callable[[], Engine | None],
        in_flight: Callable[[], int],
        ready: Callable[[], bool],
    ) -> None:
        """Register the scrape-time gauges; called once by the app factory."""
        self.registry.register(_EngineCollector(engine, in_flight, ready))

    def on_step(self, stats: StepStats) -> None:
        """Engine step hook (runs on the engine thread; prometheus-client is thread-safe)."""
        self.step_duration.observe(stats.duration_s)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
