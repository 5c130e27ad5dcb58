"""Token choice that stays on the device, for asynchronous steps.

device_ids() returns the step's sampled ids as a device tensor (-1 where a row's logits
hold a NaN, a +inf or nothing finite), never reading anything back, so that they can feed
the next step's input ids on the device and be read back later with the step's packed
read-back; or None when some row cannot be sampled this way yet (the engine then samples
the step with sampler.sample, synchronously). packed_read_back() lays those ids and, for
rows that asked, the chosen token's logprob and the top alternatives out in one float32
tensor (ids up to 2^24 are exact in float32), and unpack() reads it on the host.

It must not look at sequences, stop conditions or text; logit processing (logits.py)
comes before it.
"""

from __future__ import annotations

import torch

from wattserve.daemon.engine.request import SamplingParams, TokenLogprob
from wattserve.kernels.norm_rope import triton_rows_take


def device_ids(
    logits: torch.Tensor,
    params: list[SamplingParams],
) -> torch.Tensor | None:
    """logits: [N, V] float32 (processed) -> int64 [N] on logits' device, or None."""
    if not all(p.greedy for p in params):
        # The one spot for sampled (non-greedy) rows: a counter-based (Philox) sampler
        # with per-row seeds and parameters as device tensors goes here; until then the
        # step samples on the host side (sampler.sample), synchronously.
        return None
    if triton_rows_take(logits):  # one launch on CUDA
        return torch.ops.wattserve.triton_greedy_ids(logits)
    # A row's maximum is NaN if any logit is, +inf if any is, -inf if none is finite.
    finite = torch.isfinite(logits.amax(dim=-1))
    return torch.where(finite, logits.argmax(dim=-1), -1)


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
