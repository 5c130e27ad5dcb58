"""Next-token choice: greedy, temperature, top-k, top-p, min-p, per-request seeded generators.

Takes float32 logits for the rows that sample this step (after logits.process: banned
tokens are -inf) and returns one token id per row, or None for a row whose logits hold a
NaN or +inf or no finite value at all (that request fails alone).
It must not look at sequences, stop conditions or text.
"""

from __future__ import annotations

import torch

from daemon.engine.request import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """logits: [V] float32 -> token id."""
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.shape[0]:
        values, indices = torch.topk(scaled, p.top_k)
    else:
        values, indices = torch.sort(scaled, descending=True)
    probs = torch.softmax(values, dim=-1)
    if p.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cum = torch.cumsum(probs, dim=-1)
        keep = (cum - probs) < p.top_p
        keep[0] = True  # a top_p below float32 resolution still keeps the best token
        probs = probs * keep
    if p.min_p > 0.0:
        # values are sorted: probs[0] is the top token's probability (always kept).
        probs = probs * (probs >= p.min_p * probs[0])
    choice = torch.multinomial(probs, 1, generator=gen)
    return int(indices[choice])


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int | None]:
    """logits: [N, V] float32; one SamplingParams and generator per row."""
    finite = (
        (~torch.isnan(logits).any(dim=-1))
        & (~torch.isposinf(logits).any(dim=-1))
        & torch.isfinite(logits).any(dim=-1)
    ).tolist()
    greedy_ids = logits.argmax(dim=-1).tolist()
    out: list[int | None] = []
    for row, (p, ok) in enumerate(zip(params, finite, strict=True)):
        if not ok:
            out.append(None)
        elif p.greedy:
            out.append(greedy_ids[row])
        else:
            out.append(_sample_row(logits[row], p, generators[row]))
    return out
