"""Token choice that stays on the device, for asynchronous steps: one launch, no read-back.

device_ids() returns a step's sampled ids as a device tensor (-1 where a row's logits hold
a NaN, a +inf or nothing finite), so that they can feed the next step's input ids on the
device and be read back later with the step's packed read-back; or None when some row
cannot be sampled this way (the engine then samples the step with sampler.sample,
synchronously). Greedy rows take the argmax (triton_greedy_ids on CUDA). Sampled rows go to
triton_sample's kernel where triton runs on the logits' device (CUDA, float32 rows of unit
stride), with the rows' parameters in one upload: a seeded row draws from Philox keyed by its
seed and its step (the position of the token it is choosing), so its tokens depend on neither
the batch nor the row, but they are not the CPU sampler's tokens for the same seed
(torch.Generator draws); an unseeded row gets a fresh random seed each call.
packed_read_back() lays the ids and, for rows that asked, the chosen token's logprob and the
top alternatives out in one float32 tensor (ids up to 2^24 are exact in float32), and
unpack() reads it on the host.

It must not look at sequences, stop conditions or text; logit processing (logits.py) comes
before it, and SamplingParams.validate has checked the parameters.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from wattserve.daemon.engine.request import SamplingParams, TokenLogprob
from wattserve.daemon.engine.sampler import greedy_ids
from wattserve.kernels.norm_rope import triton_rows_take

_UNSEEDED = random.Random()  # seeds for rows without one (OS entropy)
_INT64 = 1 << 64


def device_ids(
    logits: torch.Tensor,
    params: list[SamplingParams],
    steps: Sequence[int] | torch.Tensor | None = None,
    upload: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """logits: [N, V] float32 (processed), one SamplingParams per row -> int64 [N] on the
    logits' device, or None. steps: each row's step counter (a list, or an int64 tensor on
    the logits' device), needed by sampled rows; upload(host uint8 tensor) -> the same bytes
    on the device (default: a plain non-blocking copy; the engine passes its pinned one)."""
    if all(p.greedy for p in params):
        return greedy_ids(logits)
    if steps is None or logits.dtype != torch.float32 or not triton_rows_take(logits):
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
    dev = upload(host) if upload is not None else host.to(logits.device, non_blocking=True)
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


def packed_read_back(
    logits: torch.Tensor, ids: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    """float32 [N + N * (1 + 2k)] on the device: the ids, then (when any row asks for
    logprobs, k the most top alternatives asked) each row's chosen-token logprob, its top
    k logprobs and their ids. Only ids when no row asks."""
    k = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
    if k < 0:
        return ids.to(torch.float32)
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, ids.clamp(min=0).unsqueeze(1)).squeeze(1)
    parts = [ids.to(torch.float32), chosen]
    if k > 0:
        top_vals, top_ids = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
        parts += [top_vals.flatten(), top_ids.to(torch.float32).flatten()]
    return torch.cat(parts)


def unpack(
    values: list[float], params: list[SamplingParams]
) -> tuple[list[int | None], list[TokenLogprob | None]]:
    """The host list of a packed read-back -> (ids, None for a failed row; logprobs,
    None for rows that did not ask)."""
    n = len(params)
    ids = [int(v) for v in values[:n]]
    tokens: list[int | None] = [None if t < 0 else t for t in ids]
    logprobs: list[TokenLogprob | None] = [None] * n
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if not asked:
        return tokens, logprobs
    k = min(max(asked), (len(values) - 2 * n) // (2 * n) if n else 0)
    chosen = values[n : 2 * n]
    top_v = values[2 * n : 2 * n + n * k]
    top_i = values[2 * n + n * k : 2 * n + 2 * n * k]
    for r, p in enumerate(params):
        if p.logprobs is None or tokens[r] is None:
            continue
        m = min(p.logprobs, k)
        top = tuple((int(top_i[r * k + j]), top_v[r * k + j]) for j in range(m))
        logprobs[r] = TokenLogprob(tokens[r], chosen[r], top)  # type: ignore[arg-type]
    return tokens, logprobs
