"""Weight-only quantized linears (int8, int4, fp8) and the levels the engine switches between.

A level names how every matmul weight of the model is stored: `fp32` / `bf16` (dense,
oneDNN-packed through wattserve.kernels.linear), `int8` (per-output-channel symmetric scales),
`int4` (group-wise over in-features, group 32, or `int4-g128`, with a scale and a
zero point per group; the LM head of an int4 level is int8) and `fp8` (e4m3 weights
and dynamically scaled e4m3 activations, CUDA compute capability >= 8.9 only). Each
quantized linear is built once from a full-precision weight and keeps a plain
dequantize-then-matmul `reference()` for tests. On a CPU with AVX-512 VNNI the int8
and int4 levels run the project's integer kernel (wattserve.kernels.int_linear: int8
activations quantized per 32 in-features, weights read once per 8 rows), faster than
bf16 at every batch size measured. On CUDA with triton, int8 runs one Triton launch
(wattserve.kernels.triton_quant: bf16 x times the codes, fp32 accumulation, scale and bias
applied in the kernel) and fp8 two: the activations' per-row scaling in one Triton launch,
then `_scaled_mm` with row-wise scales. Elsewhere torch's packed kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, the CUDA ones), which are fast
only with bf16 activations, so those paths run in bf16 and cast back.
This module must not know about models, layers or the engine: it maps one [out, in]
weight to one callable x[T, in] -> y[T, out].
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from wattserve.kernels.int_linear import (
    IntWeights,
    center_code,
    dequantize_weights,
    int_linear,
    int_linear_available,
    pack_codes,
    unpack_codes,
)
from wattserve.kernels.linear import Linear

LevelKind = Literal["dense", "int8", "int4", "fp8"]

# Every level name the engine understands (wattserve.daemon.config spells the same list).
LEVEL_NAMES = ("fp32", "bf16", "int8", "int4", "int4-g128", "fp8")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept

# The packed kernels' layout constraints; other shapes are zero-padded at build time.
_CPU_INT8_K_MULTIPLE = 16  # _weight_int8pack_mm on CPU crashes on other in-features
_INT_KERNEL_N_MULTIPLE = 16  # the integer kernel's output columns per block
_INT_KERNEL_K_MULTIPLE = 32  # and in-features per activation scale
_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu; CUDA needs 8
_INT4_ROW_BLOCK = 256  # rows quantized at a time
# The CPU int8/int4 kernels re-read the whole weight for every 4 activation rows, so
# their time grows ~linearly with T; past this many tokens int8 runs a bf16 GEMM on
# the codes instead (measured crossover 16..64 here; int4 has no such path, see docs).
_INT8_KERNEL_MAX_TOKENS = 24
_FP8_MULTIPLE = 16  # _scaled_mm: both matrix dims multiples of 16
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper
_CUDA_INT4_MIN_CAPABILITY = (8, 0)  # tinygemm kernel behind _weight_int4pack_mm
# Devices whose int8 and fp8 linears run triton_quant's kernels: CUDA where triton is
# installed (torch's CUDA wheels bring it). The Triton tests add "cpu", under TRITON_INTERPRET=1.
TRITON_QUANT_DEVICES: set[str] = {"cuda"} if importlib.util.find_spec("triton") else set()


class QuantLevelError(ValueError):
    """An unknown, disallowed or unavailable quantization level; one line naming it."""


@dataclass(frozen=True)
class QuantLevel:
    """How the matmul weights of one level are stored and multiplied."""

    name: str
    kind: LevelKind
    bits: int  # storage bits per weight, before scales
    group_size: int = 0  # int4 only: in-features per (scale, zero) pair
    # Level of the LM head when it differs: at 4 bits the embedding matrix (which the
    # LM head shares in tied models, and which Q4 GGUFs keep at more bits) costs
    # SmolLM2 ~4% perplexity, at 8 bits ~0.2%, for 14 MB more read per step.
    head_level: str | None = None


_LEVELS = {
    "fp32": QuantLevel("fp32", "dense", 32),
    "bf16": QuantLevel("bf16", "dense", 16),
    "int8": QuantLevel("int8", "int8", 8),
    "int4": QuantLevel("int4", "int4", 4, 32, head_level="int8"),
    "int4-g128": QuantLevel("int4-g128", "int4", 4, 128, head_level="int8"),
    "fp8": QuantLevel("fp8", "fp8", 8),
}


def parse_level(name: str) -> QuantLevel:
    """The level called `name`; raises QuantLevelError listing the known ones."""
    level = _LEVELS.get(name)
    if level is None:
        raise QuantLevelError(
            f"unknown quantization level {name!r} (known: {', '.join(LEVEL_NAMES)})"
        )
    return level


def default_levels(device: torch.device | str) -> tuple[str, ...]:
    """The levels an engine offers when none are configured: on the CPU fp32, bf16, int8,
    int4; on CUDA bf16 (the weights' dtype there), fp8 (the GPU's own 8-bit matmul where
    it has one: on Hopper and Ada the level before int8), int8, int4. A level the device
    cannot run is then left out with its reason (level_unavailable_reason)."""
    if torch.device(device).type == "cuda":
        return ("bf16", "fp8", "int8", "int4")
    return ("fp32", "bf16", "int8", "int4")


def head_level(level: QuantLevel, device: torch.device | str = "cpu") -> QuantLevel:
    """The level the LM head is stored at under `level` on `device`. On CUDA an int4 level
    keeps a bf16 head: its logits pick every token, and the head is a small share of the
    bytes a step reads at a batch's width; on the CPU int8 (the integer kernel's speed)."""
    if level.kind == "int4" and torch.device(device).type == "cuda":
        return parse_level("bf16")
    return parse_level(level.head_level) if level.head_level else level


def full_precision_level(dtype: torch.dtype) -> str:
    """The level of weights as loaded in `dtype` (the level every other is compared to)."""
    if dtype == torch.float32:
        return "fp32"
    if dtype == torch.bfloat16:
        return "bf16"
    raise QuantLevelError(f"no quantization level for weights of dtype {dtype}")


def level_unavailable_reason(
    name: str, loaded_dtype: torch.dtype, device: torch.device | str = "cpu"
) -> str | None:
    """Why `name` cannot run here (None when it can).

    fp32 needs fp32-loaded weights (a bf16 load has nothing more precise to offer); the
    CUDA int4 kernel needs compute capability 8.0, fp8 needs a CUDA GPU with 8.9 or newer.
    """
    level = parse_level(name)
    dev = torch.device(device)
    if level.name == "fp32" and loaded_dtype != torch.float32:
        return f"fp32: the model was loaded as {loaded_dtype}, not float32"
    if level.kind == "fp8":
        if dev.type != "cuda":
            return "fp8: needs a CUDA GPU with compute capability >= 8.9"
        if cuda_capability(dev) < _FP8_MIN_CAPABILITY:
            return f"fp8: GPU compute capability {cuda_capability(dev)} < 8.9"
    if level.kind == "int4" and dev.type == "cuda":
        if cuda_capability(dev) < _CUDA_INT4_MIN_CAPABILITY:
            return f"{name}: GPU compute capability {cuda_capability(dev)} < 8.0"
    return None


def cuda_capability(device: torch.device | str = "cuda") -> tuple[int, int]:
    """(major, minor) of a CUDA device, (0, 0) when CUDA is absent."""
    if not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability(torch.device(device))


class LinearLike(Protocol):
    """What the model calls: x[T, in] -> y[T, out] in x's dtype, and the bytes it holds."""

    out_features: int
    in_features: int
    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


# ---- quantize / dequantize (plain torch; the references) -----------------------------


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight[N, K] -> (q int8 [N, K], scales bf16 [N]).

    The scale is rounded to bf16 before rounding q, so q * scale is exactly what the
    kernel multiplies by; a zero row gets scale 1 and q = 0.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)  # [N]
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.bfloat16)
    q = torch.round(w / scales.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K], scales [N] -> float32 [N, K]."""
    return q.float() * scales.float()[:, None]


def quantize_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric 4-bit: weight[N, K] -> (q uint8 [N, K] in 0..15,
    scales bf16 [N, K/G], zeros bf16 [N, K/G]) with w ~= (q - 8) * scale + zero.

    That is torch's int4 kernels' convention (zero is the value of the middle code 8).
    Each group's grid is anchored at its min or its max and spans m = 11..15 steps of
    the group's range; the candidate with the least squared error wins. Values already
    on a coarser 4-bit grid (a dequantized Q4 GGUF whose groups use fewer than 16
    codes) are thereby recovered exactly rather than re-rounded. Scale and zero are
    rounded to bf16 first and q is computed against the rounded pair.
    K must be a multiple of group_size.
    """
    n, k = weight.shape
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(f"int4: in-features {k} not a multiple of group size {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)  # [N, K/G, G]
    # Row blocks keep the candidates' temporaries in cache (several times faster).
    parts = [_quantize_int4_groups(rows) for rows in w.split(_INT4_ROW_BLOCK)]
    q = torch.cat([p[0] for p in parts]).reshape(n, k)
    return q, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


def _quantize_int4_groups(
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, K/G, G] float32 -> codes uint8 [R, K/G, G], scales and zeros bf16 [R, K/G]."""
    lo = w.amin(dim=-1)
    hi = w.amax(dim=-1)
    span = hi - lo
    best_err = best_scales = best_zeros = None
    for steps in range(15, 10, -1):
        scale = torch.where(span > 0, span / steps, torch.ones_like(span))
        for base in (lo, hi - 15 * scale):  # value of code 0: grid from the min or the max
            scales, zeros, q = _int4_grid(w, scale, base)
            err = (q - 8.0) * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1) - w
            err = err.square().sum(dim=-1)  # [R, K/G]
            if best_err is None:
                best_err, best_scales, best_zeros = err, scales, zeros
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_scales = torch.where(better, scales, best_scales)
                best_zeros = torch.where(better, zeros, best_zeros)
    _, _, q = _int4_grid(w, best_scales.float(), best_zeros.float() - 8.0 * best_scales.float())
    return q.to(torch.uint8), best_scales, best_zeros


def _int4_grid(
    w: torch.Tensor, scale: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 (scale, zero) of the grid base + scale * code, and w's codes on it (float)."""
    scales = scale.to(torch.bfloat16)
    zeros = (base + 8.0 * scale).to(torch.bfloat16)
    code0 = zeros.float() - 8.0 * scales.float()  # value of code 0 after rounding
    q = torch.round((w - code0.unsqueeze(-1)) / scales.float().unsqueeze(-1)).clamp(0, 15)
    return scales, zeros, q


def dequantize_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """q uint8 [N, K], scales/zeros [N, K/G] -> float32 [N, K]."""
    n, k = q.shape
    qg = q.float().reshape(n, k // group_size, group_size)
    return ((qg - 8.0) * scales.float()[..., None] + zeros.float()[..., None]).reshape(n, k)


def pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (0..15, K even) -> uint8 [N, K/2], even column in the high nibble.

    The input layout torch's CUDA `_convert_weight_to_int4pack` expects.
    """
    pairs = q.view(q.shape[0], -1, 2)  # (even, odd) columns; unflatten, not q[:, ::2]
    return (pairs.select(2, 0) << 4 | pairs.select(2, 1)).to(torch.uint8)


def unpack_int4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_pairs: uint8 [N, K/2] -> uint8 [N, K]."""
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.uint8, device=packed.device)
    out[:, ::2] = packed >> 4
    out[:, 1::2] = packed & 0xF
    return out


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled e4m3: weight[N, K] -> (w8 float8_e4m3fn [N, K], scale fp32 [])."""
    w = weight.detach().float()
    amax = w.abs().amax()
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scale


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---- the linears ---------------------------------------------------------------------


def _triton_here(device: torch.device) -> bool:
    """Whether int8/fp8 linears on `device` run triton_quant's kernels (registered now)."""
    if device.type not in TRITON_QUANT_DEVICES:
        return False
    import wattserve.kernels.triton_quant  # noqa: F401  (registers the ops)

    return True


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the Triton kernels take it: rows of unit stride."""
    return x if x.dim() == 2 and x.stride(-1) == 1 else x.contiguous()


def _int_kernel_here(device: torch.device) -> bool:
    """Whether int8/int4 linears on `device` run the integer kernel (CPU, built with VNNI)."""
    return device.type == "cpu" and int_linear_available()


class _WeightOnlyLinear:
    """Shared call path. With the integer kernel (int_weights set): x as it is, bias
    added in the kernel. Otherwise: cast to bf16, pad in-features, run the kernel, slice,
    cast back.

    Subclasses set in_features/out_features, padded_in/padded_out, nbytes, int_weights
    (or None), and implement _matmul(x bf16 [T, padded_in]) -> [T, padded_out] for the
    torch kernels and dequantize() -> fp32 [out, in].
    """

    in_features: int
    out_features: int
    padded_in: int
    padded_out: int
    nbytes: int
    bias: torch.Tensor | None
    int_weights: IntWeights | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int_weights is not None:  # the op refuses other dtypes with a reason
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return int_linear(x.contiguous(), self.int_weights, bias)
        xb = x.to(torch.bfloat16)
        if self.padded_in != self.in_features:
            xb = F.pad(xb, (0, self.padded_in - self.in_features))  # [T, padded_in]
        return self._finish(self._matmul(xb.contiguous()), x.dtype)

    def _finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y [T, padded_out] -> [T, out] in `dtype`, bias added (each step only if needed)."""
        if self.padded_out != self.out_features:
            y = y.narrow(1, 0, self.out_features).contiguous()
        y = y.to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain dequantize-then-matmul in float32: the numeric ground truth for tests
        (the integer kernel also rounds x per 32 in-features to int8; tests bound that)."""
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.dequantize(), bias)


class Int8Linear(_WeightOnlyLinear):
    """int8 weights with one bf16 scale per output channel; y = (x @ q.T) * scale + b.

    With triton (CUDA) the codes stay [out, in] unpadded and a call is one launch of
    triton_quant's kernel, which takes x in its dtype and adds the bias itself."""

    triton = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        q, scales = quantize_int8(weight)
        on_cpu = weight.device.type == "cpu"
        self.bias = None if bias is None else bias.detach()
        if _triton_here(weight.device):
            self.triton = True
            self.padded_in, self.padded_out = self.in_features, self.out_features
            self.q, self.scales = q.contiguous(), scales  # [N, K] int8, [N] bf16
            self.nbytes = int8_linear_nbytes(self.out_features, self.in_features, on_cpu=False)
            return
        self.nbytes = int8_linear_nbytes(self.out_features, self.in_features, on_cpu)
        if _int_kernel_here(weight.device):
            # codes q + 128 (0 weights in the padding), one scale group per row
            self.padded_out = _round_up(self.out_features, _INT_KERNEL_N_MULTIPLE)
            self.padded_in = _round_up(self.in_features, _INT_KERNEL_K_MULTIPLE)
            pad = (0, self.padded_in - self.in_features, 0, self.padded_out - self.out_features)
            codes = F.pad(q.to(torch.int16) + center_code(8), pad, value=center_code(8))
            s = F.pad(scales, (0, self.padded_out - self.out_features), value=1.0)[:, None]
            self.int_weights = pack_codes(
                codes.to(torch.uint8), s, torch.zeros_like(s), 8, self.padded_in, self.out_features
            )
            self.q = self.scales = None
            return
        self.padded_out = self.out_features
        self.padded_in = _round_up(self.in_features, _CPU_INT8_K_MULTIPLE if on_cpu else 1)
        self.q = F.pad(q, (0, self.padded_in - self.in_features)).contiguous()  # [N, Kp]
        self.scales = scales  # [N] bf16
        # Tokens up to which the packed kernel runs (a GEMM on the codes beyond). On CUDA
        # the kernel is used whenever this torch build has one for the device.
        self.kernel_max_tokens = _INT8_KERNEL_MAX_TOKENS
        if not on_cpu:
            self.kernel_max_tokens = 1 << 30 if _has_int8_kernel(weight.device) else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            return torch.ops.wattserve.triton_int8_linear(_rows(x), self.q, self.scales, self.bias)
        return super().__call__(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.kernel_max_tokens:
            return torch._weight_int8pack_mm(x, self.q, self.scales)  # [T, N]
        # codes are exact in bf16: the same products, scaled per output column after
        return F.linear(x, self.q.to(torch.bfloat16)) * self.scales  # [T, N]

    def dequantize(self) -> torch.Tensor:
        if self.int_weights is not None:
            return dequantize_weights(self.int_weights)[: self.out_features, : self.in_features]
        return dequantize_int8(self.q[:, : self.in_features], self.scales)


def _has_int8_kernel(device: torch.device) -> bool:
    try:
        torch._weight_int8pack_mm(
            torch.zeros(1, 16, dtype=torch.bfloat16, device=device),
            torch.zeros(16, 16, dtype=torch.int8, device=device),
            torch.ones(16, dtype=torch.bfloat16, device=device),
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Int4Linear(_WeightOnlyLinear):
    """4-bit weights, one (scale, zero) pair per `group_size` in-features of each row.

    CPU with the integer kernel: its layout (two codes a byte); other CPUs:
    `_convert_weight_to_int4pack_for_cpu` + `_weight_int4pack_mm_for_cpu`;
    CUDA (compute capability >= 8.0): `_convert_weight_to_int4pack` + `_weight_int4pack_mm`.
    Rows are padded to a multiple of 16 and in-features to a multiple of the group
    (padded weights are exactly zero). Only the packed codes and the scales are kept.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        self.padded_out = _round_up(self.out_features, _INT4_N_MULTIPLE)
        self.padded_in = _round_up(self.in_features, group_size)
        w = F.pad(
            weight.detach().float(),
            (0, self.padded_in - self.in_features, 0, self.padded_out - self.out_features),
        )
        q, scales, zeros = quantize_int4(w, group_size)  # [Np, Kp], [Np, Kp/G] x2
        self.bias = None if bias is None else bias.detach()
        self.nbytes = int4_linear_nbytes(self.out_features, self.in_features, group_size)
        if _int_kernel_here(weight.device):
            self.int_weights = pack_codes(q, scales, zeros, 4, group_size, self.out_features)
            return
        # [Kp/G, Np, 2]: the kernels' scale-and-zero layout
        # clone, not .contiguous(): the latter fails on a fake CUDA tensor (bench host)
        sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1)
        self.scales_and_zeros = sz.clone(memory_format=torch.contiguous_format)
        self.packed = pack_int4(q)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return int4_matmul(x, self.packed, self.group_size, self.scales_and_zeros)  # [T, Np]

    def codes_padded(self) -> torch.Tensor:
        """The 4-bit codes read back from the packed layout: uint8 [Np, Kp] in 0..15."""
        if self.int_weights is not None:
            return unpack_codes(self.int_weights)
        return unpack_int4(self.packed, self.padded_out, self.padded_in, self.group_size)

    def dequantize(self) -> torch.Tensor:
        if self.int_weights is not None:
            return dequantize_weights(self.int_weights)[: self.out_features, : self.in_features]
        sz = self.scales_and_zeros[:, : self.out_features]  # [Kp/G, N, 2]
        q = self.codes_padded()[: self.out_features]
        full = dequantize_int4(q, sz[..., 0].T, sz[..., 1].T, self.group_size)  # [N, Kp]
        return full[:, : self.in_features]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [N, K] (N % 16 == 0; K a multiple of the group) -> the packed weight of
    the int4 kernel on q's device (an opaque blocked layout; unpack_int4 reads it back)."""
    if q.device.type == "cuda":
        inner_k_tiles = next(t for t in (8, 4, 2) if q.shape[1] % (t * 16) == 0)
        return torch._convert_weight_to_int4pack(pack_int4_pairs(q), inner_k_tiles)
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)  # [N, K/2]


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """x bf16 [T, K] times the packed int4 weight [N, K] -> bf16 [T, N]."""
    if packed.device.type == "cuda":
        return torch._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def unpack_int4(
    packed: torch.Tensor, out_features: int, in_features: int, group_size: int
) -> torch.Tensor:
    """Read the codes back from a packed int4 weight of padded shape [N, K]: uint8 [N, K].

    The packed layouts are opaque and device-specific, so this multiplies the identity
    through the kernel itself with scale 1 and zero 0: row k of the result is column k
    of (q - 8), small integers that bf16 holds exactly. Meant for tests and checks.
    """
    eye = torch.eye(in_features, dtype=torch.bfloat16, device=packed.device)  # [K, K]
    unit = torch.zeros(
        in_features // group_size, out_features, 2, dtype=torch.bfloat16, device=packed.device
    )
    unit[..., 0] = 1.0  # scale 1, zero 0
    q_minus_8 = int4_matmul(eye, packed, group_size, unit)  # [K, N]
    return (q_minus_8.float().T + 8).round().to(torch.uint8)


class Fp8Linear(_WeightOnlyLinear):
    """e4m3 weights (per-tensor scale) times e4m3 activations via _scaled_mm.

    With triton (CUDA) the activations get one scale per row, computed with their codes in
    one launch (zeros in the padded in-features), and _scaled_mm takes row-wise scales
    (the weight's per-tensor scale expanded over its rows once, at build): two launches.
    Without it, one scale per call in torch ops. Built for CUDA GPUs with compute
    capability >= 8.9; torch also runs _scaled_mm on CPU, which the tests use to check
    both code paths where no such GPU is present.
    """

    triton = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.padded_out = _round_up(self.out_features, _FP8_MULTIPLE)
        self.padded_in = _round_up(self.in_features, _FP8_MULTIPLE)
        w = F.pad(
            weight.detach().float(),
            (0, self.padded_in - self.in_features, 0, self.padded_out - self.out_features),
        )
        self.w8, self.scale = quantize_fp8(w)  # [Np, Kp] e4m3, [] fp32
        self.bias = None if bias is None else bias.detach()
        self.nbytes = self.padded_out * self.padded_in + 4
        if _triton_here(weight.device):
            self.triton = True
            row_scales = self.scale.expand(1, self.padded_out)  # [1, Np] fp32, as int4's
            self.scale_b = row_scales.clone(memory_format=torch.contiguous_format)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.triton:
            return super().__call__(x)
        x8, x_scale = torch.ops.wattserve.triton_fp8_quantize_rows(_rows(x), self.padded_in)
        y = torch._scaled_mm(
            x8, self.w8.t(), scale_a=x_scale, scale_b=self.scale_b, out_dtype=torch.bfloat16
        )  # [T, Np]
        return self._finish(y, x.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.abs().amax().float()
        x_scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
        x8 = (x.float() / x_scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(
            x8, self.w8.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=torch.bfloat16
        )  # [T, Np]

    def dequantize(self) -> torch.Tensor:
        return self.w8[: self.out_features, : self.in_features].float() * self.scale


class CastLinear:
    """A dense packed linear whose weights are held in another dtype than the activations
    (bf16 weights for an fp32 model): x is cast in and y cast back; bias added in x's dtype."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: torch.dtype
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight_dtype = weight_dtype
        self.inner = Linear(weight.detach().to(weight_dtype))
        self.bias = None if bias is None else bias.detach()
        self.nbytes = self.inner.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x.to(self.weight_dtype)).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


# ---- sizes and the factory -----------------------------------------------------------


def int8_linear_nbytes(out_features: int, in_features: int, on_cpu: bool = True) -> int:
    """Bytes an Int8Linear holds: int8 codes (in-features padded on CPU) + bf16 scales
    (and bf16 zeros, with both dims padded, in the integer kernel's layout)."""
    if on_cpu and _int_kernel_here(torch.device("cpu")):
        n = _round_up(out_features, _INT_KERNEL_N_MULTIPLE)
        return n * _round_up(in_features, _INT_KERNEL_K_MULTIPLE) + n * 2 * 2
    k = _round_up(in_features, _CPU_INT8_K_MULTIPLE if on_cpu else 1)
    return out_features * k + out_features * 2


def int4_linear_nbytes(out_features: int, in_features: int, group_size: int) -> int:
    """Bytes of an Int4Linear's packed codes + bf16 scales and zeros (padded shape)."""
    n = _round_up(out_features, _INT4_N_MULTIPLE)
    k = _round_up(in_features, group_size)
    return n * k // 2 + (k // group_size) * n * 2 * 2


def linear_nbytes(
    out_features: int,
    in_features: int,
    level: QuantLevel,
    device: torch.device | str = "cpu",
) -> int:
    """Resident weight bytes of one [out, in] linear at `level` on `device` (bias excluded);
    what make_linear's result reports as .nbytes, known before building it. Off the CPU
    the C++ kernels' layouts never apply, so nothing here builds or loads them there."""
    if level.kind == "dense":
        return out_features * in_features * level.bits // 8
    if level.kind == "int8":
        return int8_linear_nbytes(out_features, in_features, torch.device(device).type == "cpu")
    if level.kind == "int4":
        return int4_linear_nbytes(out_features, in_features, level.group_size)
    return _round_up(out_features, _FP8_MULTIPLE) * _round_up(in_features, _FP8_MULTIPLE) + 4


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    level: QuantLevel,
    activation_dtype: torch.dtype,
) -> LinearLike:
    """Build the linear of `level` from a full-precision weight[out, in] (and bias[out]).

    Dense levels whose dtype equals activation_dtype return the plain packed Linear.
    """
    if level.kind == "dense":
        dtype = torch.float32 if level.bits == 32 else torch.bfloat16
        if dtype == activation_dtype:
            b = None if bias is None else bias.detach().to(dtype)
            return Linear(weight.detach().to(dtype), b)
        return CastLinear(weight, bias, dtype)
    if level.kind == "int8":
        return Int8Linear(weight, bias)
    if level.kind == "int4":
        return Int4Linear(weight, bias, level.group_size)
    return Fp8Linear(weight, bias)
