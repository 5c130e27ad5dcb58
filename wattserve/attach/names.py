"""The metric names each server kind exposes, and what wattserve reads them as.

One table per server kind maps wattserve's signals (queues, latency histograms, token
counters, KV use) to that server's Prometheus names. vLLM's are checked against the real
CPU build 0.32.0 (tests/data/attach/vllm-0.32.0-cpu.metrics); SGLang's against its source
(python/sglang/srt/metrics/collector.py, tests/data/attach/README.md). This module holds
names only: no parsing, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ServerKind = Literal["vllm", "sglang"]
SERVER_KINDS: tuple[ServerKind, ...] = ("vllm", "sglang")


@dataclass(frozen=True)
class MetricNames:
    """A server's metric family names (without the _total/_bucket sample suffixes)."""

    kind: ServerKind
    running: str  # gauge: requests being generated
    waiting: str  # gauge: requests queued
    ttft: str  # histogram, seconds
    itl: str  # histogram, seconds between two output tokens
    prompt_tokens: str  # counter
    generation_tokens: str  # counter
    kv_usage: str  # gauge, 0..1

    def required(self) -> dict[str, str]:
        """Signal name -> family name, for every metric the loop needs."""
        return {
            "running": self.running,
            "waiting": self.waiting,
            "ttft": self.ttft,
            "itl": self.itl,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "kv_usage": self.kv_usage,
        }


VLLM = MetricNames(
    kind="vllm",
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    ttft="vllm:time_to_first_token_seconds",
    itl="vllm:inter_token_latency_seconds",
    prompt_tokens="vllm:prompt_tokens",
    generation_tokens="vllm:generation_tokens",
    kv_usage="vllm:kv_cache_usage_perc",
)

SGLANG = MetricNames(
    kind="sglang",
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    ttft="sglang:time_to_first_token_seconds",
    itl="sglang:inter_token_latency_seconds",
    prompt_tokens="sglang:prompt_tokens",
    generation_tokens="sglang:generation_tokens",
    kv_usage="sglang:token_usage",
)

BY_KIND: dict[ServerKind, MetricNames] = {"vllm": VLLM, "sglang": SGLANG}
