"""Dense linear layers with weights pre-packed once at load for the CPU kernel that runs them.

float32 on an AVX-512 CPU: the project's own kernel (csrc/dense_linear.cpp, panels of 32
output columns; 1.3-1.5x the matmul library's packed kernel at the 16-64 tokens of a
decode step, and on par at 512). bfloat16, or float32 without that kernel: oneDNN's packed
layout (the one torch's inductor uses), about twice as fast as F.linear on a plain
row-major weight at T = 1..64. Where neither applies (no oneDNN, bf16 without AVX512-BW or
AVX-NE-CONVERT, CUDA) the plain F.linear path is used.
The reference for tests is F.linear on the unpacked weight.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from wattserve.kernels.extension import load_cpu_kernels

# Batch-size hint for the packed layout; 16 measured best across T = 1..256 here.
_PACK_HINT_TOKENS = 16


DENSE_PANEL = 32  # output columns per panel of the dense kernel's layout


@functools.cache
def dense_linear_available() -> bool:
    """Whether the float32 C++ kernel runs here (kernels built, AVX-512 targeted)."""
    return load_cpu_kernels() and bool(torch.ops.wattserve.dense_linear_available())


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> the dense kernel's layout [ceil(N / 32), K, 32]; zero columns past N."""
    n, k = weight.shape
    panels = -(-n // DENSE_PANEL)
    padded = weight.new_zeros(panels * DENSE_PANEL, k)
    padded[:n] = weight
    return padded.view(panels, DENSE_PANEL, k).transpose(1, 2).contiguous()


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """y = x @ W.T + b with W: [out, in]; x: [..., in] -> y: [..., out].

    kind: "dense" (the float32 C++ kernel), "onednn" (oneDNN's packed layout) or "plain"
    (F.linear), chosen once from the weight's device and dtype and what this CPU runs.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        on_cpu = weight.device.type == "cpu"
        if on_cpu and weight.dtype == torch.float32 and dense_linear_available():
            self.kind = "dense"
            self.weight = pack_dense(weight)
            self.bias = None if bias is None else bias.contiguous()
            return
        if _can_pack(weight):
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_TOKENS)
                self.kind = "onednn"
                return
            except RuntimeError:
                # oneDNN's bf16 path needs AVX512-BW or AVX-NE-CONVERT; without them the
                # plain layout serves (torch's own bf16 GEMM).
                pass
        self.kind = "plain"
        self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "dense":
            rows = x.reshape(-1, self.in_features).contiguous()
            y = torch.ops.wattserve.dense_linear(rows, self.weight, self.bias, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
