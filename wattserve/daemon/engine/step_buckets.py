"""Step buckets: static shapes for any step, so that one CUDA graph per bucket replays it.

A step of n tokens in b chunks whose block tables are at most w blocks wide runs as a
Bucket(kind, tokens, width): tokens the smallest power of two >= n, width the smallest
power of two >= w (at most the widest table max_model_len allows), kind "decode" when
every chunk is one token (the attention's one-program-per-sequence variant), "mixed"
otherwise (decodes and prompt chunks together). The step's host layout is padded to its
bucket (pad_layout) and copied into that bucket's static device buffer
(StaticStepInputs.load), which holds every tensor the forward reads: ids, positions, KV
slots, chunk bounds and context lengths, block tables, the rows that get logits and the
Triton attention's query tiles.

Padding: each padded token is a one-token chunk of its own at position 0 of the model's
pad block (which the KV manager never hands out), with a one-token context, so it writes
and reads nothing of a real sequence; padded logits rows point at row 0 and are dropped.
A decode bucket has one chunk slot per token (padded tokens fill it); a mixed bucket has
tokens + 1 slots (a mixed step's n tokens hold at most n - 1 chunks, so its chunks and its
padded tokens leave at least one slot over, which stays an empty chunk: the chunk count
then never equals the token count, which is what marks a decode step to the attention).
Pure layout and copying: no capture here (cuda_graphs.py), no scheduling, no sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from wattserve.daemon.engine.model import LlamaModel, StepInputs, StepLayout
from wattserve.kernels.attention import query_tiles

StepKind = Literal["decode", "mixed"]


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def token_bucket(n: int, max_tokens: int) -> int | None:
    """The token bucket of an n-token step: the next power of two, or None when that is
    above max_tokens (the step then runs eagerly)."""
    if n < 1:
        raise ValueError(f"a step of {n} tokens")
    bucket = next_power_of_two(n)
    return bucket if bucket <= max_tokens else None


def width_bucket(blocks: int, max_blocks: int) -> int:
    """Block-table width for a step: the next power of two >= blocks, at most
    max_blocks (the widest table max_model_len allows), at least 1."""
    return max(1, min(next_power_of_two(blocks), max_blocks))


def step_kind(lay: StepLayout) -> StepKind:
    """decode: every chunk of the layout is one token; mixed otherwise."""
    return "decode" if len(lay.input_ids) == len(lay.context_lens) else "mixed"


@dataclass(frozen=True)
class Bucket:
    """One static step shape: what a CUDA graph is captured for (with a level)."""

    kind: StepKind
    tokens: int  # query tokens, padded
    width: int  # block-table width, in blocks
    logits_rows: int  # rows that get logits: every token for decode, fewer for mixed

    @property
    def chunks(self) -> int:
        """Chunk slots: one per token for decode, tokens + 1 for mixed (module docstring)."""
        return self.tokens if self.kind == "decode" else self.tokens + 1

    def fits(self, lay: StepLayout) -> bool:
        """Whether lay pads into this bucket."""
        n = len(lay.input_ids)
        return (
            step_kind(lay) == self.kind
            and 0 < n <= self.tokens
            and len(lay.context_lens) + self.tokens - n <= self.chunks
            and len(lay.logits_indices) <= self.logits_rows
            and all(len(r) <= self.width for r in lay.block_tables)
        )


def pad_layout(lay: StepLayout, bucket: Bucket, pad_block: int, block_size: int) -> StepLayout:
    """lay padded to `bucket` (module docstring); raises ValueError when it does not fit.

    Its sampled_chunks and prompt_logit_chunks are lay's: the first len(lay.logits_indices)
    logits rows of the padded step are lay's rows, in lay's order.
    """
    if not bucket.fits(lay):
        raise ValueError(f"the step does not fit {bucket}")
    n, width = len(lay.input_ids), bucket.width
    pad_tokens = bucket.tokens - n
    empty_chunks = bucket.chunks - len(lay.context_lens) - pad_tokens
    pad_row = [pad_block] * width
    query_start = lay.query_start + list(range(n + 1, bucket.tokens + 1))
    query_start += [bucket.tokens] * empty_chunks
    padded = StepLayout(
        input_ids=lay.input_ids + [0] * pad_tokens,
        positions=lay.positions + [0] * pad_tokens,
        slots=lay.slots + [pad_block * block_size] * pad_tokens,
        query_start=query_start,
        context_lens=lay.context_lens + [1] * (pad_tokens + empty_chunks),
        logits_indices=lay.logits_indices + [0] * (bucket.logits_rows - len(lay.logits_indices)),
        block_tables=[r + [pad_block] * (width - len(r)) for r in lay.block_tables]
        + [pad_row] * (pad_tokens + empty_chunks),
        sampled_chunks=lay.sampled_chunks,
        prompt_logit_chunks=lay.prompt_logit_chunks,
    )
    if bucket.kind == "mixed":  # a static count: T // QUERY_TILE + chunks pairs
        padded.query_tiles = query_tiles(padded.query_start)
    return padded


@dataclass
class StaticStepInputs:
    """One bucket's device buffer and the StepInputs views over it (a graph's inputs)."""

    bucket: Bucket
    buffer: torch.Tensor  # int64, every field of the padded layout back to back
    inputs: StepInputs

    @classmethod
    def allocate(cls, model: LlamaModel, bucket: Bucket) -> StaticStepInputs:
        """A buffer laid out for `bucket`, filled with an all-padding step (one padded
        token and, for mixed, a two-token chunk at the pad block: a valid step of the
        bucket's kind that touches only the pad block)."""
        bs, pad = model.block_size, model.pad_block
        if bucket.kind == "decode":
            seed = StepLayout([0], [0], [pad * bs], [0, 1], [1], [0], [[pad]])
        else:
            seed = StepLayout([0, 0], [0, 1], [pad * bs, pad * bs + 1], [0, 2], [2], [1], [[pad]])
        empty = pad_layout(seed, bucket, pad, bs)
        size = sum(len(p) for p in empty.parts())
        buffer = torch.empty(size, dtype=torch.long, device=model.device)
        inputs = model.inputs_from(empty, into=buffer)
        return cls(bucket, buffer, inputs)

    def load(self, model: LlamaModel, lay: StepLayout) -> StepInputs:
        """Copy a layout (padded here) into the buffer, in one host-to-device copy;
        returns the StepInputs views, whose chunk lists are lay's."""
        padded = pad_layout(lay, self.bucket, model.pad_block, model.block_size)
        model.inputs_from(padded, into=self.buffer)
        self.inputs.sampled_chunks = lay.sampled_chunks
        self.inputs.prompt_logit_chunks = lay.prompt_logit_chunks
        self.inputs.host_query_start = padded.query_start
        self.inputs.host_context_lens = padded.context_lens
        return self.inputs
