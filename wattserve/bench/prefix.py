"""`wattserve bench prefix`: a shared system prompt, with and without prefix caching.

One process, one run: the same requests through this engine twice (fresh engine each
time, same weights, dtype, threads, KV pool and batch caps), once with
`enable_prefix_caching` off and once on; with --rounds N the two alternate N times and
the medians are reported. Each request is one system prompt (~1,000 tokens by default,
a window of the licence text that the Python installation ships) followed by its own
user suffix; all arrive at once, greedy, `ignore_eos`. Reported per mode: TTFT p50/p99
(arrival to first token) and output tokens per second over the whole run. The last line
printed is one JSON object. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from wattserve.bench.engine import corpus_token_ids, corpus_window
from wattserve.daemon.config import default_cache_dir
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import LoadedModel, load_model
from wattserve.daemon.engine.request import RequestOutput, SamplingParams


def make_workload(
    tokenizer, n: int, system_tokens: int, min_suffix: int, max_suffix: int, seed: int
) -> list[list[int]]:
    """n prompts: one shared system prompt, then each request's own suffix."""
    rng = random.Random(seed)
    ids = corpus_token_ids(tokenizer, (system_tokens + max_suffix) * 4)
    system = corpus_window(ids, system_tokens, rng)
    return [system + corpus_window(ids, rng.randint(min_suffix, max_suffix), rng) for _ in range(n)]


def run_once(
    loaded: LoadedModel, options: EngineOptions, prompts: list[list[int]], new_tokens: int
) -> dict[str, float]:
    """All prompts at once through a fresh engine; TTFTs and output tok/s."""
    engine = Engine(loaded, options)
    # Warm-up on tokens no prompt starts with: nothing of the workload gets cached.
    engine.generate([[1] * 24], SamplingParams(max_tokens=4, temperature=0.0))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    first_s: dict[str, float] = {}
    produced = 0
    computed = 0

    def count(stats) -> None:
        nonlocal computed
        computed += stats.prefill_tokens + stats.decode_tokens

    engine.add_step_hook(count)

    def sink(out: RequestOutput) -> None:
        nonlocal produced
        if out.token_ids:
            produced += len(out.token_ids)
            first_s.setdefault(out.request_id, time.perf_counter())

    t0 = time.perf_counter()
    rids = [engine.add_request(p, params, sink) for p in prompts]
    while engine.has_work():
        engine.step()
    dt = time.perf_counter() - t0
    ttfts_ms = sorted((first_s[r] - t0) * 1000.0 for r in rids)
    c = engine.counters
    result = {
        "ttft_p50_ms": statistics.median(ttfts_ms),
        "ttft_p99_ms": ttfts_ms[min(len(ttfts_ms) - 1, round(0.99 * (len(ttfts_ms) - 1)))],
        "tok_s": produced / dt,
        "seconds": dt,
        "hit_ratio": (c.prefix_cache_hit_ratio or 0.0) if options.enable_prefix_caching else 0.0,
        "tokens_computed": computed,
    }
    del engine
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench prefix", description=__doc__)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--min-suffix", type=int, default=16)
    ap.add_argument("--max-suffix", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-mib", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1, help="alternate off/on this many times")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, default_cache_dir(), args.dtype)
    prompts = make_workload(
        loaded.tokenizer,
        args.requests,
        args.system_tokens,
        args.min_suffix,
        args.max_suffix,
        args.seed,
    )
    print(
        f"workload: {args.requests} requests at once, a {args.system_tokens}-token shared "
        f"system prompt + {args.min_suffix}-{args.max_suffix} own tokens (total "
        f"{sum(map(len, prompts))}), {args.new_tokens} new tokens each, greedy, {args.dtype}, "
        f"{torch.get_num_threads()} threads, max_num_seqs {args.max_num_seqs}, "
        f"{args.max_num_batched_tokens} tokens a step",
        flush=True,
    )
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for r in range(args.rounds):
        for caching in (False, True) if r % 2 == 0 else (True, False):
            options = EngineOptions(
                kv_cache_bytes=args.kv_cache_mib << 20,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=caching,
            )
            res = run_once(loaded, options, prompts, args.new_tokens)
            runs[caching].append(res)
            print(
                f"round {r + 1}, prefix caching {'on ' if caching else 'off'}: TTFT p50 "
                f"{res['ttft_p50_ms']:.0f} ms, p99 {res['ttft_p99_ms']:.0f} ms; "
                f"{res['tok_s']:.1f} output tok/s ({res['seconds']:.1f} s); "
                f"{res['tokens_computed']} tokens computed, prefix hit ratio "
                f"{res['hit_ratio']:.3f}",
                flush=True,
            )

    def med(caching: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[caching])

    line = {
        "ttft_p50_ms_cache": round(med(True, "ttft_p50_ms"), 1),
        "ttft_p50_ms_no_cache": round(med(False, "ttft_p50_ms"), 1),
        "ttft_p50_speedup": round(med(False, "ttft_p50_ms") / med(True, "ttft_p50_ms"), 2),
        "ttft_p99_ms_cache": round(med(True, "ttft_p99_ms"), 1),
        "ttft_p99_ms_no_cache": round(med(False, "ttft_p99_ms"), 1),
        "tok_s_cache": round(med(True, "tok_s"), 2),
        "tok_s_no_cache": round(med(False, "tok_s"), 2),
        "throughput_ratio": round(med(True, "tok_s") / med(False, "tok_s"), 2),
        "prefix_hit_ratio": round(med(True, "hit_ratio"), 3),
        "requests": args.requests,
        "system_prompt_tokens": args.system_tokens,
        "suffix_tokens": [args.min_suffix, args.max_suffix],
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "model": loaded.name,
    }
    print(
        f"with the cache: TTFT p50 {line['ttft_p50_speedup']}x lower, throughput "
        f"{line['throughput_ratio']}x"
    )
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
