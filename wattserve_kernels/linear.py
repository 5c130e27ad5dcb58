"""Dense linear layers with weights pre-packed for the CPU's matmul library.

On this CPU kind the oneDNN packed layout (the one torch's inductor uses) runs a
[T, in] x [in, out] product about twice as fast as F.linear on a plain row-major
weight at T = 1..64. Packing happens once at load; the forward then calls the packed
kernel. Where oneDNN is absent, refuses the dtype on this CPU (bf16 without AVX512-BW or
AVX-NE-CONVERT), or on CUDA, the plain F.linear path is used.
The reference for tests is F.linear on the unpacked weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Batch-size hint for the packed layout; 16 measured best across T = 1..256 here.
_PACK_HINT_TOKENS = 16


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """y = x @ W.T + b with W: [out, in]; x: [T, in] -> y: [T, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = False
        if _can_pack(weight):
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_TOKENS)
                self.packed = True
            except RuntimeError:
                # oneDNN's bf16 path needs AVX512-BW or AVX-NE-CONVERT; without them the
                # plain layout serves (torch's own bf16 GEMM).
                pass
        if not self.packed:
            self.weight = weight.contiguous()
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
