"""Seeded next-token sampling on the device: one Triton launch for the whole batch.

`torch.ops.wattserve.triton_sample_ids(logits, temperature, top_k, top_p, min_p, seed, step)`
takes float32 logits [N, V] and one value per row of each parameter (device tensors: float32
temperature, int32 top_k, float32 top_p and min_p, int64 seed and step) and returns (ids
int64 [N], logprob float32 [N]): each row's token, -1 where the row holds a NaN, a +inf or no
finite logit (logprob NaN there), and the token's log-probability under the row's logits
before temperature (log_softmax, as the engine reports logprobs).

A row with temperature <= 0 takes its first argmax. Any other row keeps the tokens that
top-k, top-p and min-p leave, with the CPU sampler's rules (sampler.py): top-k first, top-p
and min-p over the probabilities at temperature renormalised over the top k, a token kept
when the mass strictly above it is below top_p, and when its probability is at least min_p
times the top one's. top_k <= 0 or >= V, top_p >= 1 and min_p <= 0 are off. Every kept set
is the tokens at or above a logit threshold (tokens tied with the last kept one are kept
too, where sort-based top-k cuts ties at k): min-p's comes in closed form, top-k's and
top-p's by a search over the float32 order of the threshold that tests 16 thresholds a
pass over the row (a count, or a mass above each) and stops once at most one logit lies
between its bounds (3 to 8 passes for 16 to 150,000 tokens): no sort, and no second
launch. The token is then the kept one with the largest logit / temperature + Gumbel noise
(the Gumbel-max draw), the noise from Philox keyed by the row's seed with the token index
and the row's step as counter: a request's tokens depend on its seed and step alone, not
on its row or the rows beside it.

The grid is one program per row and nothing is read back, so a CUDA graph can capture the
call. It does not process logits (penalties, bans and grammar masks come before) and it
does not choose where it runs (device_sampler.py does). Importing needs triton; the kernel
runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (set before import), which the tests
use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_KEY_NEG_INF = tl.constexpr(-2139095041)  # _key(-inf): the bits 0xFF800000 flipped


@triton.jit
def _key(x):
    """float32 -> int64 with the same order (the sign-magnitude bits flipped below zero)."""
    b = x.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.int64)


@triton.jit
def _unkey(k):
    """The float32 whose _key is k."""
    b = k.to(tl.int32)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.float32, bitcast=True)


@triton.jit
def _probe_scan(row_ptr, vocab, probes, top, inv_t, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over a row for P probe logits at once: count(x >= probe) per probe, or with
    MASS count(x > probe) and mass(x > probe) (at temperature, unnormalised)."""
    cols = tl.arange(0, BLOCK)
    v = probes[None, :]
    counts = tl.zeros((BLOCK, probes.shape[0]), tl.int32)
    mass = tl.zeros((BLOCK, probes.shape[0]), tl.float32)
    for start in range(0, vocab, BLOCK):
        at = start + cols
        x = tl.load(row_ptr + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
        x2 = x[:, None]
        if MASS:
            gt = x2 > v
            counts += gt.to(tl.int32)
            mass += tl.where(gt, tl.exp((x2 - top) * inv_t), 0.0)
        else:
            counts += (x2 >= v).to(tl.int32)
    return tl.sum(counts, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _pick(vec, j, at):
    """vec[at] for a vector vec indexed by j (a where and a sum: no dynamic indexing)."""
    return tl.sum(tl.where(j == at, vec, 0), axis=0)


@triton.jit
def _sample_kernel(
    logits,
    temperature,
    top_k,
    top_p,
    min_p,
    seed,
    step,
    ids_out,
    logprob_out,
    stride,
    vocab,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    PROBES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits + row * stride
    cols = tl.arange(0, BLOCK)
    t = tl.load(temperature + row)
    k = tl.load(top_k + row)
    p = tl.load(top_p + row)
    mp = tl.load(min_p + row)
    neg_inf = float("-inf")

    # Pass 1: the maximum and its first index, the least finite logit and the finite count,
    # and whether a NaN or a +inf is there.
    best = tl.full((BLOCK,), neg_inf, tl.float32)
    best_at = tl.full((BLOCK,), 0, tl.int32)
    least = tl.full((BLOCK,), float("inf"), tl.float32)
    n_finite = tl.zeros((BLOCK,), tl.int32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, vocab, BLOCK):
        at = start + cols
        x = tl.load(row_ptr + at, mask=at < vocab, other=neg_inf).to(tl.float32)
        bad = bad | (x != x).to(tl.int32) | (x == float("inf")).to(tl.int32)
        finite = x > neg_inf
        n_finite += finite.to(tl.int32)
        least = tl.minimum(least, tl.where(finite, x, float("inf")))
        better = x > best
        best_at = tl.where(better, at, best_at)
        best = tl.where(better, x, best)
    top = tl.max(best, axis=0)
    argmax = tl.min(tl.where(best == top, best_at, vocab), axis=0)
    ok = (tl.max(bad, axis=0) == 0) & (top > neg_inf)
    top = tl.where(ok, top, 0.0)  # a failing row's NaN or inf stays out of the arithmetic
    least = tl.min(least, axis=0)
    sampling = ok & (t > 0.0)
    inv_t = tl.where(sampling, 1.0 / tl.where(sampling, t, 1.0), 1.0)
    j = tl.arange(0, PROBES)
    j64 = j.to(tl.int64)

    # top-k: the largest threshold with at least k logits at or above it, searched over
    # the float32 order with PROBES thresholds a pass; stops once one logit is left between
    # the bounds. lo holds >= k logits, hi fewer.
    lo = _key(least)
    hi = _key(top) + 1
    searching = sampling & (k > 0) & (k < tl.sum(n_finite, axis=0))
    thr_k = tl.where(searching, least, neg_inf)
    while searching:
        keys = lo + ((hi - lo) * j64) // (PROBES - 1)
        n_ge, _mass = _probe_scan(row_ptr, vocab, _unkey(keys), top, inv_t, False, SEARCH_BLOCK)
        holds = ((n_ge >= k) | (j == 0)) & (j < PROBES - 1)
        at = tl.max(tl.where(holds, j, 0), axis=0)
        lo = _pick(keys, j, at)
        hi = _pick(keys, j, at + 1)
        n_lo = _pick(n_ge, j, at)
        searching = (n_lo != k) & (n_lo - _pick(n_ge, j, at + 1) > 1) & (hi - lo > 1)
        thr_k = _unkey(lo)

    # min-p: p_i >= min_p * p_top  <=>  x_i >= top + T * log(min_p).
    thr_m = tl.where(mp > 0.0, top + t * tl.log(tl.maximum(mp, 1e-30)), neg_inf)
    floor = tl.maximum(tl.maximum(thr_k, thr_m.to(tl.float32)), least)

    # top-p: token i is kept iff the mass above it is below top_p of the top k's mass, so
    # the kept ones are those above the largest threshold lo with mass(x > lo) >= target.
    thr = floor
    use_p = sampling & (p < 1.0)
    z_k = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, tl.where(use_p, vocab, 0), BLOCK):
        at = start + cols
        x = tl.load(row_ptr + at, mask=at < vocab, other=neg_inf).to(tl.float32)
        z_k += tl.where(x >= thr_k, tl.exp((x - top) * inv_t), 0.0)
    target = p * tl.sum(z_k, axis=0)
    lo = _key(floor)
    hi = _key(top)  # mass above 0 < target (a top_p this small keeps the best)
    searching = use_p & (hi > lo)
    while searching:
        keys = lo + ((hi - lo) * j64) // (PROBES - 1)
        n_gt, mass_gt = _probe_scan(row_ptr, vocab, _unkey(keys), top, inv_t, True, SEARCH_BLOCK)
        below = (mass_gt < target) | (j == PROBES - 1)
        at = tl.min(tl.where(below, j, PROBES), axis=0)
        # at 0 the mass above the floor is already below the target: the floor stays
        moved = at > 0
        lo = tl.where(moved, _pick(keys, j, at - 1), lo)
        hi = tl.where(moved, _pick(keys, j, at), hi)
        thr = tl.where(moved, _unkey(lo + 1), thr)  # the next float32 above lo
        inside = _pick(n_gt, j, at - 1) - _pick(n_gt, j, at)
        searching = moved & (inside > 1) & (hi - lo > 1)

    # Last pass: Gumbel-max over the kept tokens, and the row's log-sum-exp at temperature 1.
    seed_v = tl.load(seed + row)
    step_v = tl.load(step + row)
    zero = tl.zeros((BLOCK,), tl.uint32)
    step_lo = zero + (step_v & 0xFFFFFFFF).to(tl.uint32)
    step_hi = zero + ((step_v >> 32) & 0xFFFFFFFF).to(tl.uint32)
    score_best = tl.full((BLOCK,), float("-inf"), tl.float32)
    score_at = tl.full((BLOCK,), 0, tl.int32)
    raw = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        at = start + cols
        x = tl.load(row_ptr + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
        raw += tl.exp(x - top)
        r, _r1, _r2, _r3 = tl.philox(seed_v, at.to(tl.uint32), step_lo, step_hi, zero)
        u = tl.uint_to_uniform_float(r)
        score = tl.where(x >= thr, (x - top) * inv_t - tl.log(-tl.log(u)), neg_inf)
        better = score > score_best
        score_at = tl.where(better, at, score_at)
        score_best = tl.where(better, score, score_best)
    s_top = tl.max(score_best, axis=0)
    drawn = tl.min(tl.where(score_best == s_top, score_at, vocab), axis=0)
    pick = tl.where(sampling & (s_top > neg_inf), drawn, argmax)
    chosen = tl.load(row_ptr + pick, mask=ok, other=0.0).to(tl.float32)
    logprob = chosen - top - tl.log(tl.sum(raw, axis=0))
    tl.store(ids_out + row, tl.where(ok, pick, -1).to(tl.int64))
    tl.store(logprob_out + row, tl.where(ok, logprob, float("nan")))


_BLOCK_MAX = 2048
# A search pass tests _PROBES thresholds on [_SEARCH_BLOCK, _PROBES] tiles: 4 bits of the
# float32 order a pass (3 to 8 passes for top-k or top-p over 16 to 150,000 tokens).
_PROBES = 16
_SEARCH_BLOCK = 256


def kernel_config(vocab: int) -> tuple[dict[str, int], int]:
    """The kernel's constexprs and num_warps for rows of `vocab` logits."""
    block = min(triton.next_power_of_2(vocab), _BLOCK_MAX)
    constexprs = dict(BLOCK=block, SEARCH_BLOCK=min(block, _SEARCH_BLOCK), PROBES=_PROBES)
    return constexprs, 8 if block >= 2048 else 4


def _sample_ids(logits, temperature, top_k, top_p, min_p, seed, step):
    n, vocab = logits.shape
    ids = torch.empty(n, dtype=torch.long, device=logits.device)
    logprob = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        constexprs, num_warps = kernel_config(vocab)
        _sample_kernel[(n,)](
            logits,
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            step,
            ids,
            logprob,
            logits.stride(0),
            vocab,
            num_warps=num_warps,
            **constexprs,
        )
    return ids, logprob


_LIB = torch.library.Library("wattserve", "FRAGMENT")
_LIB.define(
    "triton_sample_ids(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
    "Tensor min_p, Tensor seed, Tensor step) -> (Tensor, Tensor)"
)
for _key_name in ("CUDA", "CPU"):  # the CPU under TRITON_INTERPRET=1 only
    _LIB.impl("triton_sample_ids", _sample_ids, _key_name)


@torch.library.register_fake("wattserve::triton_sample_ids")
def _(logits, temperature, top_k, top_p, min_p, seed, step):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.long), logits.new_empty((n,))
