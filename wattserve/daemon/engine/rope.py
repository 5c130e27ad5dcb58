"""Rotary position tables for every rope variant the engine serves, one per layer type.

The inverse frequencies come from transformers' own rope functions (ROPE_INIT_FUNCTIONS)
on the model's config, so a variant means here what it means there: default, linear,
llama3 and yarn are one fixed table; longrope picks its short or long factors, and
dynamic NTK its base, from the length of the sequence a token belongs to, as transformers
does for one sequence generated alone: a prompt token sees the whole prompt's length, a
generated token its own position + 1 (longrope: the sequence's length now, its KV
recomputed when it crosses the original context, as Phi-3's generate does). That choice
is folded into the token's row (`rows()`), so a step's tensors stay one int64 per token
and forward() reads nothing back.
Partial rotary (Phi-3's `partial_rotary_factor`) is served by padding the table with
cos 1, sin 0 and permuting q/k's head dims at load (`partial_rotary_perm`).
This module builds tables and rows; it must not touch weights or the KV cache.
"""

from __future__ import annotations

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


class RopeConfigError(ValueError):
    """A rope variant the engine cannot run; the message names the config key."""


def rope_parameters(hf_config, layer_type: str | None) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type] or {}
    return params


def check_rope(hf_config, layer_types: tuple[str | None, ...]) -> None:
    """Raise RopeConfigError naming the key of a rope type this module does not serve."""
    for lt in layer_types:
        kind = rope_parameters(hf_config, lt).get("rope_type", "default")
        if kind not in SUPPORTED_ROPE_TYPES:
            key = "rope_parameters.rope_type" if lt is None else f"rope_parameters.{lt}.rope_type"
            raise RopeConfigError(
                f"{key}: rope type {kind!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )


def partial_rotary_perm(head_dim: int, rotary_dim: int) -> torch.Tensor | None:
    """The head-dim order that makes transformers' partial rotate-half (pairs i, i + r/2
    within the first r dims) the engine's full rotate-half (pairs j, j + D/2); None when
    every dim rotates. The rest pair up among themselves and get cos 1, sin 0."""
    if rotary_dim == head_dim:
        return None
    half_r, half_rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(half_r)) + [rotary_dim + i for i in range(half_rest)]
    second = [half_r + i for i in range(half_r)] + [
        rotary_dim + half_rest + i for i in range(half_rest)
    ]
    return torch.tensor(first + second, dtype=torch.long)


class RopeTable:
    """cos/sin rows of one layer type: lookup(rows) -> (cos, sin), each [T, 1, D/2]."""

    def __init__(
        self,
        hf_config,
        layer_type: str | None,
        init_fn,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """init_fn(config, device, seq_len=..., **layer) -> (inv_freq, attention_scaling):
        transformers' function for this layer type's rope."""
        params = rope_parameters(hf_config, layer_type)
        self.kind = params.get("rope_type", "default")
        self.max_positions = max_positions
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self._config = hf_config
        self._init_fn = init_fn
        self._layer = {} if layer_type is None else {"layer_type": layer_type}
        inv, scaling = init_fn(hf_config, device=None, **self._layer)
        self.rotary_dim = 2 * inv.numel()
        self.attention_scaling = float(scaling)
        self.original_max = int(
            params.get("original_max_position_embeddings") or hf_config.max_position_embeddings
        )
        if self.kind == "longrope":
            long_inv, _ = init_fn(
                hf_config, device=None, seq_len=self.original_max + 1, **self._layer
            )
            # Rows [0, P): the short factors; rows [P, 2P): the long ones.
            self.cos, self.sin = self._table(torch.cat([inv, long_inv]), 2)
        elif self.kind != "dynamic":
            self.cos, self.sin = self._table(inv, 1)

    @property
    def length_dependent(self) -> bool:
        return self.kind in ("longrope", "dynamic")

    def _table(self, inv_sets: torch.Tensor, sets: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        cos_parts, sin_parts = [], []
        for inv in inv_sets.view(sets, -1):
            freqs = torch.outer(pos, inv.float())
            cos_parts.append(self._pad(freqs.cos() * self.attention_scaling, 1.0))
            sin_parts.append(self._pad(freqs.sin() * self.attention_scaling, 0.0))
        cos = torch.cat(cos_parts).to(self.device, self.dtype)
        return cos, torch.cat(sin_parts).to(self.device, self.dtype)

    def _pad(self, part: torch.Tensor, value: float) -> torch.Tensor:
        """[N, r/2] -> [N, D/2]: the dims that do not rotate get cos 1, sin 0."""
        missing = self.head_dim // 2 - part.shape[-1]
        return torch.nn.functional.pad(part, (0, missing), value=value) if missing else part

    def rows(self, start: int, end: int, prompt_len: int, num_tokens: int) -> list[int]:
        """Rows of positions start..end-1 of a sequence whose prompt has prompt_len tokens
        and which holds num_tokens tokens now (prompt and generated)."""
        if self.kind == "longrope":
            # Long factors once the sequence is longer than the original context; the
            # scheduler recomputes its whole KV when it crosses (recompute_at_tokens).
            return [
                p + self.max_positions * (num_tokens > self.original_max) for p in range(start, end)
            ]
        if self.kind == "dynamic":
            # What transformers' max(position_ids) + 1 is for one sequence generated alone.
            return [p + self.max_positions * max(prompt_len, p + 1) for p in range(start, end)]
        return list(range(start, end))

    def prefix_salt(self, prompt_len: int, num_tokens: int) -> bytes:
        """What a sequence's cached KV depends on besides its tokens (see rows())."""
        if self.kind == "longrope":
            return b"long" if num_tokens > self.original_max else b""
        if self.kind == "dynamic" and prompt_len > self._config.max_position_embeddings:
            return str(prompt_len).encode()
        return b""

    @property
    def recompute_at_tokens(self) -> int | None:
        """The length at which a sequence's KV is recomputed under the long factors: what
        transformers' Phi-3 generate does when a sequence outgrows the original context."""
        return self.original_max + 1 if self.kind == "longrope" else None

    def lookup(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: [T] int64 from rows() -> (cos, sin), each [T, 1, D/2]."""
        if self.kind != "dynamic":
            cos = self.cos.index_select(0, rows).unsqueeze(1)
            return cos, self.sin.index_select(0, rows).unsqueeze(1)
        pos = torch.remainder(rows, self.max_positions)
        seq_len = torch.div(rows, self.max_positions, rounding_mode="floor").unsqueeze(1)
        # transformers' own dynamic-NTK function, on a [T, 1] seq_len: one base per token.
        inv, _ = self._init_fn(self._config, device=rows.device, seq_len=seq_len, **self._layer)
        freqs = pos.unsqueeze(1).float() * inv.float()  # [T, r/2]
        cos = self._pad(freqs.cos() * self.attention_scaling, 1.0).to(self.dtype)
        sin = self._pad(freqs.sin() * self.attention_scaling, 0.0).to(self.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def init_function(rotary_module, hf_config, layer_type: str | None):
    """transformers' rope function for a layer type: the module's own default, else
    ROPE_INIT_FUNCTIONS[rope_type]."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = rope_parameters(hf_config, layer_type).get("rope_type", "default")
    if kind == "default":
        return type(rotary_module).compute_default_rope_parameters
    return ROPE_INIT_FUNCTIONS[kind]
