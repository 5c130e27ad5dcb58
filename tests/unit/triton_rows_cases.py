"""The Triton row-op test cases (triton_rows.py): inputs built from a seed, and a runner for
a subprocess under TRITON_INTERPRET=1, as triton_attention_cases.py does for attention.

`python -m tests.unit.triton_rows_cases OUT` saves each case's kernel outputs (and the
caches it wrote) to OUT; test_triton_rows.py compares them with the torch references in its
own process. A tiny model's steps with these ops and the Triton attention together run in
triton_attention_cases.py's subprocess (the interpreter is slow: one model run for both).
"""

from __future__ import annotations

import sys

import torch

# (q heads, KV heads, head dim, tokens)
ROPE = {
    "gqa1_d64": (4, 4, 64, 5),
    "gqa4_d64": (8, 2, 64, 7),
    "gqa8_d128": (8, 1, 128, 3),
    "gqa3_d96": (6, 2, 96, 4),  # head dim and head count not powers of two
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BLOCKS, BLOCK_SIZE = 6, 4


def rope_inputs(name: str, dtype: torch.dtype):
    heads, kv_heads, d, t = ROPE[name]
    g = torch.Generator().manual_seed(len(name) * 7 + t)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    angle = torch.rand(t, 1, d // 2, generator=g) * 6.0
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    k_cache = torch.zeros(BLOCKS, BLOCK_SIZE, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:t]
    return qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads


def norm_inputs(dtype: torch.dtype, hidden: int = 96, rows: int = 5):
    g = torch.Generator().manual_seed(hidden + rows)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    addend = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return residual, addend, weight


def silu_inputs(dtype: torch.dtype, inter: int = 1500, rows: int = 3):
    g = torch.Generator().manual_seed(inter)
    return (3.0 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)


def greedy_logits() -> torch.Tensor:
    """Rows over a vocabulary of 2,500 (more than one block): plain, a tie (first wins), a
    NaN, a +inf, all -inf, a -inf among finite values."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2500, generator=g)
    x[1, 7] = x[1, 2100] = 50.0
    x[2, 1800] = float("nan")
    x[3, 5] = float("inf")
    x[4] = float("-inf")
    x[5, :1200] = float("-inf")
    return x


def main(out_path: str) -> None:
    from wattserve.kernels import norm_rope
    from wattserve.kernels.attention import rope_write_kv

    norm_rope.TRITON_ROW_DEVICES.add("cpu")
    outputs: dict[str, object] = {}
    for dname, dtype in DTYPES.items():
        for name in ROPE:
            qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads = rope_inputs(name, dtype)
            q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
            outputs[f"rope/{name}/{dname}"] = (q, k_cache, v_cache)
        residual, addend, weight = norm_inputs(dtype)
        out = norm_rope.add_rms_norm(residual, addend, weight, 1e-6)
        outputs[f"add_rms_norm/{dname}"] = (out, residual)
        outputs[f"silu_mul/{dname}"] = norm_rope.silu_mul(silu_inputs(dtype))
    outputs["greedy"] = torch.ops.wattserve.triton_greedy_ids(greedy_logits())
    torch.save(outputs, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
