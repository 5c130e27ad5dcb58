"""The quantized linears' CUDA kernels in Triton: an int8 weight-only matmul and the fp8
activation scaling, one launch each.

- triton_int8_linear: x [T, K] times int8 codes q [N, K] (one bf16 scale per output
  channel) -> [T, N] in x's dtype, bias optional. x is rounded to bf16 (as the torch path
  casts it), the codes widen to bf16 exactly, products accumulate in float32, the scale and
  the bias are applied in float32 and the result rounded once. Any T, K, N (masked tiles).
  For T <= 16 a tile holds 16 rows (a GEMV: the weight is read once, the dot's unused rows
  cost nothing next to the weight's bytes); above, the same kernel runs on 64-row tiles,
  which reads the int8 weight once per 64 rows, needs no activation quantization (as
  torch._int_mm would) and no dequantized bf16 copy of the weight (as F.linear would).
- triton_fp8_quantize_rows: each row's amax and its e4m3 codes in one pass over x:
  x [T, K] -> (codes float8_e4m3fn [T, Kp] with zeros in K..Kp, scale float32 [T, 1]),
  scale = amax / 448 (1 for an all-zero row), for torch._scaled_mm's row-wise scaling.
The grids come from tensor shapes alone and nothing is read back, so a CUDA graph can
capture every call. Who calls them is quant.py's choice (TRITON_QUANT_DEVICES). Importing
needs triton; the kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1 (set before
import), which the tests use. Tile sizes are set by reasoning, not tuned on a GPU yet.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
GEMV_MAX_TOKENS = 16  # rows up to which a tile holds 16 rows


@triton.jit
def _int8_linear_kernel(
    x,
    q,
    scales,
    bias,
    out,
    T,
    N,
    K,
    x_stride,
    q_stride,
    out_stride,
    HAS_BIAS: tl.constexpr,
    FP32_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    col_ok = cols < N
    x_rows = x + rows.to(tl.int64)[:, None] * x_stride
    q_cols = q + cols.to(tl.int64)[None, :] * q_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(q_cols + k[:, None], mask=(k < K)[:, None] & col_ok[None, :], other=0)
        a = a.to(tl.bfloat16)
        # The interpreter's bf16 dot (and int8 -> bf16 cast) are wrong: it widens to fp32.
        if FP32_DOTS:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(tl.bfloat16), acc)  # codes -127..127: exact in bf16
    y = acc * tl.load(scales + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dst = out + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(dst, y.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32.

    CUDA's conversion rounds so itself; the interpreter's does not (126.2 -> 64, 336 ->
    352 in triton 3.7.1), so the kernel rounds first and the conversion is then exact
    everywhere. e4m3 steps are 2^(E - 3) for |v| in [2^E, 2^(E+1)), 2^-9 below 2^-6."""
    biased = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step = ((tl.maximum(biased, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
    # |v / step| < 16: adding and taking back 1.5 * 2^23 rounds it to an integer, to even
    return (v / step + 12582912.0 - 12582912.0) * step


@triton.jit
def _fp8_rows_kernel(x, codes, scale, K, KP, x_stride, codes_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    peak = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + cols
        v = tl.load(x + row * x_stride + k, mask=k < K, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(v))
    amax = tl.max(peak, axis=0)
    s = tl.where(amax > 0.0, amax / FP8_MAX, 1.0)
    for k0 in range(0, KP, BLOCK):  # the row again (from cache), zeros past K
        k = k0 + cols
        v = tl.load(x + row * x_stride + k, mask=k < K, other=0.0).to(tl.float32)
        c = _round_to_e4m3(tl.minimum(tl.maximum(v / s, -FP8_MAX), FP8_MAX))
        tl.store(codes + row * codes_stride + k, c.to(codes.dtype.element_ty), mask=k < KP)
    tl.store(scale + row, s)


def int8_tiles(tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a call on `tokens` rows."""
    if tokens <= GEMV_MAX_TOKENS:
        # narrow column tiles: enough programs to keep every SM reading at N = 2048
        return 16, 16, 256, 4
    return 64, 64, 64, 4


def _int8_linear(x, q, scales, bias):
    t, k = x.shape
    n = q.shape[0]
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps = int8_tiles(t)
    grid = (triton.cdiv(n, block_n), triton.cdiv(t, block_m))
    _int8_linear_kernel[grid](
        x,
        q,
        scales,
        scales if bias is None else bias,  # not read without a bias
        out,
        t,
        n,
        k,
        x.stride(0),
        q.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        FP32_DOTS=_INTERPRET,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out


_FP8_BLOCK_MAX = 2048


def _fp8_quantize_rows(x, padded_in):
    t, k = x.shape
    codes = torch.empty((t, padded_in), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        block = min(triton.next_power_of_2(padded_in), _FP8_BLOCK_MAX)
        _fp8_rows_kernel[(t,)](
            x,
            codes,
            scale,
            k,
            padded_in,
            x.stride(0),
            codes.stride(0),
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
    return codes, scale


# One Library fragment, as triton_rows.py's.
_LIB = torch.library.Library("wattserve", "FRAGMENT")
_LIB.define("triton_int8_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor")
_LIB.define("triton_fp8_quantize_rows(Tensor x, int padded_in) -> (Tensor, Tensor)")
for _key in ("CUDA", "CPU"):  # the CPU under TRITON_INTERPRET=1 only
    _LIB.impl("triton_int8_linear", _int8_linear, _key)
    _LIB.impl("triton_fp8_quantize_rows", _fp8_quantize_rows, _key)


@torch.library.register_fake("wattserve::triton_int8_linear")
def _(x, q, scales, bias):
    return x.new_empty((x.shape[0], q.shape[0]))


@torch.library.register_fake("wattserve::triton_fp8_quantize_rows")
def _(x, padded_in):
    codes = x.new_empty((x.shape[0], padded_in), dtype=torch.float8_e4m3fn)
    return codes, x.new_empty((x.shape[0], 1), dtype=torch.float32)


def takes(x: torch.Tensor) -> bool:
    """Whether these kernels can serve a call on x: 2-D rows of unit stride."""
    return x.dim() == 2 and x.stride(-1) == 1
