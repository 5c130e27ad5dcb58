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
drawn again by the same code with every token a candidate.
It must not look at sequences, stop conditions or text.
"""

from __future__ import annotations

import torch

from wattserve.daemon.engine.request import SamplingParams
from wattserve.kernels.extension import kernels_take
from wattserve.kernels.norm_rope import triton_rows_take


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on the device the logits live on (multinomial needs them together)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] float32 -> each row's argmax, int64 [N] on the logits' device, -1
    for a row with a NaN, a +inf or nothing finite; nothing is read back."""
    if triton_rows_take(logits):  # one launch on CUDA
        return torch.ops.wattserve.triton_greedy_ids(logits)
    if logits.dtype == torch.float32 and kernels_take(logits):  # the CPU's C++ row op
        return torch.ops.wattserve.greedy_rows(logits)
    # A row's maximum is NaN if any logit is, +inf if any is, -inf if none is finite.
    top, ids = logits.max(dim=-1)
    return torch.where(torch.isfinite(top), ids, -1)


# Each truncating row looks for its kept tokens among its this many most likely ones
# (a top-k over the batch: 3 ms for 32 rows of 49,152 here, 11 ms for 1,024).
_CANDIDATES = 256


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int | None]:
    """logits: [N, V] float32; one SamplingParams and generator per row.

    A row fails only on NaN, +inf or nothing finite (a banned or grammar-masked token is a
    legitimate -inf). The whole batch, greedy and sampled rows, costs one device-to-host
    read, and sampled rows one upload of their parameters (rows drawn again over their whole
    vocabulary, rare, cost one more of each).
    """
    n, vocab = logits.shape
    dev = logits.device
    if all(p.greedy for p in params):  # one op: a Triton launch on CUDA, C++ on the CPU
        return [None if t < 0 else t for t in greedy_ids(logits).cpu().tolist()]
    greedy = tokens = greedy_ids(logits)  # -1: a row that fails, sampled or not
    spills = torch.zeros(n, dtype=torch.long, device=dev)
    truncating = {r: _truncates(p, vocab) for r, p in enumerate(params) if not p.greedy}
    # plain-temperature rows first, then the truncating ones: each part a slice
    rows = sorted(truncating, key=truncating.__getitem__)
    if rows:
        n_plain = sum(not truncating[r] for r in rows)
        idx, drawn, spilled = _draw_rows(logits, rows, n_plain, params, generators, _CANDIDATES)
        tokens = tokens.index_copy(0, idx, drawn)
        spills = spills.index_copy(0, idx, spilled.long())
    # -1 marks a row that fails; one read-back for the batch
    ids, spill_flags = torch.stack([torch.where(greedy < 0, -1, tokens), spills]).cpu().tolist()
    out: list[int | None] = [None if t < 0 else t for t in ids]
    again = [
        r for r, (t, spill) in enumerate(zip(ids, spill_flags, strict=True)) if spill and t >= 0
    ]
    if again:  # every token a candidate: nothing can spill
        _, drawn, _ = _draw_rows(logits, again, 0, params, generators, vocab)
        for row, token in zip(again, drawn.tolist(), strict=True):
            out[row] = token
    return out


def _draw_rows(
    logits: torch.Tensor,
    rows: list[int],
    n_plain: int,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    candidates: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upload `rows`' parameters (the first n_plain only scale by temperature) and draw
    their tokens: (row indices, tokens, spilled), all on logits' device."""
    vocab = logits.shape[1]
    host = [[r, *_row_params(params[r], vocab)] for r in rows]
    # one upload: row, temperature, top_p, min_p, top_k (0: none)
    table = torch.tensor(host, dtype=torch.float64, device=logits.device)
    idx = table.select(1, 0).long()
    max_top_k = max(int(row[4]) for row in host)
    drawn, spilled = _sample_rows(
        logits.index_select(0, idx),
        table.narrow(1, 1, 4),
        n_plain,
        max(candidates, max_top_k),
        [generators[r] for r in rows],
    )
    return idx, drawn, spilled


def _row_params(p: SamplingParams, vocab: int) -> tuple[float, float, float, int]:
    return p.temperature, p.top_p, p.min_p, p.top_k if 0 < p.top_k < vocab else 0


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _sample_rows(
    logits: torch.Tensor,
    table: torch.Tensor,
    n_plain: int,
    candidates: int,
    generators: list[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token for each row of logits [R, V] on their device; table [R, 4] holds
    each row's temperature, top_p, min_p and top_k (0: none). The first n_plain rows only
    scale by their temperature; the others truncate, each among its `candidates` most
    likely tokens (at least its top_k). Returns (tokens [R], spilled [R]): a spilled row's
    kept set could reach past its candidates, and its token is to be drawn again over the
    whole vocabulary."""
    dev = logits.device
    r_all, vocab = logits.shape
    temps, top_p, min_p, top_k = (table.select(1, j) for j in range(4))
    scaled = logits / temps.to(logits.dtype).unsqueeze(1)
    parts_tokens, parts_spilled = [], []
    if n_plain:  # the whole vocabulary
        sub = scaled.narrow(0, 0, n_plain)
        parts_tokens.append(_draw(torch.softmax(sub, dim=-1), generators[:n_plain]))
        parts_spilled.append(torch.zeros(n_plain, dtype=torch.bool, device=dev))
    n_trunc = r_all - n_plain
    if n_trunc:
        sub = scaled.narrow(0, n_plain, n_trunc)
        k = top_k.narrow(0, n_plain, n_trunc).long()
        n_cand = min(vocab, candidates)
        values, indices = torch.topk(sub, n_cand, dim=-1)  # sorted, most likely first
        rank = torch.arange(n_cand, device=dev)
        has_k = k > 0
        in_k = rank.unsqueeze(0) < torch.where(has_k, k, n_cand).unsqueeze(1)
        # Probabilities over the top k where a row sets top_k, else over the whole vocabulary.
        log_z = torch.where(
            has_k,
            torch.logsumexp(torch.where(in_k, values, float("-inf")), dim=-1),
            torch.logsumexp(sub, dim=-1),
        )
        probs = torch.exp(values - log_z.unsqueeze(1)) * in_k
        tp = top_p.narrow(0, n_plain, n_trunc).to(probs.dtype).unsqueeze(1)
        mp = min_p.narrow(0, n_plain, n_trunc).to(probs.dtype).unsqueeze(1)
        keep = in_k & ((probs.cumsum(dim=-1) - probs) < tp)
        keep &= probs >= mp * probs.narrow(1, 0, 1)  # narrow: see _draw
        keep.select(1, 0).fill_(True)  # a top_p below float32 resolution keeps the best
        choice = _draw(probs * keep, generators[n_plain:])
        parts_tokens.append(indices.gather(1, choice.unsqueeze(1)).squeeze(1))
        if n_cand < vocab:  # without top_k a kept last candidate: the set may go on
            parts_spilled.append(keep.select(1, n_cand - 1) & has_k.logical_not())
        else:
            parts_spilled.append(torch.zeros(n_trunc, dtype=torch.bool, device=dev))
    return torch.cat(parts_tokens), torch.cat(parts_spilled)


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One index per row of probs [R, C] (unnormalized, >= 0, some > 0), index i with
    probability probs[i] / sum: where the row's cumulative sum first exceeds a uniform
    draw from the row's own generator times the total."""
    cum = probs.cumsum(dim=-1)
    u = torch.cat(
        [torch.rand(1, generator=g, device=probs.device, dtype=probs.dtype) for g in generators]
    )
    # narrow, not cum[:, -1]: Python indexing of a CUDA tensor needs the CUDA library,
    # which a fake-CUDA trace on a CPU-only torch does not have (as in apply_rope)
    total = cum.narrow(1, cum.shape[1] - 1, 1)
    idx = torch.searchsorted(cum, u.unsqueeze(1) * total, right=True).squeeze(1)
    # A draw that rounds onto the total would land past the last token with mass.
    positions = torch.arange(probs.shape[1], device=probs.device)
    last = torch.where(probs > 0, positions, 0).amax(dim=-1)
    return torch.minimum(idx, last)
