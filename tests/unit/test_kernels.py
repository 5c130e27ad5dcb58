"""Each kernel against its plain-torch reference, within stated tolerances."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from wattserve.kernels.attention import (
    attention_reference,
    paged_attention,
    paged_attention_torch,
    paged_decode_attention,
    query_tiles,
    rope_write_kv,
    write_kv,
)
from wattserve.kernels.extension import cpu_flags, load_cpu_kernels
from wattserve.kernels.linear import Linear, dense_linear_available, pack_dense
from wattserve.kernels.norm_rope import (
    RotaryTable,
    add_rms_norm,
    apply_rope,
    apply_rope_reference,
    rms_norm,
    rms_norm_reference,
    silu_mul,
    silu_mul_reference,
)

FP32_TOL = dict(atol=1e-5, rtol=1e-4)
BF16_TOL = dict(atol=3e-2, rtol=3e-2)
# The dense kernel is built for AVX-512 only: the CPU's own flags say which path serves.
CPU_AVX512 = "avx512f" in cpu_flags().split()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_rms_norm_matches_reference(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype) * 3
    w = torch.randn(96, generator=g).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), **tol)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576: split over the threads
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_fused_row_ops_match_their_references(dtype, tol, rows):
    g = torch.Generator().manual_seed(2)
    hidden = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    addend = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    torch.testing.assert_close(
        rms_norm(hidden, w, 1e-5), rms_norm_reference(hidden, w, 1e-5), **tol
    )
    residual = hidden.clone()
    out = add_rms_norm(residual, addend, w, 1e-5)
    summed = (hidden.float() + addend.float()).to(dtype)
    torch.testing.assert_close(residual, summed, **tol)  # the residual is updated in place
    torch.testing.assert_close(out, rms_norm_reference(summed, w, 1e-5), **tol)
    gate_up = (torch.randn(rows, 2 * 96, generator=g) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamped range and zero
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_reference(gate_up), **tol)


def test_the_fused_row_ops_run_the_cpu_kernels_here():
    assert load_cpu_kernels()
    x = torch.randn(4, 64)
    w = torch.randn(64)
    torch.testing.assert_close(
        torch.ops.wattserve.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), **FP32_TOL
    )
    gu = torch.randn(4, 32)
    torch.testing.assert_close(torch.ops.wattserve.silu_mul(gu), silu_mul_reference(gu), **FP32_TOL)


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


# (block size, KV heads, query heads, head dim): a small shape the C++ kernel serves
# row by row, and the shapes its tiled path serves (block 16, head dim 64 or 128) with
# three and two query heads per KV head.
SHAPES = {"small": (4, 2, 4, 16), "smollm2": (16, 3, 9, 64), "hd128": (16, 2, 4, 128)}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_rope_write_kv_rotates_q_and_k_and_stores_k_and_v(dtype, tol):
    heads, kv_heads, d, t = 9, 3, 64, 21
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.randint(0, 200, (t,), generator=g)
    cos, sin = RotaryTable(inv_freq, 256, dtype=dtype).lookup(positions)
    slots = torch.randperm(6 * 16, generator=g)[:t]
    k_cache, v_cache = (
        torch.zeros(6, 16, kv_heads, d, dtype=dtype),
        torch.zeros(6, 16, kv_heads, d, dtype=dtype),
    )
    q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    assert q.shape == (t, heads, d)
    rows = qkv.float().view(t, heads + 2 * kv_heads, d)
    rotated = apply_rope_reference(rows[:, : heads + kv_heads], cos.float(), sin.float())
    torch.testing.assert_close(q.float(), rotated[:, :heads], **tol)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    torch.testing.assert_close(flat_k[slots].float(), rotated[:, heads:], **tol)
    torch.testing.assert_close(flat_v[slots].float(), rows[:, heads + kv_heads :], **tol)
    untouched = torch.ones(6 * 16, dtype=torch.bool)
    untouched[slots] = False
    assert (flat_k[untouched] == 0).all() and (flat_v[untouched] == 0).all()


def test_rope_write_kv_refuses_a_slot_outside_the_cache():
    assert load_cpu_kernels()
    qkv = torch.randn(2, 5 * 16)
    cos = sin = torch.ones(2, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.wattserve.rope_write_kv(
            qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 8]), 3, 1
        )


def _mixed_step(seed: int, dtype: torch.dtype, shape: str = "small"):
    """A step of sequences on a shuffled pool: decodes (one query after a context),
    a prefill from position 0, and chunks after cached tokens, some longer than a query
    tile of the C++ kernel (16) and ending inside a block. Returns the kernel's arguments
    and each sequence's (block table, query positions)."""
    bs, kvh, heads, d = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(64, bs, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(64, bs, kvh, d, generator=g).to(dtype)
    rng = random.Random(seed)
    blocks = list(range(64))
    rng.shuffle(blocks)
    bs = k_cache.shape[1]
    # (cached tokens before the queries, query tokens)
    shapes = [(0, 1), (12, 1), (0, 21), (8, 6), (5, 40)]
    if bs > 4:
        shapes += [(40, 3), (0, 70), (33, 1), (17, 50)]
    seqs, q_rows, used = [], 0, 0
    for cached, n in shapes:
        ctx = cached + n
        nb = -(-ctx // bs)
        seqs.append((blocks[used : used + nb], list(range(cached, ctx)), q_rows))
        used += nb
        q_rows += n
    q = torch.randn(q_rows, heads, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    width = max(len(t) for t, _, _ in seqs)
    bt = torch.tensor([t + [blocks[-1]] * (width - len(t)) for t, _, _ in seqs])
    query_start = torch.tensor([r for _, _, r in seqs] + [q_rows])
    context_lens = torch.tensor([pos[-1] + 1 for _, pos, _ in seqs])
    return (q, k_cache, v_cache, bt, query_start, context_lens), seqs


IMPLEMENTATIONS = {
    "dispatch": paged_attention,
    "torch": functools.partial(paged_attention_torch, batch_decodes=False),
    # as off the CPU: the leading decodes in one paged_decode_attention call
    "torch_batched_decodes": functools.partial(paged_attention_torch, batch_decodes=True),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_paged_attention_matches_reference(impl, dtype, tol, shape):
    args, seqs = _mixed_step(seed=3, dtype=dtype, shape=shape)
    q, k_cache, v_cache = args[:3]
    out = IMPLEMENTATIONS[impl](*args, 0.25)
    assert out.shape == q.shape and out.dtype == dtype
    for table, positions, row in seqs:
        rows = slice(row, row + len(positions))
        ref = attention_reference(q[rows], k_cache, v_cache, table, positions, 0.25)
        torch.testing.assert_close(out[rows].float(), ref, **tol)


def test_query_tiles_cover_every_query_row_once_in_a_count_fixed_by_the_shapes():
    # chunks of 1, 16, 17, 0 (an empty chunk has no tile) and 33 query tokens
    starts = [0, 1, 17, 34, 34, 67]
    flat = query_tiles(starts, tile=16)
    pairs = list(zip(flat[::2], flat[1::2], strict=True))
    assert len(pairs) == 67 // 16 + 5  # T // tile + B, whatever the chunk lengths
    live = [p for p in pairs if p[0] >= 0]
    assert live == [(0, 0), (1, 0), (2, 0), (2, 16), (4, 0), (4, 16), (4, 32)]
    assert pairs[len(live) :] == [(-1, 0)] * (len(pairs) - len(live))
    rows = sorted(starts[s] + f + i for s, f in live for i in range(16)
                  if f + i < starts[s + 1] - starts[s])
    assert rows == list(range(67))
    # the worst case for the cap: every chunk one token past a tile
    worst = [0, 17, 34, 51]
    assert len(query_tiles(worst, tile=16)) // 2 == 51 // 16 + 3 == 6


def test_paged_attention_torch_with_host_bounds_reads_nothing_back(monkeypatch):
    args, _ = _mixed_step(seed=4, dtype=torch.float32)
    q, k_cache, v_cache, bt, query_start, context_lens = args
    expected = paged_attention_torch(*args, 0.25)
    host_query_start, host_context_lens = query_start.tolist(), context_lens.tolist()

    def read_back(*_args, **_kwargs):
        raise AssertionError("a tensor was read back to the host (a sync on CUDA)")

    # Bounds given as host lists: no tensor is read back (each read is a sync on CUDA).
    for name in ("tolist", "item", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, read_back)
    out = paged_attention_torch(
        q,
        k_cache,
        v_cache,
        bt,
        query_start.neg(),  # the device copy of the starts is not used at all
        context_lens,
        0.25,
        host_query_start=host_query_start,
        host_context_lens=host_context_lens,
    )
    monkeypatch.undo()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_paged_decode_attention_matches_reference(dtype, tol):
    k_cache, v_cache = _random_cache(num_blocks=32, seed=7)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    bs = k_cache.shape[1]
    rng = random.Random(7)
    blocks = list(range(32))
    rng.shuffle(blocks)
    lengths = [1, bs, bs + 1, 3 * bs - 2]  # one token, a full block, past a block edge
    tables, used = [], 0
    for n in lengths:
        nb = -(-n // bs)
        tables.append(blocks[used : used + nb])
        used += nb
    width = max(len(t) for t in tables) + 1  # wider than any row: padding is masked
    bt = torch.tensor([t + [blocks[-1]] * (width - len(t)) for t in tables])
    q = torch.randn(len(lengths), 4, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(lengths), 0.25)
    assert out.shape == q.shape and out.dtype == dtype
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        ref = attention_reference(q[b : b + 1], k_cache, v_cache, table, [n - 1], 0.25)
        torch.testing.assert_close(out[b : b + 1].float(), ref, **tol)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_cpu_kernel_is_built_here_and_serves_the_dispatch(shape):
    # make test runs on a machine with g++: the fast path must really be the one tested.
    assert load_cpu_kernels()
    args, _ = _mixed_step(seed=5, dtype=torch.float32, shape=shape)
    torch.testing.assert_close(
        torch.ops.wattserve.paged_attention(*args, 0.25),
        paged_attention_torch(*args, 0.25),
        **FP32_TOL,
    )


def _direct_softmax(q, k_cache, v_cache, table, positions, scale, window, softcap):
    """The attention formula written out per (query, head) in float64, as a check on
    attention_reference: softmax over the keys j <= i with i - j < window of the
    (soft-capped) scaled dot products, then the weighted sum of the values."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    groups = q.shape[1] // kvh
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, i in enumerate(positions):
        keys = [j for j in range(i + 1) if window is None or i - j < window]
        for h in range(q.shape[1]):
            ks = [k_cache[table[j // bs], j % bs, h // groups].double() for j in keys]
            vs = [v_cache[table[j // bs], j % bs, h // groups].double() for j in keys]
            scores = [float(q[t, h].double() @ kj) * scale for kj in ks]
            if softcap is not None:
                scores = [softcap * math.tanh(x / softcap) for x in scores]
            top = max(scores)
            weights = [math.exp(x - top) for x in scores]
            total = sum(weights)
            for w, vj in zip(weights, vs, strict=True):
                out[t, h] += w / total * vj
    return out


OPTIONS = {  # (scale, sliding_window, logit_softcap): Llama, Mistral, Gemma 2, both at once
    "plain": (0.25, None, None),
    "window": (0.25, 5, None),
    "softcap": (0.6, None, 1.5),
    "window_softcap": (0.1, 7, 0.8),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_reference_matches_the_direct_softmax_formula(option):
    scale, window, softcap = OPTIONS[option]
    k_cache, v_cache = _random_cache(num_blocks=8, seed=12)
    table = [5, 2, 7, 0]
    positions = [0, 3, 4, 9, 10, 11, 14]  # decode-like rows and a chunk after cached ones
    q = torch.randn(len(positions), 4, 16, generator=torch.Generator().manual_seed(12))
    opts = dict(sliding_window=window, logit_softcap=softcap)
    ref = attention_reference(q, k_cache, v_cache, table, positions, scale, **opts)
    direct = _direct_softmax(q, k_cache, v_cache, table, positions, scale, window, softcap)
    torch.testing.assert_close(ref.double(), direct, **FP32_TOL)
    if window is not None or softcap is not None:  # the options change the result
        plain = attention_reference(q, k_cache, v_cache, table, positions, scale)
        assert not torch.allclose(ref, plain, **FP32_TOL)


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("shape", ["small", "smollm2"])
@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_paged_attention_options_match_reference(impl, shape, option, dtype, tol):
    # Decodes, a prefill from 0 and chunks after cached tokens in one mixed step, with
    # windows shorter than most contexts (some rows lose whole blocks, some none).
    scale, window, softcap = OPTIONS[option]
    args, seqs = _mixed_step(seed=8, dtype=dtype, shape=shape)
    q, k_cache, v_cache = args[:3]
    opts = dict(sliding_window=window, logit_softcap=softcap)
    out = IMPLEMENTATIONS[impl](*args, scale, **opts)
    assert out.shape == q.shape and out.dtype == dtype
    for table, positions, row in seqs:
        rows = slice(row, row + len(positions))
        ref = attention_reference(q[rows], k_cache, v_cache, table, positions, scale, **opts)
        torch.testing.assert_close(out[rows].float(), ref, **tol)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_paged_decode_attention_options_match_reference(option):
    scale, window, softcap = OPTIONS[option]
    k_cache, v_cache = _random_cache(num_blocks=16, seed=9)
    lengths, tables = [1, 4, 9, 14], [[3], [8], [1, 12, 6], [0, 2, 15, 4]]
    bt = torch.tensor([t + [7] * (4 - len(t)) for t in tables])
    q = torch.randn(len(lengths), 4, 16, generator=torch.Generator().manual_seed(9))
    opts = dict(sliding_window=window, logit_softcap=softcap)
    out = paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(lengths), scale, **opts)
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        ref = attention_reference(q[b : b + 1], k_cache, v_cache, table, [n - 1], scale, **opts)
        torch.testing.assert_close(out[b : b + 1], ref, **FP32_TOL)


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize(
    "opts,match",
    [(dict(sliding_window=0), "sliding_window"), (dict(logit_softcap=0.0), "logit_softcap")],
)
def test_paged_attention_refuses_an_empty_window_or_a_zero_softcap(impl, opts, match):
    args, _ = _mixed_step(seed=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        IMPLEMENTATIONS[impl](*args, 0.25, **opts)


def test_the_cpu_kernel_refuses_an_empty_window():
    assert load_cpu_kernels()
    args, _ = _mixed_step(seed=8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="sliding_window"):
        torch.ops.wattserve.paged_attention(*args, 0.25, sliding_window=0)


@pytest.mark.parametrize("tokens", [1, 5, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(tokens, bias):
    g = torch.Generator().manual_seed(tokens)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(tokens, 80, generator=g)
    torch.testing.assert_close(Linear(w, b)(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("out_features,in_features", [(50, 40), (8, 3), (64, 33), (200, 24)])
@pytest.mark.parametrize("tokens", [1, 13, 25, 37])
def test_dense_kernel_matches_f_linear_on_partial_panels(out_features, in_features, tokens):
    # Output counts that end inside a 32-column panel (both halves, or the first only), one
    # row over groups of four panels and the panels left over, and row counts that split
    # into unequal register tiles.
    g = torch.Generator().manual_seed(out_features * 100 + tokens)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(tokens, in_features, generator=g)
    layer = Linear(w, b)
    # The dense kernel where the CPU has AVX-512; elsewhere the packed library layout
    # serves the same shapes (checked against F.linear all the same).
    assert layer.kind == ("dense" if CPU_AVX512 else "onednn")
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(Linear(w)(x), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_dense_kernel_gives_a_row_the_same_bits_in_any_batch():
    # A request's logits must not depend on what else shares its step (greedy outputs and
    # logprobs equal with and without overlap, preemption, batching): every row sums its
    # in-features in one order whatever tile it lands in.
    g = torch.Generator().manual_seed(11)
    w = torch.randn(230, 96, generator=g)  # 8 panels, the last partial
    x = torch.randn(40, 96, generator=g)
    layer = Linear(w)
    whole = layer(x)
    for rows in (1, 2, 3, 5, 13, 27):
        assert torch.equal(layer(x[:rows]), whole[:rows]), rows
        assert torch.equal(layer(x[-rows:]), whole[-rows:]), rows


def test_dense_kernel_serves_float32_here_and_refuses_bad_arguments():
    # On an AVX-512 CPU the fast path must really be the one tested; on one without it
    # the kernel says so and refuses to run (Linear then takes the packed library path).
    assert load_cpu_kernels()
    assert dense_linear_available() is CPU_AVX512
    w = torch.randn(40, 16)
    packed = pack_dense(w)
    assert packed.shape == (2, 16, 32) and torch.equal(packed[1, :, 8:], torch.zeros(16, 24))
    if not CPU_AVX512:
        with pytest.raises(RuntimeError, match="without AVX-512"):
            torch.ops.wattserve.dense_linear(torch.randn(2, 16), packed, None, 40)
        return
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.wattserve.dense_linear(torch.randn(2, 15), packed, None, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.wattserve.dense_linear(torch.randn(2, 16), packed, None, 80)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.wattserve.dense_linear(torch.randn(2, 16).bfloat16(), packed, None, 40)


def test_linear_bf16_matches_f_linear():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 48, generator=g).bfloat16()
    x = torch.randn(3, 48, generator=g).bfloat16()
    torch.testing.assert_close(Linear(w)(x).float(), F.linear(x, w).float(), **BF16_TOL)


@pytest.mark.parametrize("vocab", [5, 16, 37, 2500])
def test_greedy_rows_takes_the_first_argmax_and_fails_bad_rows(vocab):
    # The vector loop and the tail (vocabularies below, at and past 16 lanes): a tie goes
    # to the first index as torch's argmax; a NaN, a +inf or no finite value gives -1.
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=g)
    x[1, 0] = x[1, vocab - 1] = 50.0
    x[2, vocab // 2] = float("nan")
    x[3, vocab - 1] = float("inf")
    x[4] = float("-inf")
    x[5, : vocab // 2] = float("-inf")
    x[6, vocab - 1] = 60.0  # the maximum in the tail
    expected = x.argmax(dim=-1)
    expected[2:5] = -1
    got = torch.ops.wattserve.greedy_rows(x)
    assert got.dtype == torch.long and got.tolist() == expected.tolist()
    assert got[1] == 0
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.wattserve.greedy_rows(x.double())
