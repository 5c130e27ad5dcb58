"""Decode batch buckets on the CPU: bucket choice, padding, and the static graph inputs.

The padded step must give the real rows the logits the unpadded step gives, and its
padding rows must leave every block the KV manager hands out untouched. CUDA-graph
capture itself (cuda_graphs.py) needs a real GPU and is not exercised here.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_model import tiny_hf_llama
from wattserve.daemon.engine.decode_buckets import (
    StaticDecodeInputs,
    batch_bucket,
    pad_decode_layout,
    width_bucket,
)
from wattserve.daemon.engine.model import LlamaModel, StepLayout
from wattserve.daemon.engine.scheduler import ScheduledChunk, Sequence


def test_batch_bucket():
    assert [batch_bucket(n, 64) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert batch_bucket(65, 64) is None
    assert batch_bucket(40, 48) == 64  # a cap between buckets rounds up to one
    assert batch_bucket(600, 1000) is None
    with pytest.raises(ValueError):
        batch_bucket(0, 8)


def test_width_bucket():
    assert [width_bucket(w, 256) for w in (0, 1, 2, 3, 9, 256)] == [1, 1, 2, 4, 16, 256]
    assert width_bucket(200, 130) == 130


def test_pad_decode_layout():
    lay = StepLayout(
        input_ids=[7, 8],
        positions=[4, 9],
        slots=[17, 38],
        query_start=[0, 1, 2],
        context_lens=[5, 10],
        logits_indices=[0, 1],
        block_tables=[[4, 0], [2, 9]],
    )
    p = pad_decode_layout(lay, batch=4, width=4, pad_block=12, block_size=4)
    assert p.input_ids == [7, 8, 0, 0] and p.positions == [4, 9, 0, 0]
    assert p.slots == [17, 38, 48, 48]
    assert p.query_start == [0, 1, 2, 3, 4] and p.context_lens == [5, 10, 1, 1]
    assert p.logits_indices == [0, 1, 2, 3]
    assert p.block_tables == [[4, 0, 12, 12], [2, 9, 12, 12], [12] * 4, [12] * 4]
    with pytest.raises(ValueError):
        pad_decode_layout(lay, batch=1, width=4, pad_block=12, block_size=4)
    with pytest.raises(ValueError):
        pad_decode_layout(lay, batch=4, width=1, pad_block=12, block_size=4)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_llama(weight_std=0.15)


def _prefilled(hf_model, backend: str):
    """A model with three sequences' prompts in its cache and their decode layout."""
    model = LlamaModel(hf_model, 16, 4, torch.float32, torch.device("cpu"))
    model.attention_backend = backend if backend == "torch" else model.attention_backend
    seqs = [Sequence(s, list(range(1 + i, 6 + 3 * i))) for i, s in enumerate("abc")]
    tables = {"a": [5, 1], "b": [3, 7, 0], "c": [2, 9, 4]}
    prefill = [ScheduledChunk(s, 0, len(s.prompt_token_ids), True) for s in seqs]
    model.forward(model.prepare(prefill, tables))
    for s, tok in zip(seqs, (11, 12, 13), strict=True):
        s.output_token_ids.append(tok)
    decode = [ScheduledChunk(s, s.num_tokens - 1, 1, True) for s in seqs]
    return model, model.layout(decode, tables)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_padded_static_decode_matches_eager(hf_model, backend):
    model, lay = _prefilled(hf_model, backend)
    before = [c.clone() for c in model.k_cache + model.v_cache]
    eager = model.forward(model.inputs_from(lay))
    after_eager = [c.clone() for c in model.k_cache + model.v_cache]
    for c, b in zip(model.k_cache + model.v_cache, before, strict=True):
        c.copy_(b)
    static = StaticDecodeInputs.allocate(model, batch=8, width=4)
    inputs = static.load(model, lay)
    assert inputs.input_ids.data_ptr() == static.buffer.data_ptr()  # views of the buffer
    padded = model.forward(inputs)
    assert padded.shape == (8, 96)
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    real = model.num_blocks  # the pad block is the last one; only it may differ
    for c, e in zip(model.k_cache + model.v_cache, after_eager, strict=True):
        torch.testing.assert_close(c[:real], e[:real], rtol=1e-5, atol=1e-5)


def test_static_buffer_reloaded_with_fewer_rows_is_padded_again(hf_model):
    model, lay = _prefilled(hf_model, "cpp")
    static = StaticDecodeInputs.allocate(model, batch=4, width=4)
    static.load(model, lay)
    smaller = StepLayout(
        input_ids=lay.input_ids[:1],
        positions=lay.positions[:1],
        slots=lay.slots[:1],
        query_start=[0, 1],
        context_lens=lay.context_lens[:1],
        logits_indices=[0],
        block_tables=[lay.block_tables[0]],
        sampled_chunks=lay.sampled_chunks[:1],
    )
    inputs = static.load(model, smaller)
    expected = pad_decode_layout(smaller, 4, 4, model.pad_block, model.block_size)
    assert inputs.input_ids.tolist() == expected.input_ids
    assert inputs.slots.tolist() == expected.slots
    assert inputs.context_lens.tolist() == expected.context_lens
    assert inputs.block_tables.tolist() == expected.block_tables
    assert inputs.sampled_chunks == smaller.sampled_chunks
