"""wattserve.attach: reading each server's recorded /metrics, windows, percentiles, restarts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from wattserve.attach.detect import DetectError, detect_kind
from wattserve.attach.names import SGLANG, VLLM
from wattserve.attach.scrape import Histogram, read_sample
from wattserve.attach.window import CounterReset, quantile, window

DATA = Path(__file__).resolve().parent.parent / "data" / "attach"
VLLM_TEXT = (DATA / "vllm-0.32.0-cpu.metrics").read_text()
SGLANG_TEXT = (DATA / "sglang-00ae9c1.metrics").read_text()


@pytest.mark.parametrize(("text", "names"), [(VLLM_TEXT, VLLM), (SGLANG_TEXT, SGLANG)])
def test_every_metric_is_read_from_each_servers_recorded_exposition(text, names) -> None:
    sample = read_sample(text, names)
    assert sample.missing == ()
    assert sample.prompt_tokens_total > 0 and sample.generation_tokens_total > 0
    assert sample.ttft.count > 0 and sample.itl.count > 0
    assert sample.ttft.cumulative[-1] == sample.ttft.count
    assert 0 <= sample.kv_usage <= 1


def test_detect_kind_from_the_families_prefix() -> None:
    assert detect_kind(VLLM_TEXT) == "vllm"
    assert detect_kind(SGLANG_TEXT) == "sglang"
    with pytest.raises(DetectError, match="--server-kind"):
        detect_kind("# TYPE other gauge\nother 1\n", "http://x")


def test_vllm_families_summed_over_engine_labels() -> None:
    # A second engine (data parallel): each generation_tokens sample twice, engine 0 and 1.
    lines = []
    for line in VLLM_TEXT.splitlines():
        lines.append(line)
        if line.startswith("vllm:generation_tokens_total{"):
            lines.append(line.replace('engine="0"', 'engine="1"'))
    one = read_sample(VLLM_TEXT, VLLM).generation_tokens_total
    assert read_sample("\n".join(lines) + "\n", VLLM).generation_tokens_total == 2 * one


def test_a_renamed_or_missing_family_is_named_not_raised() -> None:
    renamed = SGLANG_TEXT.replace("sglang:num_queue_reqs", "sglang:num_waiting_reqs")
    sample = read_sample(renamed, SGLANG)
    assert sample.missing == ("sglang:num_queue_reqs",)
    assert not sample.complete
    # The same text read as the other server kind misses all of them.
    assert len(read_sample(SGLANG_TEXT, VLLM).missing) == 7


def _histogram(values: list[float], bounds=(0.01, 0.1, 1.0, float("inf"))) -> Histogram:
    cumulative = tuple(float(sum(1 for v in values if v <= b)) for b in bounds)
    return Histogram(tuple(bounds), cumulative, float(sum(values)), float(len(values)))


def _sample(prompt: float, gen: float, ttft: list[float], itl: list[float]):
    base = read_sample(SGLANG_TEXT, SGLANG)
    return dataclasses.replace(
        base,
        prompt_tokens_total=prompt,
        generation_tokens_total=gen,
        ttft=_histogram(ttft),
        itl=_histogram(itl),
        running=4.0,
        waiting=2.0,
    )


def test_window_rates_and_percentiles_come_from_the_deltas_only() -> None:
    before = _sample(100, 1000, [5.0] * 50, [0.5] * 50)  # old, slow history
    after = _sample(300, 1400, [5.0] * 50 + [0.05] * 10, [0.5] * 50 + [0.005] * 400)
    w = window(before, after, 2.0)
    assert w.prompt_tok_s == 100 and w.generation_tok_s == 200
    assert w.ttft_count == 10 and w.itl_count == 400
    # Only the new observations: all in (0.01, 0.1] and [0, 0.01].
    assert 0.01 < w.ttft_p99_s <= 0.1
    assert w.itl_p99_s <= 0.01
    assert w.itl_mean_s == pytest.approx(0.005)
    assert w.running == 4 and w.waiting == 2
    assert len(w.ttft_samples_s) == 10 and all(0.01 < s <= 0.1 for s in w.ttft_samples_s)


def test_quantile_interpolates_within_a_bucket() -> None:
    bounds = (1.0, 2.0, float("inf"))
    assert quantile(0.5, bounds, (0.0, 10.0, 0.0)) == pytest.approx(1.5)
    assert quantile(0.99, bounds, (0.0, 0.0, 3.0)) == 2.0  # +inf answers the last bound
    assert quantile(0.5, bounds, (0.0, 0.0, 0.0)) is None


def test_counters_going_down_is_a_restart_not_a_negative_rate() -> None:
    before = _sample(500, 5000, [0.05] * 10, [0.005] * 10)
    after = _sample(20, 40, [0.05] * 1, [0.005] * 2)
    with pytest.raises(CounterReset):
        window(before, after, 1.0)
