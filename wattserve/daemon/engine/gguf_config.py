"""The transformers config of a GGUF file, with the keys transformers' GGUF reader drops.

transformers builds a config from a GGUF's metadata through its own key table, which
misses keys some families need: Qwen3's head dim (`attention.key_length`, not
hidden / heads in Qwen3), Gemma's attention scale and soft-caps. This module reads the
file's metadata with the `gguf` package, fills those keys in, and refuses, in one line
naming the architecture, a GGUF whose layout the conversion would get wrong (Phi-3's
longrope factors, Mixtral's experts under the `llama` architecture). It reads metadata
only: the weights are loaded and dequantised by transformers (loader.py).
"""

from __future__ import annotations

from pathlib import Path

# GGUF architectures (llama.cpp's names) the engine takes, and their model_type.
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
}
# llama.cpp infers Gemma's attention scale from the model's size: 1/sqrt(head_dim), but
# 1/sqrt(hidden / heads) for the 27B models, which it recognises by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46}


class GGUFConfigError(ValueError):
    """A GGUF the engine cannot serve; the message names the architecture or key."""


def read_metadata(path: Path) -> tuple[dict, list[str]]:
    """The GGUF's key/value metadata (tokenizer arrays left out) and its tensor names."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith(("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
        and not key.startswith(("tokenizer.ggml.token_type", "tokenizer.ggml.scores"))
    }
    return meta, [t.name for t in reader.tensors]


def check_gguf(meta: dict, tensors: list[str]) -> str:
    """The architecture of a GGUF the engine serves; GGUFConfigError otherwise."""
    arch = meta.get("general.architecture")
    if arch == "llama" and meta.get("llama.expert_count", 0):
        raise GGUFConfigError(
            "GGUF architecture 'llama' with experts (Mixtral): not supported from GGUF, "
            "serve its Hugging Face directory"
        )
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFConfigError(
            f"GGUF architecture {arch!r} is not supported from GGUF "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)}; other families load from "
            "their Hugging Face directory)"
        )
    return arch


def complete_config(config, meta: dict) -> None:
    """Fill in, in place, the keys transformers' GGUF reader leaves at their defaults."""
    arch = meta["general.architecture"]
    key_length = meta.get(f"{arch}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length)
    if arch.startswith("gemma"):
        layers = config.num_hidden_layers
        if _GEMMA_27B_LAYERS.get(arch) == layers:
            config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
        else:
            config.query_pre_attn_scalar = config.head_dim
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = meta.get(f"{arch}.{key}")
            if value is not None:
                setattr(config, key, float(value))


def gguf_config(path: Path):
    """The completed transformers config of a GGUF file. Raises GGUFConfigError."""
    from transformers import AutoConfig

    meta, tensors = read_metadata(path)
    check_gguf(meta, tensors)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    complete_config(config, meta)
    return config
