"""Paged attention as one Triton kernel launch per layer, for any step kind.

The same contract as attention.paged_attention (q [T, H, D]; K/V in the block pool,
[N, block_size, KVH, D]; block_tables, query_start, context_lens; scale, sliding_window,
logit_softcap), read in place through the block tables: no gathered copy, no mask tensor.
One program takes one KV head and a tile of query tokens of one sequence with all the
query heads that share that KV head (grouped-query heads native), and runs an online
softmax over the sequence's keys in float32, whatever the inputs' dtype (bf16, fp16, fp32).

The launch grid comes from tensor shapes alone and nothing is read back to the host, so a
CUDA graph can capture the call:
- a decode-only step (T == B) runs one program per (sequence, KV head);
- any other step runs one program per (query tile, KV head, row split) over the step's
  query tiles, a device tensor [T // QUERY_TILE + B, 2] of (sequence, first query row
  within it) that the caller builds from its layout (attention.query_tiles), padded with
  (-1, 0) tiles that do nothing.
It must not write the cache (rope_write_kv does) nor choose who runs it (the model does).
Importing it needs triton; the kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1
(set before this module is imported), which the tests use.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from wattserve.kernels.attention import QUERY_TILE, check_options

# Query rows (tokens x grouped heads) one program holds at most: its fp32 accumulator is
# rows x head_dim, kept in registers.
_MAX_ROWS = 128
# Read as triton.jit does, when this module is imported.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _tanh(x):
    # tanh from exp (the interpreter has no libdevice), of -|x| so that it cannot overflow.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    tiles_ptr,
    scale,
    softcap,
    window,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    kv_stride_block,
    kv_stride_token,
    kv_stride_head,
    table_stride,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # the next power of two
    TOKENS: tl.constexpr,  # query tokens per program
    ROWS: tl.constexpr,  # a power of two >= 16 and >= TOKENS * GROUP
    SPLIT: tl.constexpr,  # programs per query tile along axis 1 (per KV head)
    KEYS: tl.constexpr,  # keys per inner iteration
    DECODE: tl.constexpr,  # one query token per sequence: program 0 axis is the sequence
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    FP32_DOTS: tl.constexpr,  # dots in full fp32 (not TF32): fp32 inputs; see _launch
):
    kv_head = tl.program_id(1) // SPLIT
    if DECODE:
        seq = tl.program_id(0)
        first = 0
    else:
        tile = tl.program_id(0)
        seq = tl.load(tiles_ptr + 2 * tile)
        first = tl.load(tiles_ptr + 2 * tile + 1) + (tl.program_id(1) % SPLIT) * TOKENS
    live = seq >= 0
    seq = tl.maximum(seq, 0)
    q_begin = tl.load(query_start_ptr + seq)
    n = tl.load(query_start_ptr + seq + 1) - q_begin  # the sequence's query tokens
    ctx = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, ROWS)
    tok = rows // GROUP
    qi = first + tok  # query index within the sequence
    row_ok = (tok < TOKENS) & (qi < n) & live
    pos = ctx - n + qi  # absolute position of each row's token
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_off = (q_begin + qi)[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    # Keys up to the last row's position; none at all for a padding tile.
    hi = tl.where(live & (first < n), tl.minimum(ctx - n + first + TOKENS, ctx), 0)
    lo = 0
    if USE_WINDOW:  # keys before the first row's window are never read
        lo = tl.maximum(ctx - n + first - window + 1, 0) // KEYS * KEYS
    for start in range(lo, hi, KEYS):
        keys = start + tl.arange(0, KEYS)
        key_ok = keys < hi
        block = tl.load(
            tables_ptr + seq * table_stride + keys // BLOCK_SIZE, mask=key_ok, other=0
        )
        kv_off = (
            block * kv_stride_block + (keys % BLOCK_SIZE) * kv_stride_token
            + kv_head * kv_stride_head
        )
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOTS:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        seen = row_ok[:, None] & (keys[None, :] <= pos[:, None])
        if USE_WINDOW:
            seen = seen & (pos[:, None] - keys[None, :] < window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf: subtract 0 rather than -inf.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_sub[:, None])
        alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOTS:  # p rounded to v's dtype all the same, as the tensor-core dot takes it
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = (q_begin + qi)[:, None] * out_stride_t + head[:, None] * out_stride_h + d[None, :]
    tl.store(
        out_ptr + o_off,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    query_tiles: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    t, heads, head_dim = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty((t, heads, head_dim), dtype=q.dtype, device=q.device)
    decode = t == context_lens.shape[0]
    if decode:
        tokens, split, grid_tiles = 1, 1, context_lens.shape[0]
    else:
        tokens = QUERY_TILE
        while tokens > 1 and tokens * group > _MAX_ROWS:
            tokens //= 2
        split, grid_tiles = QUERY_TILE // tokens, query_tiles.shape[0]
    rows = max(16, triton.next_power_of_2(tokens * group))
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    keys = 64 if head_dim_pad <= 64 else 32
    if grid_tiles == 0 or t == 0:
        return out
    _paged_attention_kernel[(grid_tiles, kv_heads * split)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start,
        context_lens,
        query_tiles,
        float(scale),
        float(logit_softcap or 1.0),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=bs,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        TOKENS=tokens,
        ROWS=rows,
        SPLIT=split,
        KEYS=keys,
        DECODE=decode,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=logit_softcap is not None,
        # The interpreter's dot multiplies bf16 operands' bit patterns (triton 3.7.1): there
        # bf16 operands are widened to fp32 first.
        FP32_DOTS=q.dtype == torch.float32 or (_INTERPRET and q.dtype == torch.bfloat16),
        num_warps=4 if rows * head_dim_pad <= 64 * 128 else 8,
    )
    return out


# Registered through a Library fragment rather than torch.library.custom_op: a call costs
# ~6 us of host time instead of ~22 (measured here), 16-32 times per eager step.
_LIB = torch.library.Library("wattserve", "FRAGMENT")
_LIB.define(
    "triton_paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "Tensor query_start, Tensor context_lens, Tensor query_tiles, float scale, "
    "int? sliding_window, float? logit_softcap) -> Tensor"
)
for _key in ("CUDA", "CPU"):  # the CPU under TRITON_INTERPRET=1 only
    _LIB.impl("triton_paged_attention", _launch, _key)


@torch.library.register_fake("wattserve::triton_paged_attention")
def _(q, *_args):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    query_tiles: torch.Tensor | None,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every query token of a step (attention.paged_attention's
    contract) in one kernel launch. query_tiles: [T // QUERY_TILE + B, 2] int64 from
    attention.query_tiles; unused by a decode-only step (T == B), where it may be None.
    Returns a new contiguous [T, H, D] in q's dtype."""
    check_options(sliding_window, logit_softcap)
    t, heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have one shape and layout")
    if heads % k_cache.shape[2] or head_dim != k_cache.shape[3]:
        raise ValueError("head_dim differs or H is not a multiple of KVH")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    if query_tiles is None:
        if t != context_lens.shape[0]:
            raise ValueError("a step that is not decode-only needs query_tiles")
        query_tiles = context_lens.new_empty(0, 2)
    return torch.ops.wattserve.triton_paged_attention.default(
        q, k_cache, v_cache, block_tables, query_start, context_lens, query_tiles, scale,
        sliding_window, logit_softcap,
    )
