"""The Triton attention kernel compiled ahead of time for the H100/H200's architecture
(sm_90) on this GPU-less machine, with triton's bundled ptxas: the interpreter runs the
kernel's numerics (test_triton_attention.py) but not the compiler's type and shape rules,
which a GPU run would meet first."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (the test extras pin it)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from wattserve.kernels.triton_attention import (  # noqa: E402
    _paged_attention_kernel,
    kernel_config,
)

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@pytest.mark.parametrize(
    "dtype,decode,group,head_dim,window,softcap",
    [
        (torch.bfloat16, True, 4, 64, None, None),  # the 1B shape's decode
        (torch.bfloat16, False, 8, 128, 4096, 50.0),  # a mixed step with every option
    ],
)
def test_the_kernel_compiles_for_sm90(dtype, decode, group, head_dim, window, softcap):
    constexprs, num_warps = kernel_config(dtype, decode, group, head_dim, 16, window, softcap)
    ptr = f"*{_TYPES[dtype]}"
    signature = {name: ptr for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    signature |= {n: "*i64" for n in ("tables_ptr", "query_start_ptr", "context_lens_ptr",
                                      "tiles_ptr")}
    signature |= {"scale": "fp32", "softcap": "fp32", "window": "i32"}
    signature |= {n: "i32" for n in ("q_stride_t", "q_stride_h", "out_stride_t",
                                     "out_stride_h", "kv_stride_block", "kv_stride_token",
                                     "kv_stride_head", "table_stride")}
    signature |= {name: "constexpr" for name in constexprs}
    compiled = triton.compile(
        ASTSource(_paged_attention_kernel, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps),
    )
    assert compiled.asm["cubin"]  # through ptxas to a binary
    assert compiled.metadata.shared <= 227 * 1024  # fits an H100/H200 SM's shared memory
