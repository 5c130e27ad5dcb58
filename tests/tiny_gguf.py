"""Write a GGUF file from a random transformers model, as llama.cpp's converter lays one out.

Tensor names come from the `gguf` package's own name maps; the metadata keys are the
ones llama.cpp writes for the architecture (context length, widths, heads, key length,
epsilon, rope base, sliding window, soft-caps); Gemma's norm weights are stored as
(1 + w), as llama.cpp stores them. The tokenizer is the test tokenizer's byte-level BPE
(`tokenizer.ggml.model = gpt2`). Float32 tensors only: what is tested is the layout,
not a quantization format.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# transformers model_type -> the gguf package's architecture
GGUF_ARCH = {"qwen3": "QWEN3", "gemma2": "GEMMA2", "gemma3_text": "GEMMA3", "phi3": "PHI3"}


def write_gguf(hf_model, tokenizer, out: Path) -> Path:
    import gguf

    cfg = hf_model.config
    arch_enum = getattr(gguf.MODEL_ARCH, GGUF_ARCH[cfg.model_type])
    arch = gguf.MODEL_ARCH_NAMES[arch_enum]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{cfg.model_type}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # gemma3: per layer type
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    _add_tokenizer(w, tokenizer)
    gemma = cfg.model_type.startswith("gemma")
    names = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    for key, tensor in hf_model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"no GGUF name for {key}")
        data = tensor.detach().float().numpy()
        if gemma and key.endswith("norm.weight"):
            data = data + 1.0
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, tokenizer) -> None:
    """The byte-level BPE vocabulary, merges and special ids, in id order."""
    import gguf

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tokenizer.all_special_tokens)
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # Gemma's GGUF tokenizer reader (transformers <= 5.17) builds a Unigram model from
    # the scores that llama.cpp writes for SentencePiece vocabularies: one per token.
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
