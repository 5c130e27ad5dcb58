"""Next-token choice: greedy, temperature, top-k, top-p, min-p, per-request seeded generators.

Takes float32 logits for the rows that sample this step (after logits.process: banned
tokens are -inf) and returns one token id per row, or None for a row whose logits hold a
NaN or +inf or no finite value at all (that request fails alone).

The sampled rows of a step are drawn together: one top-k over the batch finds each row's
candidates, the truncations are masks over them, and each row's token is where its
cumulative probability first passes one uniform number drawn from the row's own
generator, so a seed still fixes a request's tokens whatever else shares its steps.
top-k is applied first, top-p and min-p to the probabilities renormalized over the top
k. A row whose kept set could reach past its candidates (top-p or min-p on a flat
distribution; 1 of 194 steps of the embedded model at temperature 0.8, top-p 0.9) is
sampled alone over its whole sorted vocabulary (_sample_row), from the same distribution.
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


# Each truncating row looks for its kept tokens among its this many most likely ones
# (a top-k over the batch: 3 ms for 32 rows of 49,152 here, 11 ms for 1,024).
_CANDIDATES = 256


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """logits: [V] float32 -> token id: one row over its whole sorted vocabulary."""
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
    (argmax and the check travel together); the sampled rows one more, together.
    """
    # A row's maximum is NaN if any logit is, +inf if any is, -inf if none is finite.
    finite = torch.isfinite(logits.amax(dim=-1))
    # -1 marks a row that fails; one read-back for the batch
    greedy_ids = torch.where(finite, logits.argmax(dim=-1), -1).cpu().tolist()
    out: list[int | None] = [None if g < 0 else g for g in greedy_ids]
    rows = [
        r
        for r, (p, g) in enumerate(zip(params, greedy_ids, strict=True))
        if g >= 0 and not p.greedy
    ]
    if rows:
        drawn = _sample_rows(logits, rows, [params[r] for r in rows], [generators[r] for r in rows])
        for row, token in zip(rows, drawn, strict=True):
            out[row] = token
    return out


def _sample_rows(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    """Draw one token for each of `rows` (finite, non-greedy) of logits [N, V]."""
    dev = logits.device
    vocab = logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    scaled = logits.index_select(0, torch.tensor(rows, device=dev)) / temps.unsqueeze(1)
    plain = [i for i, p in enumerate(params) if not _truncates(p, vocab)]
    trunc = [i for i, p in enumerate(params) if _truncates(p, vocab)]
    out = [0] * len(rows)
    if plain:  # the whole vocabulary
        sub = scaled if len(plain) == len(rows) else scaled[plain]
        probs = torch.softmax(sub, dim=-1)
        choice = _draw(probs, [generators[i] for i in plain]).tolist()
        for i, c in zip(plain, choice, strict=True):
            out[i] = c
    if trunc:
        sub = scaled if len(trunc) == len(rows) else scaled[trunc]
        tp = [params[i] for i in trunc]
        top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in tp]
        n_cand = min(vocab, max(_CANDIDATES, *top_ks))
        values, indices = torch.topk(sub, n_cand, dim=-1)  # sorted, most likely first
        rank = torch.arange(n_cand, device=dev)
        has_k = torch.tensor([k > 0 for k in top_ks], device=dev)
        in_k = rank.unsqueeze(0) < torch.tensor(
            [k or n_cand for k in top_ks], device=dev
        ).unsqueeze(1)
        # Probabilities over the top k where a row sets top_k, else over the whole vocabulary.
        log_z = torch.where(
            has_k,
            torch.logsumexp(values.masked_fill(~in_k, float("-inf")), dim=-1),
            torch.logsumexp(sub, dim=-1),
        )
        probs = torch.exp(values - log_z.unsqueeze(1)) * in_k
        top_p = torch.tensor([p.top_p for p in tp], dtype=probs.dtype, device=dev)
        min_p = torch.tensor([p.min_p for p in tp], dtype=probs.dtype, device=dev)
        keep = in_k & ((probs.cumsum(dim=-1) - probs) < top_p.unsqueeze(1))
        keep &= probs >= min_p.unsqueeze(1) * probs[:, :1]
        keep[:, 0] = True  # a top_p below float32 resolution still keeps the best token
        # Without top_k a kept last candidate means the kept set may go on past them.
        spills = (keep[:, -1] & ~has_k).tolist() if n_cand < vocab else [False] * len(trunc)
        choice = _draw(probs * keep, [generators[i] for i in trunc])
        tokens = indices.gather(1, choice.unsqueeze(1)).squeeze(1).tolist()
        for j, i in enumerate(trunc):
            if spills[j]:
                out[i] = _sample_row(logits[rows[i]], params[i], generators[i])
            else:
                out[i] = tokens[j]
    return out


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One index per row of probs [R, C] (unnormalized, >= 0, some > 0), index i with
    probability probs[i] / sum: where the row's cumulative sum first exceeds a uniform
    draw from the row's own generator times the total."""
    cum = probs.cumsum(dim=-1)
    u = torch.cat(
        [torch.rand(1, generator=g, device=probs.device, dtype=probs.dtype) for g in generators]
    )
    idx = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # A draw that rounds onto the total would land past the last token with mass.
    positions = torch.arange(probs.shape[1], device=probs.device)
    last = torch.where(probs > 0, positions, 0).amax(dim=-1)
    return torch.minimum(idx, last)
