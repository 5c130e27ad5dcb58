"""The Triton int8 linear and fp8 activation scaling (triton_quant.py), through Int8Linear
and Fp8Linear's CUDA path, against the dequantize-then-matmul references; run by triton's
interpreter on the CPU in one subprocess (cases in triton_quant_cases.py).

Bounds as test_quant.py states them: the int8 kernel rounds x to bf16 and its output to the
output dtype, accumulating exact products in fp32 (2^-7 * |x| @ |W|.T); fp8 rounds each
activation to e4m3 against its row's scale (2^-3 * |x| @ |W|.T). The bias, added before the
output's one rounding, costs |b| * 2^-7: the interpreter's float32 -> bf16 store truncates
(CUDA's rounds to nearest, 2^-9).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.triton_interpret import interpreted_outputs
from tests.unit.triton_quant_cases import DTYPES, SHAPES, TOKENS, activations, weights
from wattserve.kernels.quant import dequantize_int8, quantize_fp8, quantize_int8

pytest.importorskip("triton", reason="triton is not installed (the test extras pin it)")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    return interpreted_outputs(
        "tests.unit.triton_quant_cases", tmp_path_factory.mktemp("triton_quant")
    )


def _within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (y.float() - ref).abs()
    assert bool((err <= bound + 1e-6).all()), f"max excess {(err - bound).max().item()}"


def _fp8_weight(shape: str) -> torch.Tensor:
    """The dequantized fp8 weight [out, in], as Fp8Linear builds it (padded to 16s)."""
    w, _ = weights(shape)
    out_f, in_f = w.shape
    padded = F.pad(w, (0, -in_f % 16, 0, -out_f % 16))
    w8, scale = quantize_fp8(padded)
    return w8[:out_f, :in_f].float() * scale


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_cuda_path_is_the_triton_one(outputs, shape):
    assert outputs[f"uses_triton/{shape}"] == (True, True)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("dname", sorted(DTYPES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_int8_linear_matches_dequantized_reference(outputs, shape, dname, t):
    w, b = weights(shape)
    w_deq = dequantize_int8(*quantize_int8(w))
    x = activations(shape, t, DTYPES[dname])
    y = outputs[f"int8/{shape}/{dname}/{t}"]
    assert y.dtype == x.dtype and y.shape == (t, w.shape[0])
    ref = F.linear(x.float(), w_deq, b)
    _within(y, ref, 2.0**-7 * (x.float().abs() @ w_deq.abs().T + b.abs()))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_int8_linear_without_bias_and_a_wrong_scale_would_fail(outputs, shape):
    w, _ = weights(shape)
    q, scales = quantize_int8(w)
    x = activations(shape, 5, torch.bfloat16)
    y = outputs[f"int8_no_bias/{shape}"]
    bound = 2.0**-7 * (x.float().abs() @ dequantize_int8(q, scales).abs().T)
    _within(y, F.linear(x.float(), dequantize_int8(q, scales)), bound)
    with pytest.raises(AssertionError):  # the bound catches a scale on the wrong channel
        _within(y, F.linear(x.float(), dequantize_int8(q, scales.roll(1))), bound)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("dname", sorted(DTYPES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_linear_matches_dequantized_reference(outputs, shape, dname, t):
    w, b = weights(shape)
    w_deq = _fp8_weight(shape)
    x = activations(shape, t, DTYPES[dname])
    y = outputs[f"fp8/{shape}/{dname}/{t}"]
    assert y.dtype == x.dtype and y.shape == (t, w.shape[0])
    ref = F.linear(x.float(), w_deq, b)
    _within(y, ref, 2.0**-3 * (x.float().abs() @ w_deq.abs().T) + b.abs() * 2.0**-7)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_rows_scale_each_row_by_its_amax_and_pad_with_zeros(outputs, shape):
    x = activations(shape, 5, torch.bfloat16).float()
    codes, scale = outputs[f"fp8_rows/{shape}"]
    k = x.shape[1]
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (5, k + (-k % 16))
    assert scale.dtype == torch.float32 and scale.shape == (5, 1)
    amax = x.abs().amax(dim=1, keepdim=True)
    expected = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    torch.testing.assert_close(scale, expected, atol=0, rtol=2**-22)
    assert scale[2].item() == 1.0  # the all-zero row
    assert not codes[:, k:].float().any()
    # each row's largest value maps to the largest code, and every code is torch's
    # rounding (to nearest, ties to even) of x / scale
    assert (codes.float().abs().amax(dim=1)[[0, 1, 3, 4]] == 448.0).all()
    expected_codes = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(codes[:, :k].float(), expected_codes.float())
