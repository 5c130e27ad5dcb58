"""The per-token row ops of a layer as one Triton launch each, for CUDA.

Three ops that torch runs as several kernels each (on a CUDA step they were 11 of a Llama
layer's 17 launches), and one of the sampler:
- rope_write_kv: rotate q and k of the fused projection and store k and v at the tokens'
  cache slots (torch: 2 mul, 2 addcmul, 2 index_copy);
- add_rms_norm: the residual add in place, then RMSNorm of the sum (torch: add_, rms_norm);
- silu_mul: silu(gate) * up of the fused gate/up projection (torch: silu, mul);
- greedy_ids: each row's argmax, or -1 where the row holds a NaN, a +inf or nothing finite
  (torch: amax, isfinite's 4, argmax, where).
Each takes the contract of its namesake in norm_rope.py, attention.py or sampler.py and
computes in float32 whatever the inputs' dtype, rounding once on store (the residual sum
is rounded to the residual's dtype before the norm, as torch's in-place add rounds it).
The grids come from tensor shapes alone and nothing is read back, so a CUDA graph can
capture every call. The ops only compute; who calls them is norm_rope's and the sampler's
choice (TRITON_ROW_DEVICES). Importing needs triton; the kernels run on CUDA, or on the CPU
under TRITON_INTERPRET=1 (set before import), which the tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_write_kv_kernel(
    qkv,
    cos,
    sin,
    slots,
    q_out,
    k_cache,
    v_cache,
    qkv_stride,
    cs_stride,
    q_stride_t,
    q_stride_h,
    slot_stride,
    head_stride,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    ROT_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    c = tl.load(cos + t * cs_stride + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin + t * cs_stride + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    slot = tl.load(slots + t).to(tl.int64)
    # q heads, then k heads: each rotated as halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
    h = tl.arange(0, ROT_PAD)
    m = (h < H + KVH)[:, None] & jm[None, :]
    src = qkv + t * qkv_stride + h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    is_q = (h < H)[:, None]
    q_dst = q_out + t * q_stride_t + h[:, None] * q_stride_h + j[None, :]
    tl.store(q_dst, o1.to(q_out.dtype.element_ty), mask=m & is_q)
    tl.store(q_dst + HALF, o2.to(q_out.dtype.element_ty), mask=m & is_q)
    k_dst = k_cache + slot * slot_stride + (h[:, None] - H) * head_stride + j[None, :]
    tl.store(k_dst, o1.to(k_cache.dtype.element_ty), mask=m & ~is_q)
    tl.store(k_dst + HALF, o2.to(k_cache.dtype.element_ty), mask=m & ~is_q)
    # v heads, copied
    vh = tl.arange(0, KV_PAD)
    d = tl.arange(0, 2 * HALF_PAD)
    vm = (vh < KVH)[:, None] & (d < 2 * HALF)[None, :]
    v_src = qkv + t * qkv_stride + (H + KVH + vh[:, None]) * (2 * HALF) + d[None, :]
    v = tl.load(v_src, mask=vm, other=0.0)
    v_dst = v_cache + slot * slot_stride + vh[:, None] * head_stride + d[None, :]
    tl.store(v_dst, v.to(v_cache.dtype.element_ty), mask=vm)


@triton.jit
def _add_rms_norm_kernel(
    residual, addend, weight, out, res_stride, add_stride, out_stride, n, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    r = tl.load(residual + row * res_stride + cols, mask=m, other=0.0).to(tl.float32)
    a = tl.load(addend + row * add_stride + cols, mask=m, other=0.0).to(tl.float32)
    x = (r + a).to(residual.dtype.element_ty)
    tl.store(residual + row * res_stride + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(weight + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row * out_stride + cols, (xf * inv * w).to(out.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul_kernel(gate_up, out, in_stride, out_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(gate_up + row * in_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * in_stride + inter + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out + row * out_stride + cols, y.to(out.dtype.element_ty), mask=m)


@triton.jit
def _greedy_kernel(logits, out, stride, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_at = tl.full((BLOCK,), 0, tl.int32)
    bad = tl.zeros((BLOCK,), tl.int32)  # a NaN or a +inf seen in this lane
    for start in range(0, vocab, BLOCK):
        at = start + cols
        x = tl.load(logits + row * stride + at, mask=at < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        bad = bad | (x != x).to(tl.int32) | (x == float("inf")).to(tl.int32)
        better = x > best  # strict: each lane keeps its first maximum
        best_at = tl.where(better, at, best_at)
        best = tl.where(better, x, best)
    top = tl.max(best, axis=0)
    # the first index holding the maximum (lanes hold increasing indices for equal values)
    first = tl.min(tl.where(best == top, best_at, vocab), axis=0)
    ok = (tl.max(bad, axis=0) == 0) & (top > float("-inf"))
    tl.store(out + row, tl.where(ok, first, -1).to(tl.int64))


def _rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads):
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    cos2, sin2 = cos.reshape(t, -1), sin.reshape(t, -1)
    half = d // 2
    _rope_write_kv_kernel[(t,)](
        qkv,
        cos2,
        sin2,
        slots,
        q,
        k_cache,
        v_cache,
        qkv.stride(0),
        cos2.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        H=num_heads,
        KVH=num_kv_heads,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        ROT_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
        KV_PAD=triton.next_power_of_2(num_kv_heads),
        num_warps=4,
    )
    return q


def _add_rms_norm(residual, addend, weight, eps):
    t, n = residual.shape
    out = torch.empty_like(residual)
    if t:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(t,)](
            residual,
            addend,
            weight,
            out,
            residual.stride(0),
            addend.stride(0),
            out.stride(0),
            n,
            float(eps),
            BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )
    return out


_SILU_BLOCK = 1024


def _silu_mul(gate_up):
    t, two_inter = gate_up.shape
    inter = two_inter // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        grid = (t, triton.cdiv(inter, _SILU_BLOCK))
        _silu_mul_kernel[grid](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=_SILU_BLOCK, num_warps=4
        )
    return out


_GREEDY_BLOCK = 1024


def _greedy_ids(logits):
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if n:
        _greedy_kernel[(n,)](logits, out, logits.stride(0), vocab, BLOCK=_GREEDY_BLOCK)
    return out


# One Library fragment, as triton_attention.py's (a call costs a few us of host time).
_LIB = torch.library.Library("wattserve", "FRAGMENT")
_LIB.define(
    "triton_rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor slots, int num_heads, int num_kv_heads) -> Tensor"
)
_LIB.define(
    "triton_add_rms_norm(Tensor(a!) residual, Tensor addend, Tensor weight, float eps) -> Tensor"
)
_LIB.define("triton_silu_mul(Tensor gate_up) -> Tensor")
_LIB.define("triton_greedy_ids(Tensor logits) -> Tensor")
for _key in ("CUDA", "CPU"):  # the CPU under TRITON_INTERPRET=1 only
    _LIB.impl("triton_rope_write_kv", _rope_write_kv, _key)
    _LIB.impl("triton_add_rms_norm", _add_rms_norm, _key)
    _LIB.impl("triton_silu_mul", _silu_mul, _key)
    _LIB.impl("triton_greedy_ids", _greedy_ids, _key)


@torch.library.register_fake("wattserve::triton_rope_write_kv")
def _(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads):
    return qkv.new_empty((qkv.shape[0], num_heads, k_cache.shape[-1]))


@torch.library.register_fake("wattserve::triton_add_rms_norm")
def _(residual, addend, weight, eps):
    return torch.empty_like(residual)


@torch.library.register_fake("wattserve::triton_silu_mul")
def _(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.register_fake("wattserve::triton_greedy_ids")
def _(logits):
    return logits.new_empty((logits.shape[0],), dtype=torch.long)


def takes(x: torch.Tensor, rows: int = 2) -> bool:
    """Whether these kernels can serve a call on x: rows of unit stride along the last dim."""
    return x.dim() == rows and x.stride(-1) == 1
