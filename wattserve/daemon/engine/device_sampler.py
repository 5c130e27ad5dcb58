"""Next-token choice on the device for a batch's rows: one parameter upload, one launch.

device_ids() hands the rows' logits and sampling parameters to triton_sample's kernel where
triton runs on the logits' device (triton_rows_take: CUDA, float32 rows of unit stride) and
returns None elsewhere, so the caller falls back to sampler.sample(). Nothing is read back:
the ids stay on the device. A seeded row draws from Philox keyed by its seed and its step
(the index of the token it is choosing), so its tokens depend on neither the batch nor the
row, but they are not the CPU sampler's tokens for the same seed (torch.Generator draws). An
unseeded row gets a fresh random seed each call. It does not process logits or check
parameters (SamplingParams.validate did).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from wattserve.daemon.engine.request import SamplingParams
from wattserve.kernels.norm_rope import triton_rows_take

_UNSEEDED = random.Random()  # seeds for rows without one (OS entropy)
_INT64 = 1 << 64


def device_ids(
    logits: torch.Tensor, params: list[SamplingParams], steps: Sequence[int] | torch.Tensor
) -> torch.Tensor | None:
    """logits: [N, V] float32, one SamplingParams per row; steps: each row's step counter
    (a list, or an int64 tensor on the logits' device). Returns ids int64 [N] on the device,
    -1 for a row with a NaN, a +inf or no finite logit; None where the kernel does not run."""
    if logits.dtype != torch.float32 or not triton_rows_take(logits):
        return None
    import wattserve.kernels.triton_sample  # noqa: F401  (registers the op)

    n, vocab = logits.shape
    int64s = [[_signed64(p.seed) for p in params]]
    if not isinstance(steps, torch.Tensor):
        int64s.append(list(steps))
    floats = [
        [0.0 if p.greedy else p.temperature for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    ]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    # One upload: the 64-bit columns first, so every column's byte offset suits its dtype.
    host = torch.cat(
        [
            torch.tensor(int64s, dtype=torch.int64, device="cpu").view(torch.uint8).flatten(),
            torch.tensor(floats, dtype=torch.float32, device="cpu").view(torch.uint8).flatten(),
            torch.tensor(top_k, dtype=torch.int32, device="cpu").view(torch.uint8),
        ]
    )
    dev = host.to(logits.device, non_blocking=True)
    wide = dev.narrow(0, 0, 8 * n * len(int64s)).view(torch.int64).view(len(int64s), n)
    narrow = dev.narrow(0, 8 * n * len(int64s), 16 * n).view(torch.float32).view(4, n)
    # select, not [i]: see sampler._draw (a fake-CUDA trace has no CUDA library)
    temperature, top_p, min_p = (narrow.select(0, i) for i in range(3))
    k = narrow.select(0, 3).view(torch.int32)
    step = steps if isinstance(steps, torch.Tensor) else wide.select(0, 1)
    ids, _logprob = torch.ops.wattserve.triton_sample_ids(
        logits, temperature, k, top_p, min_p, wide.select(0, 0), step
    )
    return ids


def _signed64(seed: int | None) -> int:
    """The seed as an int64 (its low 64 bits), or a random one for an unseeded row."""
    s = _UNSEEDED.getrandbits(64) if seed is None else seed % _INT64
    return s - _INT64 if s >= _INT64 // 2 else s
