"""Integer-activation linears on the CPU: 8- or 4-bit weight codes times int8 activations.

The C++ op `wattserve::int_linear` (csrc/int_linear.cpp, built where the compiler targets
AVX-512 VNNI) quantizes each activation row per 32 in-features to int8 and multiplies it
with unsigned weight codes on the CPU's integer dot-product instruction, reading each
weight once per 8 rows. This module builds the op's weight layout from codes, scales and
zeros (w = scale * (code - C) + zero per group of in-features, C = 128 for 8 bits and 8 for
4 bits: torch's int4 convention), says whether the op is here, and holds the plain-torch
reference of the same arithmetic for tests.
It must not choose between levels or kernels (wattserve.kernels.quant does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wattserve.kernels.extension import load_cpu_kernels

ACT_GROUP = 32  # in-features per activation scale (the op's fixed group)
COLS = 16  # output columns per packed block


@functools.cache
def int_linear_available() -> bool:
    """Whether the C++ op runs on this machine (kernels built, AVX-512 VNNI targeted)."""
    return load_cpu_kernels() and bool(torch.ops.wattserve.int_linear_available())


@dataclass
class IntWeights:
    """One linear's weights in the op's layout.

    packed: uint8, [Np/16, Kp/4, 16, 4] (8 bits) or [Np/16, Kp/8, 16, 4] (4 bits, two
    codes a byte); scales, zeros: bfloat16 [Kp / group_size, Np].
    """

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    out_features: int

    @property
    def nbytes(self) -> int:
        return (
            self.packed.numel()
            + self.scales.numel() * self.scales.element_size()
            + self.zeros.numel() * self.zeros.element_size()
        )


def pack_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    out_features: int,
) -> IntWeights:
    """codes uint8 [Np, Kp] (Np % 16 == 0, Kp % 32 == 0 and % group_size == 0; < 2**bits),
    scales and zeros [Np, Kp / group_size] (rounded to bfloat16) -> the op's layout."""
    n, k = codes.shape
    if n % COLS or k % ACT_GROUP or k % group_size or group_size % ACT_GROUP:
        raise ValueError(f"int_linear: codes [{n}, {k}] / group {group_size} do not tile")
    c = codes.to(torch.uint8)
    if bits == 8:
        packed = c.reshape(n // COLS, COLS, k // 4, 4).permute(0, 2, 1, 3)
    elif bits == 4:
        pairs = c.reshape(n // COLS, COLS, k // 8, 2, 4)
        packed = (pairs.select(3, 0) | (pairs.select(3, 1) << 4)).permute(0, 2, 1, 3)
    else:
        raise ValueError(f"int_linear: bits must be 8 or 4, not {bits}")
    return IntWeights(
        packed=packed.contiguous(),
        scales=scales.to(torch.bfloat16).T.contiguous(),
        zeros=zeros.to(torch.bfloat16).T.contiguous(),
        bits=bits,
        group_size=group_size,
        out_features=out_features,
    )


def int_linear(x: torch.Tensor, w: IntWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (float32 or bfloat16, contiguous) -> [T, out_features] in x's dtype."""
    return torch.ops.wattserve.int_linear(
        x, w.packed, w.scales, w.zeros, w.bits, w.group_size, w.out_features, bias
    )


# ---- the reference (plain torch, the same arithmetic) ------------------------------------


def quantize_activations(x: torch.Tensor, padded_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int codes as float32 [T, Kp], per-group scales float32 [T, Kp/32]):
    each 32 in-features scaled by amax / 127 and rounded half to even, as the op does."""
    xf = F.pad(x.float(), (0, padded_in - x.shape[1]))
    groups = xf.reshape(xf.shape[0], -1, ACT_GROUP)
    amax = groups.abs().amax(dim=-1)
    # a tensor / tensor division: `127.0 / amax` would multiply by a reciprocal and miss
    # the correctly rounded quotient the op uses by an ulp (and flip a tie's rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(groups * inv.unsqueeze(-1)).clamp(-127, 127)
    return q.reshape(xf.shape), amax / 127.0


def center_code(bits: int) -> int:
    """The code whose weight is the group's zero: 128 for 8 bits, 8 for 4 bits."""
    return 1 << (bits - 1)


def unpack_codes(w: IntWeights) -> torch.Tensor:
    """The codes back from the layout: uint8 [Np, Kp]."""
    blocks, quads = w.packed.shape[0], w.packed.shape[1]
    p = w.packed.permute(0, 2, 1, 3)  # [Np/16, 16, K/4 or K/8, 4]
    if w.bits == 8:
        return p.reshape(blocks * COLS, quads * 4)
    both = torch.stack([p & 0x0F, p >> 4], dim=3)  # [Np/16, 16, K/8, 2, 4]
    return both.reshape(blocks * COLS, quads * 8)


def int_linear_reference(
    x: torch.Tensor, w: IntWeights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the op computes, in float32: weights dequantized, activations quantized."""
    return int_linear_reference_on(dequantize_weights(w), x, w.out_features, bias)


def dequantize_weights(w: IntWeights) -> torch.Tensor:
    """The weights the codes stand for: float32 [Np, Kp]."""
    codes = unpack_codes(w).float() - center_code(w.bits)  # [Np, Kp]
    group_of_k = torch.arange(codes.shape[1], device=codes.device) // w.group_size
    return codes * w.scales.float().T[:, group_of_k] + w.zeros.float().T[:, group_of_k]


def int_linear_reference_on(
    weight: torch.Tensor, x: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x's quantized activations times a dequantized weight [Np, Kp], in float32."""
    q, a = quantize_activations(x, weight.shape[1])
    xq = (q.reshape(q.shape[0], -1, ACT_GROUP) * a.unsqueeze(-1)).reshape(q.shape)
    y = (xq @ weight.T)[:, :out_features]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
