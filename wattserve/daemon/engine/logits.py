"""Logit processing and log-probabilities for the rows one engine step samples.

process() applies, in this order, the repetition penalty (prompt and output tokens),
frequency and presence penalties (output tokens), logit_bias, and the min_tokens ban on
EOS / stop_token_ids, batched over the rows that need each one (tensor ops, no loops over
the vocabulary). logprobs_of() turns those processed logits (before temperature) into
log-probabilities with top-k alternatives. Runs on the engine thread; it must not choose
tokens (sampler.py does) nor look at text, stops or scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from wattserve.daemon.engine.request import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class RowHistory:
    """What a sampled row has seen: the token ids the penalties look at."""

    prompt_token_ids: Seq[int]
    output_token_ids: Seq[int]


def process(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: list[RowHistory],
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    """logits: [N, V] float32, one row per sampled request -> processed logits (a copy
    when anything applies, else the same tensor)."""
    if not any(p.processes_logits for p in params):
        return logits  # the common case: one pass over the rows
    n, vocab = logits.shape
    penal = [i for i, p in enumerate(params) if p.penalized]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    banned = [
        (i, _min_tokens_ban(p, eos_token_ids))
        for i, p in enumerate(params)
        if len(history[i].output_token_ids) < p.min_tokens
    ]
    if not (penal or biased or banned):
        return logits
    logits = logits.clone()
    if penal:
        _apply_penalties(logits, penal, params, history, vocab)
    if biased:
        rows = [i for i in biased for _ in params[i].logit_bias]
        toks = [t for i in biased for t, _ in params[i].logit_bias]
        vals = [b for i in biased for _, b in params[i].logit_bias]
        dev = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
            torch.tensor(vals, device=dev),
            accumulate=True,
        )
    banned = [(i, ids) for i, ids in banned if ids]
    if banned:
        toks = [t for _, ids in banned for t in ids if t < vocab]
        rows = [i for i, ids in banned for t in ids if t < vocab]
        dev = logits.device
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        toks_t = torch.tensor(toks, dtype=torch.long, device=dev)
        logits[rows_t, toks_t] = -float("inf")
    return logits


def _min_tokens_ban(p: SamplingParams, eos_token_ids: frozenset[int]) -> tuple[int, ...]:
    eos = () if p.ignore_eos else tuple(eos_token_ids)
    return tuple(dict.fromkeys(eos + p.stop_token_ids))


def _counts(ids: list[Seq[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32 occurrence counts of each row's ids."""
    width = max((len(x) for x in ids), default=0)
    # Pad with an extra column `vocab` that is dropped afterwards; one copy to the device.
    padded = [list(x) + [vocab] * (max(width, 1) - len(x)) for x in ids]
    index = torch.tensor(padded, dtype=torch.long, device=device)
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def _apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    history: list[RowHistory],
    vocab: int,
) -> None:
    dev = logits.device
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    sub = logits.index_select(0, idx)
    out_counts = _counts([history[i].output_token_ids for i in rows], vocab, dev)
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=dev).unsqueeze(1)
    if bool((rep != 1.0).any()):
        seen = out_counts > 0
        seen |= _counts([history[i].prompt_token_ids for i in rows], vocab, dev) > 0
        # CTRL's rule, as vLLM and transformers apply it: shrink toward lower probability.
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=dev).unsqueeze(1)
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=dev).unsqueeze(1)
    sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    logits.index_copy_(0, idx, sub)


def logprobs_of(logits: torch.Tensor, token_ids: list[int], tops: list[int]) -> list[TokenLogprob]:
    """logits: [M, V] float32 (processed, before temperature); token_ids: the token each
    row's logprob is reported for; tops: how many alternatives per row (0..20)."""
    if not token_ids:
        return []
    lp = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(token_ids, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = lp.gather(1, index).squeeze(1)
    k = max(tops)
    if k > 0:
        top_vals, top_ids = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
        top_v, top_i = top_vals.tolist(), top_ids.tolist()
    out = []
    for r, (tok, value) in enumerate(zip(token_ids, chosen.tolist(), strict=True)):
        top = tuple(zip(top_i[r][: tops[r]], top_v[r][: tops[r]], strict=True)) if k else ()
        out.append(TokenLogprob(tok, value, top))
    return out
