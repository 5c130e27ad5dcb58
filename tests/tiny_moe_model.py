"""Tiny random-weight mixture-of-experts models (mixtral, qwen3_moe) with the tiny tokenizer.

Shapes keep the real models' ratios at a hidden size of 64: Mixtral-8x7B (8 experts, 2
active, expert intermediate 3.5x hidden, 4 query heads per KV head) and Qwen3-30B-A3B
(expert intermediate 0.375x hidden, dense intermediate 3x hidden, q width 2x hidden, 8
query heads per KV head, 16 experts per active one; the tiny one has 64 experts, 4
active), plus one Qwen3-MoE layer kept dense through `mlp_only_layers`. Seeded; nothing
comes from elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_model import build_tokenizer

WEIGHT_STD = 0.15  # as tests/tiny_model.py: spreads logits so greedy choices are clear


def tiny_moe_config(
    arch: str, vocab_size: int = 512, layers: int = 3, max_positions: int = 512, **overrides
):
    """A transformers config of `arch` ("mixtral" or "qwen3_moe") at the tiny shape;
    overrides: config keys to set on top."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=layers,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":
        family = dict(
            intermediate_size=224,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        )
        return MixtralConfig(**common, **(family | overrides))
    if arch == "qwen3_moe":
        family = dict(
            intermediate_size=192,
            moe_intermediate_size=24,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=64,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            mlp_only_layers=[1] if layers > 1 else [],
            decoder_sparse_step=1,
        )
        return Qwen3MoeConfig(**common, **(family | overrides))
    raise ValueError(f"no tiny MoE config for {arch!r}")


def tiny_moe_hf(arch: str, seed: int = 0, **config):
    """A random transformers MoE model of `arch`, eval mode, every matrix drawn wide."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(arch, **config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # the stacked experts are [E, out, in]
                p.normal_(0, WEIGHT_STD)
    return model


def make_tiny_moe_dir(
    out: Path, arch: str, seed: int = 0, layers: int = 3, tokenizer=None, max_positions: int = 512
) -> Path:
    """Write config.json + safetensors + tokenizer files of a random tiny MoE model, with
    `tokenizer` (default: the test tokenizer)."""
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    model = tiny_moe_hf(arch, seed, vocab_size=len(tok), layers=layers, max_positions=max_positions)
    model.config.eos_token_id = tok.eos_token_id
    model.config.bos_token_id = tok.bos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
