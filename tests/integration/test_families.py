"""Every served model family and rope variant against transformers' own implementation.

One tiny random-weight model per family (tests/tiny_model.py: the real smallest model's
ratios of heads, KV heads, head dim, window pattern and multipliers), saved with
save_pretrained and loaded by the engine's loader. fp32 logits of every generated step
are held to transformers' generate (rtol 1e-4, atol 1e-5 * max|logit|) through chunked
prefill, preemption and a prefix-cache hit, and the 48 greedy tokens must be identical.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from tests.tiny_model import make_family_dir
from wattserve.bench.quant import sequence_logits
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import load_model
from wattserve.daemon.engine.model import LayerWeights, LevelWeights, model_shape
from wattserve.daemon.engine.request import SamplingParams
from wattserve.kernels.int_linear import int_linear_available
from wattserve.kernels.linear import Linear

NEW_TOKENS = 48
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Prompt lengths per family: 300 only where a long context changes something (a window,
# a length-dependent rope, a table read far out); 250 + 48 crosses phi3's original 256
# during decode, 250 < 256 < 300 does the same for dynamic NTK's 256.
PROMPTS = {
    "qwen3": (1, 17, 300),
    "phi3": (1, 17, 250, 300),
    "olmo2": (1, 17),
    "granite": (1, 17),
    "gemma2": (1, 17, 300),
    "gemma3": (1, 17, 300),
    "llama-llama3": (17, 300),
    "llama-linear": (17, 300),
    "llama-yarn": (17, 300),
    "llama-dynamic": (17, 250, 300),
}
FAMILIES = ("qwen3", "phi3", "olmo2", "granite", "gemma2", "gemma3")
BF16_AGREEMENT = 0.95
# The issue asks 2e-2 of max|logit| against transformers in bf16; on these random 2-layer
# models (weights at std 0.15) olmo2, granite and gemma2/3 stay inside it, qwen3 measured
# 0.030 and phi3 0.046 (two bf16 implementations rounding at different points). The
# bound held is the repo's bf16 rounding bound of test_quant_engine. Against the fp32
# truth, transformers' own bf16 is 0.027 (qwen3) and 0.043 (phi3) away and ours 0.020 and
# 0.042: the 2e-2 is below bf16's own error on these weights. What is held besides: ours
# is no further from fp32 than transformers' bf16 is (with a quarter's slack).
BF16_LOGIT_BOUND = 0.05
BF16_VS_HF_ERROR = 1.25
# The bounds of tests/integration/test_quant_engine.py, for the same reason.
BF16_ROUNDING = 0.05
INT8_ACTIVATION_ROUNDING = 0.10


@pytest.fixture(scope="module")
def family_models(tmp_path_factory, cache_dir):
    """Loaded lazily, once per family for the module."""
    root = tmp_path_factory.mktemp("families")
    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load_model(str(make_family_dir(root / family, family)), cache_dir)
        return loaded[family]

    return get


def prompts_of(family: str, vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPTS[family]]


def reset_rope_state(hf_model) -> None:
    """transformers keeps a dynamic rope's grown base across calls; each prompt here is
    a fresh sequence, as in the engine."""
    rot = hf_model.model.rotary_emb
    if hasattr(rot, "max_seq_len_cached") and hasattr(rot, "original_inv_freq"):
        rot.inv_freq = rot.original_inv_freq.clone()
        rot.max_seq_len_cached = rot.original_max_seq_len


def hf_steps(hf_model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits of each step, [NEW_TOKENS, vocab]."""
    reset_rope_state(hf_model)
    rope = getattr(hf_model.config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        return longrope_steps(hf_model, prompt)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            # The engine's ignore_eos neither stops at EOS nor bans it (min_new_tokens would
            # ban it): an id outside the vocabulary is an EOS that never comes.
            eos_token_id=hf_model.config.vocab_size + 1,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def longrope_steps(hf_model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """hf_steps for longrope, each step a forward of the whole sequence without a cache:
    what Phi-3's generate computes when it recomputes the KV of a sequence that outgrows
    the original context (transformers 5.25; 5.17's generate keeps the short-factor
    cache there, 8.5 off on these weights)."""
    ids, rows = list(prompt), []
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            rows.append(hf_model(torch.tensor([ids])).logits[0, -1].float())
            ids.append(int(rows[-1].argmax()))
    return ids[len(prompt) :], torch.stack(rows)


def recording_logits(engine: Engine) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Every sampled row's logits, per prompt, in step order."""
    seen: dict[tuple[int, ...], list[torch.Tensor]] = {}
    real = engine.model.forward

    def forward(inputs):
        logits = real(inputs)
        for row, chunk in enumerate(inputs.sampled_chunks):
            seen.setdefault(tuple(chunk.seq.prompt_token_ids), []).append(logits[row].clone())
        return logits

    engine.model.forward = forward
    return seen


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


def block_bytes(lm, block_size: int = 16) -> int:
    shape = model_shape(lm.hf_model.config)
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * 4


@pytest.mark.parametrize("family", list(PROMPTS))
def test_fp32_logits_and_greedy_tokens_match_transformers(family, family_models):
    lm = family_models(family)
    prompts = prompts_of(family, len(lm.tokenizer))
    expected = [hf_steps(lm.hf_model, p) for p in prompts]
    # 64 tokens a step: the long prompts prefill in chunks. The pool holds the longest
    # sequence (348 tokens, 22 blocks) and little more: the others get preempted.
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    blocks = -(-longest // 16) + 2
    engine = Engine(
        lm,
        EngineOptions(
            kv_cache_bytes=blocks * block_bytes(lm), max_num_seqs=8, max_num_batched_tokens=64
        ),
        device="cpu",
    )
    seen = recording_logits(engine)
    outs = engine.generate(prompts, GREEDY)
    for prompt, out, (tokens, ref) in zip(prompts, outs, expected, strict=True):
        assert_logits_close(torch.stack(seen[tuple(prompt)]), ref)
        assert out.token_ids == tokens, f"{family}: {len(prompt)}-token prompt"
    if len(prompts) > 2:
        assert engine.counters.preemptions > 0
    # Again, the longest prompt alone: its prefix comes from the cache.
    seen.clear()
    hits = engine.counters.prefix_cache_hit_tokens
    again = engine.generate([prompts[-1]], GREEDY)[0]
    assert engine.counters.prefix_cache_hit_tokens > hits
    assert again.token_ids == expected[-1][0]
    assert_logits_close(torch.stack(seen[tuple(prompts[-1])]), expected[-1][1])


def bf16_copy(lm):
    model = copy.deepcopy(lm.hf_model).to(torch.bfloat16)
    return dataclasses.replace(lm, hf_model=model, dtype=torch.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_greedy_agrees_with_transformers_bf16(family, family_models):
    fp32 = family_models(family)
    lm = bf16_copy(fp32)
    prompts = prompts_of(family, len(lm.tokenizer))[:2]  # 1 and 17 tokens: 96 steps
    engine = Engine(lm, EngineOptions(kv_cache_bytes=16 * block_bytes(lm)), device="cpu")
    seen = recording_logits(engine)
    agree, steps, worst, ours_vs_fp32, hf_vs_fp32 = 0, 0, 0.0, 0.0, 0.0
    for prompt, out in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        tokens = out.token_ids
        ours = torch.stack(seen[tuple(prompt)])
        # transformers in bf16 (and fp32) over the engine's own path: its choice at each step.
        rows = slice(len(prompt) - 1, len(prompt) - 1 + NEW_TOKENS)
        with torch.inference_mode():
            ids = torch.tensor([prompt + tokens])
            ref = lm.hf_model(ids).logits[0].float()[rows]
            truth = fp32.hf_model(ids).logits[0][rows]
        agree += (ref.argmax(-1) == torch.tensor(tokens)).sum().item()
        steps += len(tokens)
        worst = max(worst, ((ours - ref).abs().max() / ref.abs().max()).item())
        scale = truth.abs().max()
        ours_vs_fp32 = max(ours_vs_fp32, ((ours - truth).abs().max() / scale).item())
        hf_vs_fp32 = max(hf_vs_fp32, ((ref - truth).abs().max() / scale).item())
    assert agree / steps >= BF16_AGREEMENT
    assert worst <= BF16_LOGIT_BOUND, f"bf16 logits {worst:.3f} of max|logit| from HF bf16"
    assert ours_vs_fp32 <= BF16_VS_HF_ERROR * hf_vs_fp32, (ours_vs_fp32, hf_vs_fp32)


def dequantized(weights: LevelWeights) -> LevelWeights:
    """The same level with every linear replaced by its dequantized float32 weights."""

    def dq(lin):
        return Linear(lin.dequantize().float())

    layers = [
        dataclasses.replace(
            lw,
            qkv=dq(lw.qkv),
            o=dq(lw.o),
            mlp=dataclasses.replace(lw.mlp, gate_up=dq(lw.mlp.gate_up), down=dq(lw.mlp.down)),
        )
        for lw in weights.layers
    ]
    assert all(isinstance(lw, LayerWeights) for lw in layers)
    return LevelWeights("dequantized", layers, dq(weights.lm_head), 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_and_int4_levels_stay_within_the_quantization_bounds(family, family_models):
    lm = family_models(family)
    engine = Engine(
        lm,
        EngineOptions(
            kv_cache_bytes=32 * block_bytes(lm), quantization_levels=("fp32", "int8", "int4")
        ),
        device="cpu",
    )
    model = engine.model
    ids = prompts_of(family, len(lm.tokenizer))[1]
    fp32 = sequence_logits(model, ids)
    bound = INT8_ACTIVATION_ROUNDING if int_linear_available() else BF16_ROUNDING
    for level in ("int8", "int4"):
        weights = model.prepare_level(level)
        model.use_level(level)
        ours = sequence_logits(model, ids)
        model._active = dequantized(weights)  # the level's weights, float32 arithmetic
        ref = sequence_logits(model, ids)
        model.use_level("fp32")
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert err < bound, level
        assert ((ours - fp32).abs().max() / fp32.abs().max()).item() > 1e-3, level
