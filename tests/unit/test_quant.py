"""Quantized linears against their dequantize-then-matmul references, and the packing.

Tolerances, stated once: the kernels round activations to bf16 (relative error 2^-9)
and their outputs to bf16 (2^-9), accumulating in fp32, so |kernel - reference| is
bounded elementwise by 2^-7 * (|x| @ |W_deq|.T) (+ |bias| * 2^-8). fp8 also rounds
activations to e4m3 (3 mantissa bits): 2^-3 * (|x| @ |W_deq|.T). The integer kernel
(CPUs with AVX-512 VNNI) rounds activations to int8 per 32 in-features instead: at most
half a step, amax / 254, each; that adds (amax_per_group / 254) @ |W_deq|.T. Quantization
error itself (reference vs the unquantized weight) is bounded by half a step per weight.
"""

from __future__ import annotations

from typing import get_args

import pytest
import torch
import torch.nn.functional as F

from wattserve.daemon.config import QuantLevelName
from wattserve.kernels.linear import Linear
from wattserve.kernels.quant import (
    LEVEL_NAMES,
    CastLinear,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    QuantLevelError,
    cuda_capability,
    dequantize_int4,
    dequantize_int8,
    head_level,
    level_unavailable_reason,
    linear_nbytes,
    make_linear,
    pack_int4,
    pack_int4_pairs,
    parse_level,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    unpack_int4_pairs,
)

# (out, in): odd and tiny features, rows not a multiple of 16, in not of 16 or of 32
SHAPES = [(1, 16), (7, 33), (16, 64), (33, 100), (96, 64), (130, 200)]
TOKENS = [1, 2, 5, 40]  # 40 crosses the int8 kernel's token limit


def _weights(out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[0, : min(3, in_f)] = torch.tensor([0.4, -0.3, 0.2])[: min(3, in_f)]  # outliers
    return w, torch.randn(out_f, generator=g) * 0.1


def _assert_within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (y.float() - ref).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"max excess over bound {worst:.3g} (max err {err.max().item():.3g})"


def _bf16_bound(x, w_deq, bias, rel=2.0**-7):
    bound = rel * (x.float().abs() @ w_deq.abs().T) + 1e-6
    return bound if bias is None else bound + bias.abs() * 2.0**-8


def _int8_activation_bound(x, w_deq):
    """Half an int8 step of each 32-group's amax per activation, through |W|."""
    t, k = x.shape
    kp = -(-k // 32) * 32
    groups = F.pad(x.float().abs(), (0, kp - k)).reshape(t, -1, 32)
    half_step = (groups.amax(-1, keepdim=True) / 254).expand(-1, -1, 32).reshape(t, kp)
    return half_step[:, :k] @ w_deq.abs().T


def _kernel_bound(lin, x, bias):
    """What a quantized linear's output may differ from its reference by."""
    bound = _bf16_bound(x, lin.dequantize(), bias)
    if lin.int_weights is not None:
        bound = bound + _int8_activation_bound(x, lin.dequantize()) * (1 + 2.0**-7)
    return bound


# ---- quantize / dequantize -------------------------------------------------------------


def test_int8_quantization_error_is_at_most_half_a_step():
    w, _ = _weights(33, 100, 0)
    w[5] = 0.0  # an all-zero row
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scales.dtype == torch.bfloat16
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales.float()[:, None] / 2 + 1e-7).all()
    assert (dequantize_int8(q, scales)[5] == 0).all()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_quantization_error_is_at_most_half_a_step(group):
    w, _ = _weights(20, 256, 1)
    q, scales, zeros = quantize_int4(w, group)
    assert q.dtype == torch.uint8 and q.max() <= 15
    assert scales.shape == zeros.shape == (20, 256 // group)
    err = (dequantize_int4(q, scales, zeros, group) - w).abs().reshape(20, -1, group)
    assert (err <= scales.float()[..., None] / 2 * 1.01 + 1e-6).all()


def test_int4_recovers_values_already_on_a_coarser_4bit_grid():
    # Like a dequantized Q4 GGUF: every group on d * code + m with codes 2..13 only.
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(2, 14, (16, 64), generator=g).float()
    codes[:, ::32] = 2.0
    codes[:, 1::32] = 13.0  # each group spans codes 2..13 exactly
    d = torch.full((16, 2, 1), 2.0**-6)
    m = torch.full((16, 2, 1), -0.125)
    w = (codes.reshape(16, 2, 32) * d + m).reshape(16, 64)
    q, scales, zeros = quantize_int4(w, 32)
    torch.testing.assert_close(dequantize_int4(q, scales, zeros, 32), w, atol=0, rtol=0)


def test_int4_rejects_in_features_not_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="multiple of group size"):
        quantize_int4(torch.randn(16, 48), 32)


def test_nibble_pairs_round_trip():
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    packed = pack_int4_pairs(q)
    assert packed.shape == (5, 6) and packed[0, 0] == (q[0, 0] << 4 | q[0, 1])
    assert torch.equal(unpack_int4_pairs(packed), q)


@pytest.mark.parametrize("shape,group", [((16, 32), 32), ((48, 256), 32), ((32, 256), 128)])
def test_int4_kernel_packing_round_trips(shape, group):
    q = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    packed = pack_int4(q)
    assert packed.numel() * packed.element_size() == q.numel() // 2
    assert torch.equal(unpack_int4(packed, *shape, group), q)


# ---- kernels against references -------------------------------------------------------


@pytest.fixture(params=["int_kernel", "torch_kernels"])
def cpu_path(request, monkeypatch):
    """Each CPU path of the quantized linears: the integer kernel where this machine has
    it, and torch's packed kernels (what CPUs without AVX-512 VNNI run)."""
    import wattserve.kernels.quant as quant

    if request.param == "int_kernel":
        if not quant.int_linear_available():
            pytest.skip("the integer kernel needs AVX-512 VNNI and the built C++ kernels")
    else:
        monkeypatch.setattr(quant, "_int_kernel_here", lambda device: False)
    return request.param


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_reference(out_f, in_f, act_dtype, cpu_path):
    w, b = _weights(out_f, in_f, out_f * in_f)
    lin = Int8Linear(w, b)
    assert (lin.int_weights is not None) == (cpu_path == "int_kernel")
    q, scales = quantize_int8(w)
    torch.testing.assert_close(lin.dequantize(), dequantize_int8(q, scales), atol=0, rtol=0)
    for t in TOKENS:
        x = torch.randn(t, in_f, generator=torch.Generator().manual_seed(t)).to(act_dtype)
        y = lin(x)
        assert y.dtype == act_dtype and y.shape == (t, out_f)
        ref = lin.reference(x)
        _assert_within(y, ref, _kernel_bound(lin, x, b))
        # and the quantization error against the unquantized weight: half a step each
        half_step = scales.float()[None, :] / 2
        _assert_within(ref, F.linear(x.float(), w, b), x.float().abs().sum(1, True) * half_step)


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("group", [32, 128])
def test_int4_linear_matches_reference(out_f, in_f, group, cpu_path):
    w, b = _weights(out_f, in_f, out_f + in_f)
    lin = Int4Linear(w, b, group)
    assert (lin.int_weights is not None) == (cpu_path == "int_kernel")
    padded = F.pad(w, (0, lin.padded_in - in_f, 0, lin.padded_out - out_f))
    q, scales, zeros = quantize_int4(padded, group)
    expected = dequantize_int4(q, scales, zeros, group)[:out_f, :in_f]
    torch.testing.assert_close(lin.dequantize(), expected, atol=0, rtol=0)
    for t in TOKENS:
        x = torch.randn(t, in_f, generator=torch.Generator().manual_seed(t))
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (t, out_f)
        _assert_within(y, lin.reference(x), _kernel_bound(lin, x, b))


def test_a_wrong_dequantization_would_fail_the_bound(cpu_path):
    # The bound is tight enough to catch a scale applied to the wrong channel.
    w, b = _weights(96, 64, 5)
    lin = Int8Linear(w, b)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    wrong = lin.dequantize().roll(1, dims=0)
    bound = _bf16_bound(x, wrong, b)
    if lin.int_weights is not None:
        bound = bound + _int8_activation_bound(x, wrong)
    with pytest.raises(AssertionError):
        _assert_within(lin(x), F.linear(x, wrong, b), bound)


def _scaled_mm_runs_here() -> bool:
    try:
        Fp8Linear(torch.randn(16, 16))(torch.randn(1, 16))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _scaled_mm_runs_here(), reason="torch._scaled_mm not runnable on CPU")
@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_fp8_linear_matches_reference_through_cpu_scaled_mm(out_f, in_f):
    # The fp8 level is CUDA-only (capability >= 8.9); torch's CPU _scaled_mm checks the
    # code path (scales, padding, layout) where no such GPU is present.
    w, b = _weights(out_f, in_f, 7)
    lin = Fp8Linear(w, b)
    for t in TOKENS:
        x = torch.randn(t, in_f, generator=torch.Generator().manual_seed(t))
        _assert_within(lin(x), lin.reference(x), _bf16_bound(x, lin.dequantize(), b, 2.0**-3))


def test_cast_linear_holds_bf16_weights_for_fp32_activations():
    w, b = _weights(40, 24, 8)
    lin = make_linear(w, b, parse_level("bf16"), torch.float32)
    assert isinstance(lin, CastLinear) and lin.nbytes == 40 * 24 * 2
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(9))
    y = lin(x)
    assert y.dtype == torch.float32
    ref = F.linear(x.bfloat16().float(), w.bfloat16().float(), b)
    _assert_within(y, ref, _bf16_bound(x, w, b))


def test_make_linear_dispatch_and_sizes():
    w, b = _weights(40, 48, 10)
    same = make_linear(w, b, parse_level("fp32"), torch.float32)
    assert isinstance(same, Linear)
    for name, cls in [("int8", Int8Linear), ("int4", Int4Linear), ("int4-g128", Int4Linear)]:
        level = parse_level(name)
        lin = make_linear(w, b, level, torch.float32)
        assert isinstance(lin, cls)
        assert lin.nbytes == linear_nbytes(40, 48, level)
    sizes = [linear_nbytes(576, 576, parse_level(n)) for n in ("fp32", "bf16", "int8", "int4")]
    assert sizes == sorted(sizes, reverse=True) and sizes[3] < sizes[0] / 6


# ---- levels ------------------------------------------------------------------------------


def test_level_names_agree_with_the_config_schema():
    assert get_args(QuantLevelName) == LEVEL_NAMES


def test_unknown_level_is_rejected_with_the_known_ones():
    with pytest.raises(QuantLevelError, match="unknown quantization level 'int3'.*int8"):
        parse_level("int3")


def test_level_availability_reasons():
    assert level_unavailable_reason("int4", torch.float32, "cpu") is None
    assert "bfloat16" in level_unavailable_reason("fp32", torch.bfloat16, "cpu")
    assert "CUDA" in level_unavailable_reason("fp8", torch.float32, "cpu")
    assert parse_level("int4").head_level == "int8"


def test_int4_keeps_an_int8_head_on_the_cpu_and_a_bf16_head_on_cuda():
    for name in ("int4", "int4-g128"):
        assert head_level(parse_level(name), "cpu").name == "int8"
        assert head_level(parse_level(name), "cuda").name == "bf16"
    assert head_level(parse_level("int8"), "cuda").name == "int8"


# ---- CUDA paths (run where a GPU is present) -------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@needs_cuda
@pytest.mark.parametrize("name", ["int8", "int4", "int4-g128", "fp8"])
def test_cuda_linears_match_reference(name):
    reason = level_unavailable_reason(name, torch.float32, "cuda")
    if reason:
        pytest.skip(reason)
    w, b = _weights(96, 256, 11)
    lin = make_linear(w.cuda(), b.cuda(), parse_level(name), torch.bfloat16)
    rel = 2.0**-3 if name == "fp8" else 2.0**-7
    for t in TOKENS:
        x = torch.randn(t, 256, device="cuda").bfloat16()
        y = lin(x)
        ref = lin.reference(x)
        _assert_within(y, ref, _bf16_bound(x, lin.dequantize(), b.cuda(), rel))


@needs_cuda
def test_cuda_int4_packing_round_trips():
    if cuda_capability() < (8, 0):
        pytest.skip(f"int4 CUDA kernel needs compute capability 8.0, have {cuda_capability()}")
    q = torch.randint(0, 16, (32, 256), dtype=torch.uint8, device="cuda")
    assert torch.equal(unpack_int4(pack_int4(q), 32, 256, 32), q)


def test_default_levels_follow_the_device():
    from wattserve.kernels.quant import default_levels, level_unavailable_reason

    assert default_levels("cpu") == ("fp32", "bf16", "int8", "int4")
    cuda = default_levels(torch.device("cuda", 0))
    assert cuda[:2] == ("bf16", "fp8") and set(cuda) >= {"int8", "int4"}
    # Where a level cannot run (fp8 without such a GPU) the engine leaves it out, saying why.
    assert "fp8" in (level_unavailable_reason("fp8", torch.bfloat16, "cpu") or "")
