"""RMSNorm, rotary position embedding and the SiLU gate for the Llama-family forward.

On the CPU, RMSNorm (alone or after the residual add) and SiLU x up run as one-pass C++
ops (csrc/fused_rows.cpp); on CUDA the residual add with its norm, SiLU x up and rope with
the KV write run as one Triton launch each (triton_rows.py, where triton is installed);
elsewhere, or where neither could be loaded, torch's own.
Each fast path has a plain-torch reference (`*_reference`) that tests compare against.
These functions are pure tensor math: no model state, no KV cache, no scheduling.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from wattserve.kernels.extension import kernels_take

# Devices whose row ops run as triton_rows' kernels: CUDA where triton is installed (torch's
# CUDA wheels bring it). The Triton tests add "cpu", under TRITON_INTERPRET=1.
TRITON_ROW_DEVICES: set[str] = {"cuda"} if importlib.util.find_spec("triton") else set()


def triton_rows_take(*tensors: torch.Tensor) -> bool:
    """Whether triton_rows' kernels serve a call on these: each on a TRITON_ROW_DEVICES
    device, 2-D with unit stride along its rows."""
    if not all(t.device.type in TRITON_ROW_DEVICES for t in tensors):
        return False
    import wattserve.kernels.triton_rows as rows  # registers the ops on first use

    return all(rows.takes(t) for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] -> [T, hidden]."""
    if kernels_take(x):
        return torch.ops.wattserve.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(
    residual: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += addend (in place), then rms_norm(residual): both [T, hidden]."""
    if triton_rows_take(residual, addend):
        return torch.ops.wattserve.triton_add_rms_norm(residual, addend, weight, eps)
    if kernels_take(residual) and addend.is_contiguous():
        return torch.ops.wattserve.add_rms_norm(residual, addend, weight, eps)
    residual.add_(addend)
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * inter], gate then up -> silu(gate) * up, [T, inter]."""
    if triton_rows_take(gate_up):
        return torch.ops.wattserve.triton_silu_mul(gate_up)
    if kernels_take(gate_up):
        return torch.ops.wattserve.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(gate_up.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * out.to(x.dtype)


class RotaryTable:
    """cos/sin for every position up to max_positions, built once from inv_freq.

    inv_freq: [head_dim // 2]; attention_scaling multiplies cos and sin (used by
    scaled rope variants such as yarn; 1.0 for plain rope).
    """

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        attention_scaling: float = 1.0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        """device: where the table lives; default inv_freq's device."""
        dev = inv_freq.device if device is None else torch.device(device)
        pos = torch.arange(max_positions, dtype=torch.float32, device=dev)
        freqs = torch.outer(pos, inv_freq.to(dev).float())  # [P, D/2]
        self.cos = (freqs.cos() * attention_scaling).to(dtype)  # [P, D/2]
        self.sin = (freqs.sin() * attention_scaling).to(dtype)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, 1, D/2] ready to broadcast over heads."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        return cos, self.sin.index_select(0, positions).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] with the rotate-half convention; cos/sin: [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    out1, out2 = out.chunk(2, dim=-1)
    # out1 = x1*cos - x2*sin ; out2 = x2*cos + x1*sin, written in place to skip a cat.
    # (chunk, not x[..., :half]: Python indexing of a CUDA tensor needs the CUDA library,
    # which a fake-CUDA trace on a CPU-only torch does not have.)
    torch.addcmul(x1 * cos, x2, sin, value=-1.0, out=out1)
    torch.addcmul(x2 * cos, x1, sin, out=out2)
    return out


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    full_cos = torch.cat([cos, cos], dim=-1)
    full_sin = torch.cat([sin, sin], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * full_cos + rotated * full_sin
