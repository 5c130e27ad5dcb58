"""Mixture-of-experts feed-forward block (mixtral, qwen3_moe) over a flat token batch.

Each token goes to its top-k experts: softmax over the router logits in float32, top-k of
those probabilities, the k weights renormalised to sum to one where the family does
(Mixtral always; Qwen3-MoE as `norm_topk_prob` says). The experts then run grouped: the
flat (token, expert) pairs are sorted by expert, so each expert that has tokens runs one
gate_up and one down matmul over its contiguous slice of rows, and the weighted results
are added back onto their tokens. No loop over tokens; the expert weights are built once
per quantization level (one make_linear per expert matrix, so every level the dense
linears have; at full precision, plain F.linear over views of one stacked tensor, as the
packed dense kernel read a cold 1536x2048 expert ~6x slower than F.linear at one token)
and never copied or gathered in a step. The router stays at full precision
at every level: it is tiny, and a quantized router would move tokens between experts.
One host read-back per block (the per-expert token counts, to slice the sorted rows), so a
step through this block cannot be captured in a CUDA graph.
This module must not know about attention, the KV cache, scheduling or the checkpoint
format beyond the transformers module it takes the weights from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wattserve.kernels.linear import Linear
from wattserve.kernels.norm_rope import silu_mul
from wattserve.kernels.quant import LinearLike, QuantLevel, linear_nbytes, make_linear

MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")


@dataclass(frozen=True)
class MoeSpec:
    """One sparse layer's routing and expert shape."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # top-k weights rescaled to sum to one

    def linear_bytes(
        self, hidden_size: int, level: QuantLevel, device: torch.device | str = "cpu"
    ) -> int:
        """Resident bytes of every expert's gate_up and down at `level` on `device` (router
        excluded)."""
        inter = self.intermediate_size
        per_expert = linear_nbytes(2 * inter, hidden_size, level, device) + linear_nbytes(
            hidden_size, inter, level, device
        )
        return self.num_experts * per_expert


def moe_spec(hf_config, layer_idx: int) -> MoeSpec | None:
    """The MoE spec of layer `layer_idx`, or None for a dense layer (every layer of a dense
    family; Qwen3-MoE's `mlp_only_layers` and those off its `decoder_sparse_step`)."""
    cfg = hf_config
    if cfg.model_type == "mixtral":
        return MoeSpec(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True)
    if cfg.model_type == "qwen3_moe":
        dense_only = cfg.mlp_only_layers or []
        sparse = (
            layer_idx not in dense_only
            and cfg.num_experts > 0
            and (layer_idx + 1) % cfg.decoder_sparse_step == 0
        )
        if not sparse:
            return None
        return MoeSpec(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            bool(cfg.norm_topk_prob),
        )
    return None


class ExpertLinear:
    """One expert's full-precision matrix: a view into its layer's stacked weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()


class MoeBlock:
    """x [T, hidden] -> [T, hidden]: the weighted sum of each token's top-k experts."""

    def __init__(
        self,
        spec: MoeSpec,
        router: LinearLike,
        gate_up: list[LinearLike],
        down: list[LinearLike],
    ) -> None:
        if len(gate_up) != spec.num_experts or len(down) != spec.num_experts:
            raise ValueError(
                f"MoE block: {len(gate_up)} gate_up and {len(down)} down linears "
                f"for {spec.num_experts} experts"
            )
        self.spec = spec
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.nbytes = sum(lin.nbytes for lin in self.linears)
        self.expert_nbytes = gate_up[0].nbytes + down[0].nbytes  # one expert's matrices
        self.experts_run = 0  # experts the last call ran (those with routed tokens)

    @property
    def linears(self) -> tuple[LinearLike, ...]:
        """Every linear it holds: the router, then each expert's gate_up, then down."""
        return (self.router, *self.gate_up, *self.down)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids int64 [T, k]) for each token."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = probs.topk(self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape[0], self.spec.top_k
        weights, experts = self.route(x)
        flat_experts = experts.reshape(-1)  # [T * k], token-major
        # Stable, so that within an expert the rows keep token order (deterministic sums).
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.spec.num_experts).tolist()
        self.experts_run = sum(1 for n in counts if n)
        rows = x.index_select(0, order // k)  # [T * k, hidden], grouped by expert
        outs = []
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            seg = rows.narrow(0, start, n)
            outs.append(self.down[expert](silu_mul(self.gate_up[expert](seg))))
            start += n
        # Back to token-major order with a gather (index_add_ onto the tokens measured
        # ~100x slower on the CPU), then each token's k results weighted and summed.
        token_major = torch.cat(outs).index_select(0, order.argsort())
        mixed = token_major.view(t, k, -1).float() * weights.unsqueeze(-1)
        return mixed.sum(dim=1).to(x.dtype)


def build_moe_block(
    spec: MoeSpec,
    hf_block,
    level: QuantLevel | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> MoeBlock:
    """A MoeBlock from a transformers 5 sparse MoE module (`gate.weight`, and the stacked
    `experts.gate_up_proj` / `experts.down_proj`). level None: the full-precision packed
    linears in `dtype`; otherwise make_linear at that level, one per expert matrix."""

    def full(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLike:
        return Linear(weight.to(device, dtype).contiguous(), bias)

    def quantized(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLike:
        # Quantized on the device: the CUDA int4 packing is CUDA's own layout.
        return make_linear(weight.to(device), bias, level, dtype)

    experts = hf_block.experts
    return moe_block_from_weights(
        spec,
        hf_block.gate.weight.detach(),
        experts.gate_up_proj.detach(),
        experts.down_proj.detach(),
        None if level is None else quantized,
        full,
        dtype,
        device,
    )


def moe_block_from_weights(
    spec: MoeSpec,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    make: Callable[[torch.Tensor, torch.Tensor | None], LinearLike] | None,
    make_router: Callable[[torch.Tensor, torch.Tensor | None], LinearLike],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> MoeBlock:
    """A MoeBlock from router [E, hidden], gate_up [E, 2 * inter, hidden] (gate rows then
    up rows) and down [E, hidden, inter]; make(weight, bias) builds each expert matrix's
    linear at the level wanted, make_router the router's (full precision). make None:
    full precision, the stacked weights moved to `device` / `dtype` once and each expert
    an ExpertLinear view of them."""
    e, inter = spec.num_experts, spec.intermediate_size
    hidden = router.shape[1]
    for name, tensor, want in (
        ("router", router, (e, hidden)),
        ("gate_up", gate_up, (e, 2 * inter, hidden)),
        ("down", down, (e, hidden, inter)),
    ):
        if tuple(tensor.shape) != want:
            raise ValueError(f"MoE block: {name} weight {tuple(tensor.shape)}, expected {want}")
    if make is None:
        gate_up = gate_up.to(device, dtype).contiguous()
        down = down.to(device, dtype).contiguous()
        gate_up_lins = [ExpertLinear(gate_up[i]) for i in range(e)]
        down_lins = [ExpertLinear(down[i]) for i in range(e)]
    else:
        gate_up_lins = [make(gate_up[i], None) for i in range(e)]
        down_lins = [make(down[i], None) for i in range(e)]
    return MoeBlock(spec, make_router(router, None), gate_up_lins, down_lins)
