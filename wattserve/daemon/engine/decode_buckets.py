"""Decode batch buckets: static shapes for a decode step, so that one CUDA graph per bucket
can replay it.

A decode step of n sequences whose block tables are at most w blocks wide runs as the
bucket (B, W): B the smallest batch bucket >= n, W the smallest power of two >= w. The
step's host layout is padded to it (pad_decode_layout) and copied into that bucket's
static device buffer (StaticDecodeInputs.load). Padding rows decode token 0 at position 0
with a context of one token in the model's pad block, which the KV manager never hands
out, so they write and read nothing of a real sequence; their logits are dropped.
Pure layout and copying: no capture here (cuda_graphs.py), no scheduling, no sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wattserve.daemon.engine.model import LlamaModel, StepInputs, StepLayout

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def batch_bucket(n: int, max_batch: int) -> int | None:
    """Smallest bucket >= n among those <= max_batch rounded up to a bucket; None when n
    is larger than every such bucket (the step then runs eagerly)."""
    if n < 1:
        raise ValueError(f"batch of {n} sequences")
    cap = next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1])
    return next((b for b in BATCH_BUCKETS if n <= b <= cap), None)


def width_bucket(blocks: int, max_blocks: int) -> int:
    """Block-table width for a decode step: the next power of two >= blocks, at most
    max_blocks (the widest table max_model_len allows), at least 1."""
    width = 1
    while width < blocks:
        width *= 2
    return max(1, min(width, max_blocks))


def pad_decode_layout(
    lay: StepLayout, batch: int, width: int, pad_block: int, block_size: int
) -> StepLayout:
    """lay (n decode rows, tables at most `width` wide) padded to `batch` rows x `width`.

    Table rows are padded with pad_block (masked by the context length); padding rows get
    token 0 at position 0 in pad_block's first slot, a one-token context, and logits (so
    that the logits shape is static too: the caller keeps the first n).
    """
    n = len(lay.input_ids)
    if len(lay.context_lens) != n or n > batch:
        raise ValueError(f"not a decode layout of at most {batch} rows")
    if any(len(r) > width for r in lay.block_tables):
        raise ValueError(f"a block table is wider than {width}")
    pad = batch - n
    return StepLayout(
        input_ids=lay.input_ids + [0] * pad,
        positions=lay.positions + [0] * pad,
        slots=lay.slots + [pad_block * block_size] * pad,
        query_start=list(range(batch + 1)),
        context_lens=lay.context_lens + [1] * pad,
        logits_indices=list(range(batch)),
        block_tables=[r + [pad_block] * (width - len(r)) for r in lay.block_tables]
        + [[pad_block] * width] * pad,
        sampled_chunks=lay.sampled_chunks,
    )


@dataclass
class StaticDecodeInputs:
    """One bucket's device buffer and the StepInputs views over it (a graph's inputs)."""

    batch: int
    width: int
    buffer: torch.Tensor  # int64, every field of the padded layout back to back
    inputs: StepInputs

    @classmethod
    def allocate(cls, model: LlamaModel, batch: int, width: int) -> StaticDecodeInputs:
        """A buffer laid out for (batch, width), filled with an all-padding step."""
        empty = pad_decode_layout(StepLayout(), batch, width, model.pad_block, model.block_size)
        size = sum(len(p) for p in empty.parts())
        buffer = torch.empty(size, dtype=torch.long, device=model.device)
        inputs = model.inputs_from(empty, into=buffer)
        return cls(batch, width, buffer, inputs)

    def load(self, model: LlamaModel, lay: StepLayout) -> StepInputs:
        """Copy a decode layout (padded here) into the buffer, in one host-to-device copy;
        returns the StepInputs views, whose sampled_chunks are lay's."""
        padded = pad_decode_layout(lay, self.batch, self.width, model.pad_block, model.block_size)
        model.inputs_from(padded, into=self.buffer)
        self.inputs.sampled_chunks = lay.sampled_chunks
        self.inputs.host_query_start = padded.query_start
        self.inputs.host_context_lens = padded.context_lens
        return self.inputs
