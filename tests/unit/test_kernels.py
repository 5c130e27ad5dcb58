"""Each kernel against its plain-torch reference, within stated tolerances."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from wattserve_kernels.attention import (
    attention_reference,
    decode_attention_mask,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_attention_mask,
    write_kv,
)
from wattserve_kernels.linear import Linear
from wattserve_kernels.norm_rope import (
    RotaryTable,
    apply_rope,
    apply_rope_reference,
    rms_norm,
    rms_norm_reference,
)

FP32_TOL = dict(atol=1e-5, rtol=1e-4)
BF16_TOL = dict(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_rms_norm_matches_reference(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype) * 3
    w = torch.randn(96, generator=g).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), **tol)


def test_rope_matches_reference_and_preserves_norm():
    g = torch.Generator().manual_seed(1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    table = RotaryTable(inv_freq, 128)
    x = torch.randn(9, 4, 32, generator=g)
    cos, sin = table.lookup(torch.tensor([0, 1, 2, 5, 17, 64, 100, 126, 127]))
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out, apply_rope_reference(x, cos, sin), **FP32_TOL)
    # A rotation: per-pair norms are unchanged, and position 0 is the identity.
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), **FP32_TOL)
    torch.testing.assert_close(out[0], x[0], **FP32_TOL)


def _random_cache(num_blocks=24, bs=4, kvh=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, bs, kvh, d, generator=g)
    v = torch.randn(num_blocks, bs, kvh, d, generator=g)
    return k, v


def test_write_kv_puts_each_token_in_its_slot():
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5, 9, 23])  # block 1 offset 1, block 2 offset 1, block 5 offset 3
    write_kv(k_cache, v_cache, slots, k, v)
    torch.testing.assert_close(k_cache[1, 1], k[0])
    torch.testing.assert_close(v_cache[2, 1], v[1])
    torch.testing.assert_close(k_cache[5, 3], k[2])
    assert k_cache.abs().sum() == pytest.approx(k.abs().sum().item(), rel=1e-6)


def test_paged_decode_attention_matches_reference():
    k_cache, v_cache = _random_cache()
    rng = random.Random(0)
    blocks = list(range(24))
    rng.shuffle(blocks)
    lens = [1, 7, 13, 4]
    tables = [blocks[0:1], blocks[1:3], blocks[3:7], blocks[7:8]]
    q = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(3))  # [B, H, D]
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    mask = decode_attention_mask(torch.tensor(lens), width, k_cache.shape[1])
    out = paged_decode_attention(q, k_cache, v_cache, bt, mask, 0.25)
    for b in range(4):
        ref = attention_reference(q[b : b + 1], k_cache, v_cache, tables[b], [lens[b] - 1], 0.25)
        torch.testing.assert_close(out[b : b + 1], ref, **FP32_TOL)


@pytest.mark.parametrize("start", [0, 5, 8])
def test_paged_prefill_attention_matches_reference(start):
    k_cache, v_cache = _random_cache(seed=4)
    table = [9, 3, 17, 2, 11]
    n = 6
    q = torch.randn(n, 4, 16, generator=torch.Generator().manual_seed(5))
    mask = prefill_attention_mask(start, n)
    assert (mask is None) == (start == 0)
    out = paged_prefill_attention(q, k_cache, v_cache, torch.tensor(table), mask, 0.25)
    ref = attention_reference(q, k_cache, v_cache, table, list(range(start, start + n)), 0.25)
    torch.testing.assert_close(out, ref, **FP32_TOL)


@pytest.mark.parametrize("tokens", [1, 5, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(tokens, bias):
    g = torch.Generator().manual_seed(tokens)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(tokens, 80, generator=g)
    torch.testing.assert_close(Linear(w, b)(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_linear_bf16_matches_f_linear():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 48, generator=g).bfloat16()
    x = torch.randn(3, 48, generator=g).bfloat16()
    torch.testing.assert_close(Linear(w)(x).float(), F.linear(x, w).float(), **BF16_TOL)
