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


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
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
