"""What each served model family changes in the Llama forward, read from its config.

One `Family` per model: norm kind and placement, q/k norm, activation, multipliers,
soft-caps, the attention scale, per-layer windows and rope table names. `describe()`
builds it from a transformers config and refuses, in one line naming the key, what the
engine cannot run. `take_layer()` reads one layer's full-precision tensors under the
names its checkpoint uses (fused or not). This module holds no tensors of its own and
runs nothing: model.py does the forward from this description.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wattserve.daemon.engine.rope import RopeConfigError, check_rope

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "olmo2",
    "granite",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
)
# Families people ask for by name that the engine does not run, and why.
REFUSED_ARCHITECTURES = {
    "granitemoehybrid": "Granite 4's hybrid Mamba layers are not supported",
    "gpt_oss": "gpt-oss's attention sinks are not supported",
}

NORM_PLACEMENTS = ("pre", "post", "sandwich")


class FamilyConfigError(ValueError):
    """A config the engine cannot run; the message is one line naming the key."""


@dataclass(frozen=True)
class Family:
    """How one model differs from Llama. Defaults are Llama's."""

    name: str
    # "pre": norm before attention and MLP (Llama); "post": norm on their outputs before
    # the residual add, none on their inputs (OLMo 2); "sandwich": both (Gemma).
    placement: str = "pre"
    norm_one_plus: bool = False  # Gemma: weight (1 + w), computed in float32
    qk_norm: str | None = None  # "head": over each head (Qwen3, Gemma 3); "proj": whole q, k
    activation: str = "silu"  # or "gelu_tanh"
    embed_scale: float = 1.0  # Gemma sqrt(hidden), Granite embedding_multiplier
    residual_scale: float = 1.0  # Granite residual_multiplier on both branches
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    logits_scale: float = 1.0  # Granite: 1 / logits_scaling
    windows: tuple[int | None, ...] = ()  # per layer: sliding window in tokens, None = full
    layer_rope: tuple[str | None, ...] = ()  # per layer: its rope table's layer type
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj in the checkpoint

    @property
    def rope_types(self) -> tuple[str | None, ...]:
        return tuple(dict.fromkeys(self.layer_rope))


def text_config(hf_config):
    """The language model's config (Gemma 3's multimodal checkpoints nest it)."""
    return getattr(hf_config, "text_config", None) or hf_config


def check_architecture(model_type: str | None) -> None:
    if model_type in REFUSED_ARCHITECTURES:
        raise FamilyConfigError(f"model_type {model_type!r}: {REFUSED_ARCHITECTURES[model_type]}")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise FamilyConfigError(
            f"model_type: unsupported architecture {model_type!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def describe(hf_config, window_supported: bool = False) -> Family:
    """The family description of a transformers config. Raises FamilyConfigError.

    window_supported: whether the attention takes a sliding window; without it a window
    shorter than the context is refused rather than silently ignored."""
    check_architecture(hf_config.model_type)
    cfg = text_config(hf_config)
    kind = cfg.model_type
    layers = cfg.num_hidden_layers
    layer_types = tuple(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)
    window = getattr(cfg, "sliding_window", None)
    windows = tuple(
        window
        if (lt == "sliding_attention" or kind in ("mistral", "phi3", "mixtral", "qwen3_moe"))
        else None
        for lt in layer_types
    )
    max_len = cfg.max_position_embeddings
    if not window_supported and any(w is not None and w < max_len for w in windows):
        raise FamilyConfigError(
            f"sliding_window: a window of {window} tokens under a context of {max_len} "
            "needs windowed attention, which this engine's attention does not run yet"
        )
    per_type_rope = kind in ("gemma3", "gemma3_text")
    layer_rope = layer_types if per_type_rope else (None,) * layers
    try:
        check_rope(cfg, tuple(dict.fromkeys(layer_rope)))
    except RopeConfigError as e:
        raise FamilyConfigError(str(e)) from None
    common = dict(windows=windows, layer_rope=layer_rope)
    if kind in ("llama", "mistral", "qwen2", "mixtral"):
        return Family(kind, **common)
    if kind in ("qwen3", "qwen3_moe"):
        return Family(kind, qk_norm="head", **common)
    if kind == "olmo2":
        return Family(kind, placement="post", qk_norm="proj", **common)
    if kind == "phi3":
        return Family(kind, fused_checkpoint=True, **common)
    if kind == "granite":
        return Family(
            kind,
            embed_scale=float(cfg.embedding_multiplier),
            residual_scale=float(cfg.residual_multiplier),
            attn_scale=float(cfg.attention_multiplier),
            logits_scale=1.0 / float(cfg.logits_scaling),
            **common,
        )
    gemma = dict(
        placement="sandwich",
        norm_one_plus=True,
        activation=_activation(cfg.hidden_activation, "hidden_activation"),
        embed_scale=math.sqrt(cfg.hidden_size),
        attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
        final_softcap=getattr(cfg, "final_logit_softcapping", None),
        **common,
    )
    if kind == "gemma2":
        return Family(kind, **gemma)
    return Family("gemma3", qk_norm="head", **gemma)


def _activation(name: str, key: str) -> str:
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    if name == "silu":
        return "silu"
    raise FamilyConfigError(f"{key}: activation {name!r} is not supported")


@dataclass
class RawLayer:
    """One layer's full-precision tensors, fused the engine's way (q|k|v, gate|up)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor | None  # None in a sparse layer
    down: torch.Tensor | None
    norms: dict[str, torch.Tensor]  # the family's norms by their checkpoint names
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    # A sparse layer's router [E, hidden], stacked gate_up [E, 2 * inter, hidden] and
    # stacked down [E, hidden, inter] (moe.py), as transformers 5 holds them.
    moe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


# The layer norms each placement reads, in their checkpoint's names.
LAYER_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
}


def take_layer(layer, fam: Family) -> RawLayer:
    """Read a transformers decoder layer's weights (detached, not copied)."""
    att, mlp = layer.self_attn, layer.mlp
    gate_up = moe = None
    if hasattr(mlp, "experts"):  # a sparse MoE block
        experts = mlp.experts
        moe = (
            mlp.gate.weight.detach(),
            experts.gate_up_proj.detach(),
            experts.down_proj.detach(),
        )
    if fam.fused_checkpoint:
        qkv, bias = att.qkv_proj.weight, att.qkv_proj.bias
        gate_up = mlp.gate_up_proj.weight
    else:
        qkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        bias = None
        if att.q_proj.bias is not None:
            bias = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
        if moe is None:
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    norms = {name: getattr(layer, name).weight.detach() for name in LAYER_NORMS[fam.placement]}
    q_norm = att.q_norm.weight.detach() if fam.qk_norm else None
    k_norm = att.k_norm.weight.detach() if fam.qk_norm else None
    return RawLayer(
        qkv=qkv.detach(),
        qkv_bias=None if bias is None else bias.detach(),
        o=att.o_proj.weight.detach(),
        gate_up=None if gate_up is None else gate_up.detach(),
        down=None if moe is not None else mlp.down_proj.weight.detach(),
        norms=norms,
        q_norm=q_norm,
        k_norm=k_norm,
        moe=moe,
    )


def inner_model(hf_model):
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal-LM model."""
    inner = hf_model.model
    return getattr(inner, "language_model", None) or inner
