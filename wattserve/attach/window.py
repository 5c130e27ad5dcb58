"""Turn two scrapes of a server's counters and histograms into one window's rates and latencies.

A window is the difference between consecutive scrapes: token rates from the counters,
TTFT and inter-token latency percentiles from the histograms' bucket deltas (linear within
a bucket, as Prometheus' histogram_quantile does), and those deltas as latency samples the
controller can take. A counter that went down means the server restarted: the window is
refused (CounterReset) and the caller starts again from the new scrape. It must not fetch,
log, or keep state between calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wattserve.attach.scrape import Histogram, ServerSample

# At most this many latency samples per histogram per window: the percentile estimate
# needs the shape, not one sample per token.
MAX_SAMPLES = 256


class CounterReset(ValueError):
    """A counter or histogram went backwards between two scrapes: the server restarted."""


@dataclass(frozen=True)
class WindowStats:
    """One window between two scrapes. Rates in tokens/s; latencies in seconds (None: no
    observation in this window)."""

    duration_s: float
    prompt_tokens: float
    generation_tokens: float
    prompt_tok_s: float
    generation_tok_s: float
    running: float
    waiting: float
    kv_usage: float
    ttft_count: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_count: float
    itl_mean_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    ttft_samples_s: tuple[float, ...]
    itl_samples_s: tuple[float, ...]


def bucket_deltas(prev: Histogram, cur: Histogram) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-bucket (not cumulative) counts observed between the two, over cur's bounds."""
    if prev.bounds != cur.bounds:
        raise CounterReset("histogram buckets changed")
    cumulative = [c - p for c, p in zip(cur.cumulative, prev.cumulative, strict=True)]
    if cur.count < prev.count or any(d < 0 for d in cumulative):
        raise CounterReset("histogram count went down")
    per_bucket = [cumulative[0]] + [b - a for a, b in zip(cumulative, cumulative[1:], strict=False)]
    return cur.bounds, tuple(max(0.0, n) for n in per_bucket)


def quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """The q-quantile (0..1) of per-bucket counts, linear within a bucket; the +inf bucket
    answers with the largest finite bound. None when nothing was observed."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    lower = 0.0
    for bound, n in zip(bounds, counts, strict=True):
        if n > 0 and seen + n >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - seen) / n
        seen += n
        if not math.isinf(bound):
            lower = bound
    return lower


def samples(bounds: tuple[float, ...], counts: tuple[float, ...]) -> tuple[float, ...]:
    """Latency samples with the window's distribution: each bucket's midpoint, as many
    times as it counted (scaled down to MAX_SAMPLES in all)."""
    total = sum(counts)
    if total <= 0:
        return ()
    scale = min(1.0, MAX_SAMPLES / total)
    out: list[float] = []
    lower = 0.0
    for bound, n in zip(bounds, counts, strict=True):
        value = lower if math.isinf(bound) else (lower + bound) / 2
        out.extend([value] * int(round(n * scale)))
        if not math.isinf(bound):
            lower = bound
    return tuple(out)


def window(prev: ServerSample, cur: ServerSample, duration_s: float) -> WindowStats:
    """The window from prev to cur (both complete). Raises CounterReset."""
    if duration_s <= 0:
        raise ValueError("window duration_s must be > 0")
    if not (prev.complete and cur.complete):
        raise ValueError("window needs two complete samples (check `missing` first)")
    prompt = cur.prompt_tokens_total - prev.prompt_tokens_total  # type: ignore[operator]
    generated = cur.generation_tokens_total - prev.generation_tokens_total  # type: ignore[operator]
    if prompt < 0 or generated < 0:
        raise CounterReset("token counters went down")
    ttft_bounds, ttft_counts = bucket_deltas(prev.ttft, cur.ttft)  # type: ignore[arg-type]
    itl_bounds, itl_counts = bucket_deltas(prev.itl, cur.itl)  # type: ignore[arg-type]
    itl_count = cur.itl.count - prev.itl.count  # type: ignore[union-attr]
    itl_sum = cur.itl.sum - prev.itl.sum  # type: ignore[union-attr]
    return WindowStats(
        duration_s=duration_s,
        prompt_tokens=prompt,
        generation_tokens=generated,
        prompt_tok_s=prompt / duration_s,
        generation_tok_s=generated / duration_s,
        running=cur.running or 0.0,
        waiting=cur.waiting or 0.0,
        kv_usage=cur.kv_usage or 0.0,
        ttft_count=sum(ttft_counts),
        ttft_p50_s=quantile(0.5, ttft_bounds, ttft_counts),
        ttft_p99_s=quantile(0.99, ttft_bounds, ttft_counts),
        itl_count=itl_count,
        itl_mean_s=itl_sum / itl_count if itl_count > 0 else None,
        itl_p50_s=quantile(0.5, itl_bounds, itl_counts),
        itl_p99_s=quantile(0.99, itl_bounds, itl_counts),
        ttft_samples_s=samples(ttft_bounds, ttft_counts),
        itl_samples_s=samples(itl_bounds, itl_counts),
    )
