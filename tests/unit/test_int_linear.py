"""The integer kernel (wattserve::int_linear) against the plain-torch reference of the same
arithmetic: activations rounded to int8 per 32 in-features, codes times scales plus zeros.

Tolerance: both sides sum the same exactly-represented products; they differ only in the
order of float32 additions over the 32-groups (relative 2^-20 of |x_q| @ |W|); with bf16
activations the kernel also rounds its output to bf16 (half an ulp: at most 2^-8 of the
float32 reference's magnitude).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wattserve.kernels.int_linear import (
    dequantize_weights,
    int_linear,
    int_linear_available,
    int_linear_reference,
    pack_codes,
    quantize_activations,
    unpack_codes,
)

pytestmark = pytest.mark.skipif(
    not int_linear_available(), reason="the integer kernel needs AVX-512 VNNI and a compiler"
)

# (out, in, bits, group): out not a multiple of 16, in not of 32, groups of 32..256
CASES = [
    (1, 16, 8, 32),
    (100, 70, 8, 96),
    (33, 200, 8, 224),
    (48, 256, 4, 32),
    (130, 192, 4, 64),
    (20, 256, 4, 128),
    (16, 512, 4, 256),
]
TOKENS = [1, 3, 8, 9, 17, 40]  # row tiles of 8: full, partial, several


def _codes(out_f, in_f, bits, group, seed):
    g = torch.Generator().manual_seed(seed)
    n = -(-out_f // 16) * 16
    k = -(-in_f // group) * group
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    zeros = (torch.randn(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    return pack_codes(codes, scales, zeros, bits, group, out_f), codes


def _within(y, ref, x, w, dtype):
    xq, a = quantize_activations(x, w.shape[1])
    mag = (xq.abs().reshape(xq.shape[0], -1, 32) * a.unsqueeze(-1)).reshape(xq.shape)
    bound = (mag @ w.abs().T)[:, : ref.shape[1]] * 2.0**-20 + 1e-7
    if dtype == torch.bfloat16:
        bound = bound + ref.float().abs() * 2.0**-8
    err = (y.float() - ref.float()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("out_f,in_f,bits,group", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_its_reference(out_f, in_f, bits, group, dtype):
    w, codes = _codes(out_f, in_f, bits, group, out_f * in_f + bits)
    assert torch.equal(unpack_codes(w), codes)
    bias = torch.randn(out_f, generator=torch.Generator().manual_seed(1)).to(dtype)
    for t in TOKENS:
        x = torch.randn(t, in_f, generator=torch.Generator().manual_seed(t)).to(dtype)
        x[0, : min(3, in_f)] = torch.tensor([8.0, -5.0, 3.0])[: min(3, in_f)].to(dtype)
        for b in (None, bias):
            y = int_linear(x, w, b)
            assert y.dtype == dtype and y.shape == (t, out_f)
            b32 = None if b is None else b.float()
            ref = int_linear_reference(x.float(), w, b32)  # bf16 x is exact in float32
            _within(y, ref, x, dequantize_weights(w), dtype)


def test_zero_rows_and_zero_tokens():
    w, _ = _codes(32, 64, 8, 64, 3)
    x = torch.zeros(2, 64)
    assert torch.equal(int_linear(x, w), torch.zeros(2, 32))
    assert int_linear(torch.zeros(0, 64), w).shape == (0, 32)


def test_activation_rounding_is_what_the_reference_says():
    # A row whose values sit at half steps: the kernel rounds them half to even, as
    # torch.round does; a wrong rounding mode moves y by a whole column sum.
    w, _ = _codes(16, 32, 8, 32, 4)
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26])
    q, a = quantize_activations(x, 32)
    assert q[0, :6].tolist() == [127.0, 0.0, 2.0, 2.0, -0.0, -2.0] and a[0, 0] == 1.0
    _within(int_linear(x, w), int_linear_reference(x, w), x, dequantize_weights(w), torch.float32)


def test_a_wrong_group_scale_would_fail():
    w, _ = _codes(48, 256, 4, 32, 5)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6))
    wrong = dequantize_weights(w).roll(1, dims=1)
    q, a = quantize_activations(x, 256)
    xq = (q.reshape(4, -1, 32) * a.unsqueeze(-1)).reshape(4, 256)
    with pytest.raises(AssertionError):
        _within(int_linear(x, w), F.linear(xq, wrong)[:, :48], x, wrong, torch.float32)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(bits=5), "bits must be 8 or 4"),
        (lambda a: a.update(x=a["x"].double()), "float32 or bfloat16"),
        (lambda a: a.update(x=torch.randn(2, 300)), "packed size"),
        (lambda a: a.update(scales=a["scales"].float()), "bfloat16"),
        (lambda a: a.update(group_size=48), "group size"),
        (lambda a: a.update(out_features=40), "out-features"),
        (lambda a: a.update(bias=torch.zeros(3)), "bias"),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(change, message):
    w, _ = _codes(32, 64, 8, 64, 7)
    args = dict(
        x=torch.randn(2, 64),
        packed=w.packed,
        scales=w.scales,
        zeros=w.zeros,
        bits=8,
        group_size=64,
        out_features=32,
        bias=None,
    )
    change(args)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.wattserve.int_linear(*args.values())
