"""Paged attention over a block-pool KV cache (prefill chunks and batched decode).

Cache layout, per layer (one tensor for K, one for V):

    k_cache: [num_blocks, block_size, kv_heads, head_dim]

    block table of a sequence:  [ 7 | 2 | 9 ]          (block ids, in token order)
                                  |    |    \\
    token t lives at            block_table[t // block_size], offset t % block_size
    slot id (flat index)        block_id * block_size + offset

Options of the model families, the same keywords on every function here: `scale` (the
softmax scale), `sliding_window` w (a query at position i sees keys j with i - j < w, as
transformers' sliding masks do) and `logit_softcap` c (scores = c * tanh(scores / c) before
the mask and softmax, Gemma 2).

The functions here only read and write those tensors; which blocks belong to whom is
the KV cache manager's business (wattserve/daemon/engine/kv_cache.py), never decided here.
The C++ kernel (csrc/paged_attention.cpp), its plain-torch twin and the Triton kernel of
CUDA (triton_attention.py, fed the query tiles listed here) take the same arguments; tests
hold them against a token-by-token reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wattserve.kernels.extension import kernels_take, load_cpu_kernels
from wattserve.kernels.norm_rope import apply_rope, triton_rows_take


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store new keys/values. slots: [T] int64 flat slot ids; k, v: [T, kv_heads, D]."""
    kvh, d = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """From the fused projection qkv [T, (H + 2 KVH) D]: rotate q and k (cos/sin [T, 1, D/2]),
    store k and v at the tokens' slots, return q [T, H, D]. On the CPU one C++ pass
    (csrc/fused_rows.cpp) and q contiguous; elsewhere apply_rope and write_kv, and q a view
    (a copy of a CUDA tensor needs the CUDA library, which a fake-CUDA trace lacks); on
    CUDA with triton one Triton launch (triton_rows.py) and q contiguous."""
    if triton_rows_take(qkv) and k_cache.is_contiguous() and v_cache.is_contiguous():
        return torch.ops.wattserve.triton_rope_write_kv(
            qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads
        )
    if kernels_take(qkv):
        return torch.ops.wattserve.rope_write_kv(
            qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads
        )
    t, d = qkv.shape[0], k_cache.shape[-1]
    # split/narrow rather than Python slicing: see apply_rope
    qk_flat, v_flat = qkv.split([(num_heads + num_kv_heads) * d, num_kv_heads * d], dim=1)
    qk = apply_rope(qk_flat.view(t, num_heads + num_kv_heads, d), cos, sin)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    write_kv(k_cache, v_cache, slots, k, v_flat.view(t, num_kv_heads, d))
    return q


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [N, bs, KVH, D], block_table [NB] -> the first `length` tokens, [1, KVH, L, D]."""
    g = cache.index_select(0, block_table)  # [NB, bs, KVH, D]
    flat = g.reshape(-1, cache.shape[2], cache.shape[3]).narrow(0, 0, length)
    return flat.transpose(0, 1).unsqueeze(0)


# Query tokens per tile of a step that is not decode-only (the Triton kernel's unit of work).
QUERY_TILE = 16


def query_tiles(query_start: list[int], tile: int = QUERY_TILE) -> list[int]:
    """A step's query tiles as flat (sequence, first query row within it) pairs: each
    sequence's query rows cut into runs of `tile`, then (-1, 0) pairs up to
    T // tile + B, the most any step of T tokens in B sequences has (so that the count
    comes from the step's shapes alone)."""
    b = len(query_start) - 1
    flat: list[int] = []
    for seq in range(b):
        for first in range(0, query_start[seq + 1] - query_start[seq], tile):
            flat += (seq, first)
    cap = (query_start[-1] // tile + b) * 2
    return flat + [-1, 0] * ((cap - len(flat)) // 2)


def check_options(sliding_window: int | None, logit_softcap: float | None) -> None:
    """Refuse a window below one token or a soft-cap that is not positive."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0 or None, got {logit_softcap}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every query token of a step over its sequence's cached context.

    Sequence b's query tokens are rows query_start[b]:query_start[b+1] of q and sit at the
    end of its context of context_lens[b] tokens (their own K/V already written): one row
    for a decode, a chunk for a prefill. q: [T, H, D]; block_tables: [B, NB] int64, rows
    padded with any valid block id; query_start: [B + 1] int64; context_lens: [B] int64.
    Returns [T, H, D]. On the CPU the C++ kernel reads K/V blocks in place (no gathered
    copy, no mask); elsewhere, or where it could not be built, paged_attention_torch serves
    (the model's torch backend calls paged_decode_attention itself for decode steps; on
    CUDA the model calls triton_attention.triton_paged_attention instead).
    """
    check_options(sliding_window, logit_softcap)
    opts = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    if q.device.type == "cpu" and load_cpu_kernels():
        return torch.ops.wattserve.paged_attention(
            q, k_cache, v_cache, block_tables, query_start, context_lens, scale, **opts
        )
    return paged_attention_torch(
        q, k_cache, v_cache, block_tables, query_start, context_lens, scale, **opts
    )


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    host_query_start: list[int] | None = None,
    host_context_lens: list[int] | None = None,
    batch_decodes: bool | None = None,
) -> torch.Tensor:
    """paged_attention in plain torch: each sequence's context gathered, then SDPA.

    host_query_start / host_context_lens: the same bounds as host lists when the caller has
    them; then nothing is read back from the device (each .tolist() is a sync on CUDA).
    batch_decodes: the step's leading one-token sequences (the scheduler puts its decodes
    first) go through paged_decode_attention in one call, the rest one SDPA call each. On
    by default off the CPU, where each call costs several kernel launches (a mixed step of
    64 decodes was 64 calls a layer, most of its time); off on the CPU, where a call costs
    little and the batched gather copies every row to the widest table.
    """
    check_options(sliding_window, logit_softcap)
    if batch_decodes is None:
        batch_decodes = q.device.type != "cpu"
    bs = k_cache.shape[1]
    starts = query_start.tolist() if host_query_start is None else host_query_start
    lens = context_lens.tolist() if host_context_lens is None else host_context_lens
    parts = []
    decodes = 0
    while batch_decodes and decodes < len(lens) and starts[decodes + 1] - starts[decodes] == 1:
        decodes += 1
    if decodes > 1:
        width = -(-max(lens[:decodes]) // bs)
        parts.append(
            paged_decode_attention(
                q.narrow(0, starts[0], decodes),
                k_cache,
                v_cache,
                block_tables.narrow(0, 0, decodes).narrow(1, 0, width),
                context_lens.narrow(0, 0, decodes),
                scale,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        )
    else:
        decodes = 0
    for b in range(decodes, len(lens)):
        ctx = lens[b]
        q0, q1 = starts[b], starts[b + 1]
        n = q1 - q0
        # narrow, not Python indexing (see norm_rope.apply_rope)
        table = block_tables.select(0, b).narrow(0, 0, -(-ctx // bs))
        k = _gather(k_cache, table, ctx)  # [1, KVH, ctx, D]
        v = _gather(v_cache, table, ctx)
        mask = None
        windowed = sliding_window is not None and ctx > sliding_window
        if (n > 1 and ctx > n) or windowed:  # causal from the chunk's offset, or a window
            keys = torch.arange(ctx, device=q.device)
            q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
            mask = keys <= q_pos
            if windowed:
                mask = mask & (q_pos - keys < sliding_window)
        qh = q.narrow(0, q0, n).transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        o = _sdpa(qh, k, v, mask, n > 1 and mask is None, scale, logit_softcap)
        parts.append(o.squeeze(0).transpose(0, 1))
    # one cat, not copies into an output: copy_ between CUDA tensors needs the CUDA library,
    # which a fake-CUDA trace on a CPU-only torch does not have
    return torch.cat(parts) if parts else torch.empty_like(q)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence (a decode step), with shapes fixed by the inputs' shapes
    alone: no value is read back to the host, so a CUDA graph can capture it.

    q: [B, H, D], the token of sequence b at position context_lens[b] - 1 (its K/V already
    written); block_tables: [B, NB] int64, padded with any valid block id; context_lens: [B]
    int64, each >= 1. Returns [B, H, D]. Every row gathers its NB blocks (NB * block_size
    keys) and masks the keys past its length: a copy that grows with the table width, which
    is why the CUDA-graph runner buckets the width too.
    """
    b, nb = block_tables.shape
    bs, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    flat = block_tables.reshape(-1)
    k = k_cache.index_select(0, flat).view(b, nb * bs, kvh, d).transpose(1, 2)  # [B, KVH, L, D]
    v = v_cache.index_select(0, flat).view(b, nb * bs, kvh, d).transpose(1, 2)
    keys = torch.arange(nb * bs, device=q.device).unsqueeze(0)
    lens = context_lens.unsqueeze(1)
    mask = keys < lens
    if sliding_window is not None:  # the query sits at lens - 1
        mask = mask & (keys > lens - 1 - sliding_window)
    o = _sdpa(
        q.unsqueeze(2), k, v, mask.view(b, 1, 1, nb * bs), False, scale, logit_softcap
    )  # [B, H, 1, D]
    return o.squeeze(2)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    logit_softcap: float | None,
) -> torch.Tensor:
    """SDPA over q [B, H, n, D] and k, v [B, KVH, L, D] (grouped heads); a soft-cap, which
    SDPA has no argument for, takes the explicit float32 formula."""
    if logit_softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(groups, dim=1)
    vf = v.float().repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if is_causal:
        n, length = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), vf).to(q.dtype)


def attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: list[int],
    q_positions: list[int],
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Plain causal attention for one sequence, reading its cache token by token.

    q: [T, H, D] at absolute positions q_positions; returns [T, H, D] in float32.
    """
    check_options(sliding_window, logit_softcap)
    bs = k_cache.shape[1]
    ctx = max(q_positions) + 1
    slots = [(block_table[p // bs], p % bs) for p in range(ctx)]
    k = torch.stack([k_cache[b, o] for b, o in slots]).float()  # [ctx, KVH, D]
    v = torch.stack([v_cache[b, o] for b, o in slots]).float()
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # [ctx, H, D]
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,chd->htc", q.float(), k) * scale  # [H, T, ctx]
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    dev = q.device
    keys = torch.arange(ctx, device=dev).unsqueeze(0)
    q_pos = torch.tensor(q_positions, device=dev).unsqueeze(1)
    allowed = keys <= q_pos
    if sliding_window is not None:
        allowed = allowed & (q_pos - keys < sliding_window)
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("htc,chd->thd", probs, v)
