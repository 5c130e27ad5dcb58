"""Tiny random-weight Llama-family models with a small byte-level BPE tokenizer, built in tests.

Everything is generated with a fixed seed: no text or weights come from elsewhere.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def synthetic_corpus(seed: int = 0, lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 7))) for _ in range(300)]
    words += ["café", "naïve", "日本語", "€uro", "ünïcödé"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(lines)]


def build_tokenizer(vocab_size: int = 512, extra_special: tuple[str, ...] = ()):
    """The byte-level BPE test tokenizer; extra_special: more special tokens (a family's
    turn markers), trained into the same vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model_dir(
    out: Path, arch: str = "llama", seed: int = 0, layers: int = 2, max_positions: int = 512
) -> Path:
    """Write config.json + model.safetensors + tokenizer files of a random tiny model."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tok = build_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    }
    cfg_cls, model_cls, extra = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**common, **extra)).eval()
    # Larger-than-default init spreads the logits so greedy argmax has clear winners.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_hf_llama(weight_std: float | None = None):
    """A 2-layer random transformers Llama of vocab 96, in memory, no tokenizer (seed 0).

    weight_std: redraw every matrix with this std (spreads the logits so greedy argmax has
    clear winners); None keeps transformers' own init.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    if weight_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, weight_std)
    return model


# Per family: (config class name, model class name, config keys) with the real smallest
# model's ratios of heads, KV heads, head dim, MLP width, tying and multipliers, scaled
# down to a hidden size of 64-96 (each one's source is in the comment).
FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    # Qwen3-0.6B: 16 heads, 8 KV heads, head_dim 128 = 2 x hidden/heads, MLP 3x, tied.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             intermediate_size=192, tie_word_embeddings=True, rope_theta=1e6),
    ),
    # Phi-4-mini: 24 heads, 8 KV heads, partial rotary 0.75, longrope (4096 -> 131072), tied.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
             intermediate_size=256, tie_word_embeddings=True, partial_rotary_factor=0.75,
             max_position_embeddings=1024, original_max_position_embeddings=256,
             rope_scaling={"rope_type": "longrope",
                           "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                           "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}),
    ),
    # OLMo-2-0425-1B: 16 heads, 16 KV heads, MLP 4x, untied.
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=256, tie_word_embeddings=False),
    ),
    # granite-3.3-2b: 32 heads, 8 KV heads, MLP 4x, tied; embedding x12, residual x0.22,
    # attention_multiplier 1/head_dim, logits / 8.
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=256, tie_word_embeddings=True, embedding_multiplier=12.0,
             residual_multiplier=0.22, attention_multiplier=0.125, logits_scaling=8.0),
    ),
}
# Rope variants on a Llama body (Llama 3.1's llama3, and the linear, yarn, dynamic kinds).
ROPE_VARIANTS: dict[str, dict] = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def make_family_dir(
    out: Path,
    family: str,
    seed: int = 0,
    layers: int = 2,
    weight_std: float = 0.15,
    tokenizer=None,
    **extra,
) -> Path:
    """A random model of `family` (a FAMILY_CONFIGS key, or "llama-<rope variant>") saved
    with save_pretrained, with `tokenizer` (default: the test tokenizer); extra: config
    keys to override."""
    import transformers

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    if family.startswith("llama-"):
        cfg_name, model_name = "LlamaConfig", "LlamaForCausalLM"
        variant = ROPE_VARIANTS[family.removeprefix("llama-")]
        keys = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, rope_scaling=dict(variant, rope_theta=10000.0))
        # dynamic NTK stretches past max_position_embeddings: 300 tokens cross 256.
        keys["max_position_embeddings"] = 256 if variant["rope_type"] == "dynamic" else 512
    else:
        cfg_name, model_name, keys = FAMILY_CONFIGS[family]
        keys = dict(keys)
    keys.setdefault("max_position_embeddings", 512)
    keys.update(extra)
    cfg = getattr(transformers, cfg_name)(
        vocab_size=len(tok),
        num_hidden_layers=layers,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        **keys,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, weight_std)
            elif p.dim() == 1:  # norm weights: around their own init, not all equal
                p.add_(torch.randn_like(p) * 0.1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out

FAMILY_CONFIGS.update(
    {
        # gemma-2-2b: 8 heads, 4 KV heads, query_pre_attn_scalar = head_dim, local/global
        # alternating, soft-caps 50 (attention) and 30 (final), tied. Window 32 so that a
        # 300-token prompt crosses it.
        "gemma2": (
            "Gemma2Config",
            "Gemma2ForCausalLM",
            dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=256, query_pre_attn_scalar=16, sliding_window=32,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 tie_word_embeddings=True),
        ),
        # gemma-3-1b: 4 heads, 1 KV head, head_dim 256 (> hidden/heads), local rope base
        # 10k and global 1M, sliding and full layers, tied.
        "gemma3": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                 intermediate_size=384, query_pre_attn_scalar=32, sliding_window=32,
                 layer_types=["sliding_attention", "full_attention"],
                 tie_word_embeddings=True),
        ),
    }
)


def make_gemma3_vision_dir(out: Path, seed: int = 0, layers: int = 2) -> Path:
    """A random Gemma 3 checkpoint with a vision tower (`Gemma3ForConditionalGeneration`,
    as Gemma 3 4B-27B ship): the gemma3 text config above nested under `text_config`, a
    one-layer SigLIP tower of 28x28 images, saved with save_pretrained."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tok = build_tokenizer()
    keys = dict(FAMILY_CONFIGS["gemma3"][2], max_position_embeddings=512)
    text = Gemma3TextConfig(
        vocab_size=len(tok),
        num_hidden_layers=layers,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        **keys,
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=len(tok) - 3,
        eoi_token_index=len(tok) - 2,
        image_token_index=len(tok) - 1,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
