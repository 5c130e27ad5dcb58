"""bench/serve.py's arithmetic and workload, without servers: goodput, TPOT, determinism."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.serve import RequestResult, _range, build_workload, summarize


def _count_words(text: str) -> int:
    return len(text.split())


def test_workload_is_deterministic_and_sized() -> None:
    a = build_workload(20, (30, 60), (8, 16), 2.0, seed=3, count_tokens=_count_words)
    b = build_workload(20, (30, 60), (8, 16), 2.0, seed=3, count_tokens=_count_words)
    assert a == b
    assert a != build_workload(20, (30, 60), (8, 16), 2.0, seed=4, count_tokens=_count_words)
    assert all(30 - 1 <= _count_words(s.prompt) <= 60 for s in a)
    assert all(8 <= s.max_tokens <= 16 for s in a)
    times = [s.send_at_s for s in a]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0
    burst = build_workload(5, (30, 60), (8, 16), math.inf, seed=3, count_tokens=_count_words)
    assert [s.send_at_s for s in burst] == [0.0] * 5


def test_summary_goodput_counts_only_requests_meeting_both_slos() -> None:
    results = [
        # TTFT 0.5 s, 11 tokens in 1.5 s: TPOT = (1.5 - 0.5) / 10 = 100 ms -> good
        RequestResult(ok=True, ttft_s=0.5, e2e_s=1.5, output_tokens=11, itl_s=[0.1] * 10),
        # TPOT = (5.5 - 0.5) / 10 = 500 ms -> misses the TPOT SLO
        RequestResult(ok=True, ttft_s=0.5, e2e_s=5.5, output_tokens=11, itl_s=[0.5] * 10),
        # TTFT 3 s -> misses the TTFT SLO
        RequestResult(ok=True, ttft_s=3.0, e2e_s=3.5, output_tokens=6, itl_s=[0.1] * 5),
        # one token: no decode phase, only TTFT counts -> good
        RequestResult(ok=True, ttft_s=0.2, e2e_s=0.2, output_tokens=1),
        RequestResult(ok=False, error="HTTP 503"),
    ]
    s = summarize(results, duration_s=10.0, slo_ttft_ms=2000, slo_tpot_ms=200)
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["goodput_rps"] == pytest.approx(0.2)
    assert s["slo_attainment"] == pytest.approx(0.4)
    assert s["total_output_tokens"] == 29
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["ttft_ms"]["p99"] <= 3000.0
    assert s["errors"] == ["HTTP 503"]


def test_range_argument() -> None:
    assert _range("4:9") == (4, 9)
    assert _range("7") == (7, 7)
    with pytest.raises(argparse.ArgumentTypeError):
        _range("9:4")
