"""`wattserve bench models`: each served family's speed and fidelity against transformers.

Per family: a random-weight model with the real smallest model's layer shapes and
vocabulary (Qwen3-0.6B, Phi-4-mini, OLMo-2-0425-1B, granite-3.3-2b, gemma-2-2b,
gemma-3-1b) and 2-4 layers, in float32 on the CPU, the same torch threads on both sides.
The engine's model (prepare/forward over its paged KV cache, one sequence, greedy) is
timed against transformers' generate on the same weights: prefill tok/s of one prompt and
single-stream decode tok/s; the greedy tokens must be identical and the largest logit
error is reported relative to max|logit|. A decode step reads every weight once, so the
engine's decode is bounded by memory bandwidth: each family also reports the weight bytes
a step reads times its decode rate (`decode_weight_gb_s`) and what this machine read just
before (`machine_read_gb_s`, a sum over 512 MiB on the same threads; on a shared host it
moves from run to run, and the ratio with it: transformers' own GEMV reads at about 20
GB/s here and hardly moves). The last line printed is one JSON object with `families`.
Nothing is downloaded; this module's top level imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# The real smallest model's layer shapes and vocabulary, per family.
FAMILY_SHAPES: dict[str, tuple[str, str, dict]] = {
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",  # Qwen3-0.6B
        dict(
            hidden_size=1024,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",  # Phi-4-mini-instruct (longrope 4096 -> 131072)
        dict(
            hidden_size=3072,
            num_attention_heads=24,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=200064,
            tie_word_embeddings=True,
            partial_rotary_factor=0.75,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0] * 48,
                "long_factor": [1.0 + i / 8 for i in range(48)],
            },
        ),
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",  # OLMo-2-0425-1B
        dict(
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=16,
            intermediate_size=8192,
            vocab_size=100352,
            max_position_embeddings=4096,
        ),
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",  # granite-3.3-2b-instruct
        dict(
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=49159,
            tie_word_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
            max_position_embeddings=131072,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",  # gemma-2-2b
        dict(
            hidden_size=2304,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            intermediate_size=9216,
            vocab_size=256000,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            max_position_embeddings=8192,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",  # gemma-3-1b-it
        dict(
            hidden_size=1152,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=6912,
            vocab_size=262144,
            query_pre_attn_scalar=256,
            sliding_window=512,
            max_position_embeddings=32768,
        ),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wattserve bench models", description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILY_SHAPES), help="comma-separated")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (2-4)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    p.add_argument("--seed", type=int, default=0)
    return p


def build_model(family: str, layers: int, seed: int):
    """A random-weight transformers model of the family's real layer shapes."""
    import torch
    import transformers

    cfg_name, model_name, keys = FAMILY_SHAPES[family]
    cfg = getattr(transformers, cfg_name)(num_hidden_layers=layers, **keys)
    if family == "gemma3":
        cfg.layer_types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(cfg).eval()


def engine_run(model, prompt: list[int], new_tokens: int):
    """Greedy tokens, per-step logits, prefill seconds and decode seconds per token."""
    import torch

    from wattserve.daemon.engine.scheduler import ScheduledChunk, Sequence

    seq = Sequence("bench", list(prompt))
    bs = model.block_size
    table = list(range(-(-(len(prompt) + new_tokens) // bs)))
    logits_seen = []
    t0 = time.perf_counter()
    chunk = ScheduledChunk(seq, 0, len(prompt), True)
    logits = model.forward(model.prepare([chunk], {"bench": table}))
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        logits_seen.append(logits[0])
        seq.output_token_ids.append(int(torch.argmax(logits[0])))
        chunk = ScheduledChunk(seq, seq.num_tokens - 1, 1, True)
        logits = model.forward(model.prepare([chunk], {"bench": table}))
    logits_seen.append(logits[0])
    seq.output_token_ids.append(int(torch.argmax(logits[0])))
    t2 = time.perf_counter()
    return seq.output_token_ids, torch.stack(logits_seen), t1 - t0, (t2 - t1) / (new_tokens - 1)


def hf_run(hf_model, prompt: list[int], new_tokens: int):
    """transformers' generate: greedy tokens, per-step logits, prefill s, decode s/token."""
    import torch

    ids = torch.tensor([prompt])
    # An id outside the vocabulary as EOS: never stops early, bans nothing (as the
    # engine's greedy loop here; min_new_tokens would ban the real EOS).
    vocab = hf_model.config.get_text_config().vocab_size
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=vocab + 1)
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf_model.generate(ids, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = hf_model.generate(
            ids,
            max_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
        t2 = time.perf_counter()
    prefill = t1 - t0
    decode = (t2 - t1 - prefill) / (new_tokens - 1)
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits).float(), prefill, decode


def machine_read_gb_s() -> float:
    """GB/s a float32 sum over 512 MiB reads on torch's threads (best of three)."""
    import torch

    x = torch.ones(128 * 2**20)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def bench_family(family: str, args) -> dict:
    import random

    import torch

    from wattserve.daemon.engine.model import LlamaModel

    hf = build_model(family, args.layers, args.seed)
    vocab = hf.config.get_text_config().vocab_size
    rng = random.Random(args.seed)
    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
    blocks = -(-(args.prompt_tokens + args.new_tokens) // 16) + 1
    model = LlamaModel(hf, blocks, 16, torch.float32, "cpu")
    engine_run(model, prompt[:8], 3)  # warm: kernels loaded, first-call allocations done
    read_gb_s = machine_read_gb_s()
    ours, our_logits, our_prefill_s, our_decode_s = engine_run(model, prompt, args.new_tokens)
    theirs, hf_logits, hf_prefill_s, hf_decode_s = hf_run(hf, prompt, args.new_tokens)
    err = ((our_logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
    # what a decode step reads: weight_bytes() less an embedding table of its own (a step
    # reads one row of it)
    step_bytes = model.weight_bytes() - (
        0 if model.tied_embeddings else model.embed.numel() * model.embed.element_size()
    )
    return {
        "layers": args.layers,
        "vocab": vocab,
        "prefill_tok_s": round(args.prompt_tokens / our_prefill_s, 1),
        "hf_prefill_tok_s": round(args.prompt_tokens / hf_prefill_s, 1),
        "decode_tok_s": round(1 / our_decode_s, 2),
        "hf_decode_tok_s": round(1 / hf_decode_s, 2),
        "ratio_vs_hf": round(hf_decode_s / our_decode_s, 2),
        "prefill_ratio_vs_hf": round(hf_prefill_s / our_prefill_s, 2),
        "decode_weight_gb_s": round(step_bytes / our_decode_s / 1e9, 1),
        "machine_read_gb_s": round(read_gb_s, 1),
        "greedy_identical": ours == theirs,
        "max_logit_rel_err": float(f"{err:.3g}"),
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    from wattserve.daemon.engine.loader import _quiet_transformers

    args = build_parser().parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILY_SHAPES]
    if unknown or not 2 <= args.layers <= 4 or args.new_tokens < 2:
        print(
            f"wattserve bench models: error: unknown families {unknown}"
            if unknown
            else "wattserve bench models: error: --layers 2-4 and --new-tokens >= 2",
            file=sys.stderr,
        )
        return 2
    _quiet_transformers()
    torch.set_num_threads(args.threads)
    results = {}
    for family in families:
        results[family] = bench_family(family, args)
        print(family, json.dumps(results[family]), flush=True)
    print(json.dumps({"threads": args.threads, "dtype": "float32", "families": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
