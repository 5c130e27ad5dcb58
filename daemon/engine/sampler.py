"""Next-token choice: greedy, temperature, top-k, top-p, min-p, per-request seeded generators.

Takes float32 logits for the rows that sample this step (after logits.process: banned
tokens are -inf) and returns one token id per row, or None for a row whose logits hold a
NaN or +inf or no finite value at all (that request fails alone).
It must not look at sequences, stop conditions or text.
"""

from __future__ import annotations

import torch

from daemon.engine.request import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on the device the logits live on (multinomial needs them together)."""
    g = torch.Generator(device=device)
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
    """logits: [N, V] float32; one SamplingParams and generator per row.

    A row fails only on NaN, +inf or nothing finite (a banned or grammar-masked token is a
    legitimate -inf). Greedy rows cost one device-to-host read for the whole batch
    (argmax and the check travel together); each non-greedy row reads its own choice back.
    """
    # A row's maximum is NaN if any logit is, +inf if any is, -inf if none is finite.
    finite = torch.isfinite(logits.amax(dim=-1))
    # -1 marks a row that fails; one read-back for the batch
    greedy_ids = torch.where(finite, logits.argmax(dim=-1), -1).cpu().tolist()
    out: list[int | None] = []
    for row, (p, greedy_id) in enumerate(zip(params, greedy_ids, strict=True)):
        if greedy_id < 0:
            out.append(None)
        elif p.greedy:
            out.append(greedy_id)
        else:
            out.append(_sample_row(logits[row], p, generators[row]))
    return out
