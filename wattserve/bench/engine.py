"""`wattserve bench engine`: this engine against transformers on one offline workload.

One process, one run, the same requests through each system in turn: (a) this engine,
(b) HF `generate` in static batches of 16 with left padding, (c) transformers' own
continuous batching (`generate_batch`); then single-stream decode for (a) and HF.
All systems use the same weights, dtype and thread count. The last line printed is
one JSON object. Prompts are windows of text that the Python installation ships
(its licence file), tokenized; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import sysconfig
import time
from pathlib import Path

import torch

from wattserve.daemon.config import default_cache_dir
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import load_model
from wattserve.daemon.engine.request import RequestOutput, SamplingParams

HF_STATIC_BATCH = 16


def corpus_token_ids(tokenizer, min_tokens: int) -> list[int]:
    """Tokens of a text file shipped with Python, repeated up to min_tokens."""
    candidates = [
        Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",
        Path(sys.base_prefix) / "LICENSE.txt",
    ]
    text = next((p.read_text(errors="replace") for p in candidates if p.is_file()), "")
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    if len(ids) < 64:  # no licence file on this Python: seeded random ids instead
        rng = random.Random(1234)
        ids = [rng.randrange(100, len(tokenizer)) for _ in range(min_tokens)]
    while len(ids) < min_tokens:
        ids = ids + ids
    return ids


def corpus_window(ids: list[int], length: int, rng: random.Random) -> list[int]:
    """`length` consecutive corpus tokens from a random start."""
    start = rng.randrange(0, len(ids) - length)
    return ids[start : start + length]


def make_workload(tokenizer, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = corpus_token_ids(tokenizer, max_len * 4)
    return [corpus_window(ids, rng.randint(min_len, max_len), rng) for _ in range(n)]


def run_ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, sum(o.completion_tokens for o in outs)


def run_hf_static(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    produced = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), HF_STATIC_BATCH):
        batch = prompts[i : i + HF_STATIC_BATCH]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        produced += (out.shape[1] - width) * len(batch)
    return time.perf_counter() - t0, produced


def run_hf_cb(
    model,
    prompts: list[list[int]],
    new_tokens: int,
    cb_config=None,
    persistent_manager: bool = False,
) -> tuple[float, int]:
    """transformers' continuous batching (`generate_batch`); cb_config: its
    ContinuousBatchingConfig (None: its defaults); persistent_manager: keep the manager on
    the model, so that a second call with the same workload skips its set-up."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id or 0,
    )
    t0 = time.perf_counter()
    # no_grad, not inference_mode: transformers before 5.18 (5.17 on the GPU image) runs
    # the batch loop on a thread outside inference mode, where updating the static
    # tensors made under it fails; generate_batch itself is no_grad in every 5.x.
    with torch.no_grad():
        results = model.generate_batch(
            inputs=prompts,
            generation_config=cfg,
            continuous_batching_config=cb_config,
            persistent_manager=persistent_manager,
        )
    dt = time.perf_counter() - t0
    return dt, sum(len(r.generated_tokens) for r in results.values())


def single_stream_ours(engine: Engine, prompt: list[int], new_tokens: int) -> float:
    """Decode tok/s of one request: tokens after the first over the time they took."""
    stamps: list[float] = []

    def sink(out: RequestOutput) -> None:
        if out.token_ids:
            stamps.append(time.perf_counter())

    engine.add_request(
        prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), sink
    )
    while engine.has_work():
        engine.step()
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def single_stream_hf(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    first = timed(1)
    return (new_tokens - 1) / (timed(new_tokens) - first)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench engine", description=__doc__)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="16 requests x 32 tokens")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip", action="append", default=[], choices=["hf_static", "hf_cb"])
    args = ap.parse_args(argv)
    n = args.requests or (16 if args.quick else 64)
    new_tokens = args.new_tokens or (32 if args.quick else 128)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, default_cache_dir(), args.dtype)
    model, tok = loaded.hf_model, loaded.tokenizer
    prompts = make_workload(tok, n, args.min_prompt, args.max_prompt, args.seed)
    engine = Engine(
        loaded,
        EngineOptions(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
    )
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    print(
        f"workload: {n} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
        f"(total {sum(map(len, prompts))}), {new_tokens} new tokens each, greedy, "
        f"{args.dtype}, {torch.get_num_threads()} threads",
        flush=True,
    )

    results: dict[str, float | None] = {}
    dt, produced = run_ours(engine, prompts, new_tokens)
    results["ours_tok_s"] = produced / dt
    print(
        f"(a) wattserve engine: {produced} tokens in {dt:.1f} s = {produced / dt:.1f} tok/s",
        flush=True,
    )
    if "hf_static" not in args.skip:
        dt, produced = run_hf_static(model, tok, prompts, new_tokens)
        results["hf_static_tok_s"] = produced / dt
        print(
            f"(b) HF generate, static batches of {HF_STATIC_BATCH}: {produced} tokens in "
            f"{dt:.1f} s = {produced / dt:.1f} tok/s",
            flush=True,
        )
    if "hf_cb" not in args.skip:
        dt, produced = run_hf_cb(model, prompts, new_tokens)
        results["hf_cb_tok_s"] = produced / dt
        print(
            f"(c) transformers generate_batch: {produced} tokens in {dt:.1f} s = "
            f"{produced / dt:.1f} tok/s",
            flush=True,
        )

    probe = prompts[0][:32]
    ours_single = single_stream_ours(engine, probe, new_tokens)
    hf_single = single_stream_hf(model, probe, new_tokens)
    print(f"single-stream decode: wattserve {ours_single:.1f} tok/s, HF {hf_single:.1f} tok/s")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def ratio(key: str) -> float | None:
        other = results.get(key)
        return round(results["ours_tok_s"] / other, 3) if other else None

    line = {
        "ours_tok_s": round(results["ours_tok_s"], 2),
        "hf_static_tok_s": _round(results.get("hf_static_tok_s")),
        "hf_cb_tok_s": _round(results.get("hf_cb_tok_s")),
        "ratio_vs_hf_static": ratio("hf_static_tok_s"),
        "ratio_vs_hf_cb": ratio("hf_cb_tok_s"),
        "single_stream_tok_s": round(ours_single, 2),
        "hf_single_stream_tok_s": round(hf_single, 2),
        "peak_rss_mb": round(peak_rss_mb, 1),
        "requests": n,
        "new_tokens": new_tokens,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "model": loaded.name,
    }
    print(
        f"ratios: vs HF static {line['ratio_vs_hf_static']}, vs HF CB {line['ratio_vs_hf_cb']}; "
        f"peak RSS {peak_rss_mb:.0f} MB"
    )
    print(json.dumps(line))
    return 0


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


if __name__ == "__main__":
    raise SystemExit(main())
