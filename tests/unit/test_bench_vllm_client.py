"""wattserve/bench/vllm_client.py without running vLLM: the dataset it writes, its command line, and
its result read into bench serve's summary keys."""

from __future__ import annotations

import json
import math
from pathlib import Path

from wattserve.bench import serve
from wattserve.bench.serve import RequestSpec, summarize
from wattserve.bench.vllm_client import client_argv, summary_from_result, write_dataset

# The keys and shapes `vllm bench serve --save-result` writes (vLLM 0.32.0, with
# --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --goodput ...).
RESULT = {
    "duration": 12.5,
    "completed": 7,
    "failed": 1,
    "total_input_tokens": 700,
    "total_output_tokens": 140,
    "request_throughput": 0.56,
    "request_goodput": 0.4,
    "output_throughput": 11.2,
    **{f"{s}_{m}_ms": 10.0 for s in ("mean", "median", "std") for m in ("ttft", "tpot", "itl")},
    **{f"p{p}_{m}_ms": float(p) for p in (50, 90, 99) for m in ("ttft", "tpot", "itl", "e2el")},
    "mean_e2el_ms": 900.04,
}


def test_the_dataset_is_one_prompt_and_output_length_a_line(tmp_path):
    specs = [RequestSpec('Say "hi"\nnow', 16, 0.0), RequestSpec("x", 3, 1.5)]
    path = tmp_path / "d.jsonl"
    write_dataset(specs, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"prompt": 'Say "hi"\nnow', "output_tokens": 16},
        {"prompt": "x", "output_tokens": 3},
    ]


def test_the_command_line_sends_the_same_chat_requests(tmp_path):
    argv = client_argv(
        Path("/v/bin/vllm"), "http://127.0.0.1:9", "m", tmp_path, tmp_path / "d.jsonl", 8,
        2.5, 4, 7, 2000.0, 200.0, tmp_path / "out",
    )  # fmt: skip
    text = " ".join(argv)
    assert argv[:3] == ["/v/bin/vllm", "bench", "serve"]
    assert "--backend openai-chat" in text and "--endpoint /v1/chat/completions" in text
    # Each line's own output length; the server applies the chat template, as for ours.
    assert "--custom-output-len -1 --skip-chat-template --disable-shuffle" in text
    assert "--temperature 0" in text and "--ignore-eos" not in text
    assert "--request-rate 2.5" in text and "--max-concurrency 4" in text
    assert "--num-prompts 8" in text and "--seed 7" in text
    assert argv[argv.index("--goodput") + 1 : argv.index("--goodput") + 3] == [
        "ttft:2000",
        "tpot:200",
    ]
    inf = client_argv(
        Path("v"), "u", "m", tmp_path, tmp_path, 1, math.inf, None, 0, 1.0, 1.0, tmp_path
    )
    assert inf[inf.index("--request-rate") + 1] == "inf" and "--max-concurrency" not in inf


def test_the_result_lands_under_bench_serves_keys():
    summary = summary_from_result(RESULT, requests=8)
    ours = summarize([], 1.0, 2000.0, 200.0)
    assert set(summary) - {"client"} == set(ours)
    assert summary["completed"] == 7 and summary["failed"] == 1
    assert summary["mean_output_tokens"] == 20.0 and summary["mean_prompt_tokens"] == 100.0
    assert summary["ttft_ms"] == {"mean": 10.0, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert summary["e2e_ms"] == {"mean": 900.0, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert summary["goodput_rps"] == 0.4 and summary["slo_attainment"] == 0.625  # 5 of 8
    assert summary["client"].startswith("vllm bench serve")


def test_vllm_as_client_refuses_the_peer_options(capsys):
    assert serve.main(["--client", "vllm", "--vs-vllm"]) == 2
    assert "--client vllm" in capsys.readouterr().err
