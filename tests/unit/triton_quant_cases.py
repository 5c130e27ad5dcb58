"""The Triton quantized-linear test cases (triton_quant.py): inputs built from a seed, and a
runner for a subprocess under TRITON_INTERPRET=1, as triton_rows_cases.py does.

`python -m tests.unit.triton_quant_cases OUT` builds Int8Linear and Fp8Linear with the CPU
added to quant.TRITON_QUANT_DEVICES (so they take the CUDA path: the Triton ops, and
_scaled_mm with row-wise scales, which torch also runs on the CPU) and saves each case's
output to OUT; test_triton_quant.py compares them with the dequantize-then-matmul
references in its own process. Shapes are small: the interpreter runs programs in numpy.
"""

from __future__ import annotations

import sys

import torch

# (out features, in features): neither a multiple of the kernels' tiles, nor of 16 for
# fp8's _scaled_mm (the weight is padded at build, the activations in the kernel)
SHAPES = {"n37_k70": (37, 70), "n48_k40": (48, 40)}
TOKENS = (1, 5, 17)  # a GEMV tile, a partly filled one, the tiled GEMM past 16 rows
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def weights(shape: str) -> tuple[torch.Tensor, torch.Tensor]:
    out_f, in_f = SHAPES[shape]
    g = torch.Generator().manual_seed(out_f * in_f)
    return torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g)


def activations(shape: str, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(tokens + len(shape))
    x = 2.0 * torch.randn(tokens, SHAPES[shape][1], generator=g)
    if tokens > 2:
        x[2] = 0.0  # an all-zero row: fp8's scale 1, not a division by zero
    return x.to(dtype)


def main(out_path: str) -> None:
    from wattserve.kernels import quant

    quant.TRITON_QUANT_DEVICES.add("cpu")
    outputs: dict[str, object] = {}
    for shape in SHAPES:
        w, b = weights(shape)
        int8 = quant.Int8Linear(w, b)
        int8_no_bias = quant.Int8Linear(w)
        fp8 = quant.Fp8Linear(w, b)
        outputs[f"uses_triton/{shape}"] = (int8.triton, fp8.triton)
        for dname, dtype in DTYPES.items():
            for t in TOKENS:
                x = activations(shape, t, dtype)
                outputs[f"int8/{shape}/{dname}/{t}"] = int8(x)
                outputs[f"fp8/{shape}/{dname}/{t}"] = fp8(x)
        x = activations(shape, 5, torch.bfloat16)
        outputs[f"int8_no_bias/{shape}"] = int8_no_bias(x)
        outputs[f"fp8_rows/{shape}"] = torch.ops.wattserve.triton_fp8_quantize_rows(
            x, fp8.padded_in
        )
    torch.save(outputs, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
