"""Step buckets on the CPU: bucket choice, padding, and the static inputs of a graph.

A step padded into a larger bucket (more tokens, wider block tables) must give its real
rows the logits the unpadded step gives, with the C++ kernels here and with the Triton
kernels under the interpreter, and its padded tokens must leave every block the KV manager
hands out as the eager step leaves it. Capture itself is cuda_graphs.py's (test_step_graphs).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.step_graph_cases import TRITON_STEPS, steps_padded_and_eager
from wattserve.daemon.engine.model import StepLayout
from wattserve.daemon.engine.step_buckets import (
    Bucket,
    pad_layout,
    step_kind,
    token_bucket,
    width_bucket,
)


def test_token_and_width_buckets():
    assert [token_bucket(n, 64) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert token_bucket(65, 64) is None
    with pytest.raises(ValueError):
        token_bucket(0, 8)
    assert [width_bucket(w, 256) for w in (0, 1, 2, 3, 9, 256)] == [1, 1, 2, 4, 16, 256]
    assert width_bucket(200, 130) == 130


DECODE = StepLayout(
    input_ids=[7, 8],
    positions=[4, 9],
    slots=[17, 38],
    query_start=[0, 1, 2],
    context_lens=[5, 10],
    logits_indices=[0, 1],
    block_tables=[[4, 0], [2, 9]],
)
# a decode, then a 3-token prompt chunk that is not sampled
MIXED = StepLayout(
    input_ids=[7, 1, 2, 3],
    positions=[4, 0, 1, 2],
    slots=[17, 8, 9, 10],
    query_start=[0, 1, 4],
    context_lens=[5, 3],
    logits_indices=[0],
    block_tables=[[4, 0], [2, 2]],
)


def test_pad_decode_layout():
    assert step_kind(DECODE) == "decode"
    p = pad_layout(DECODE, Bucket("decode", 4, 4, 4), pad_block=12, block_size=4)
    assert p.input_ids == [7, 8, 0, 0] and p.positions == [4, 9, 0, 0]
    assert p.slots == [17, 38, 48, 48]
    assert p.query_start == [0, 1, 2, 3, 4] and p.context_lens == [5, 10, 1, 1]
    assert p.logits_indices == [0, 1, 0, 0]
    assert p.block_tables == [[4, 0, 12, 12], [2, 9, 12, 12], [12] * 4, [12] * 4]
    assert p.query_tiles == []
    for bucket in (Bucket("decode", 1, 4, 1), Bucket("decode", 4, 1, 4), Bucket("mixed", 4, 4, 3)):
        with pytest.raises(ValueError):
            pad_layout(DECODE, bucket, pad_block=12, block_size=4)


def test_pad_mixed_layout():
    assert step_kind(MIXED) == "mixed"
    bucket = Bucket("mixed", 8, 2, 3)
    assert bucket.chunks == 9  # never the token count: the attention's decode test
    p = pad_layout(MIXED, bucket, pad_block=12, block_size=4)
    assert p.input_ids == [7, 1, 2, 3, 0, 0, 0, 0] and p.positions == [4, 0, 1, 2, 0, 0, 0, 0]
    assert p.slots == [17, 8, 9, 10, 48, 48, 48, 48]
    # four padded one-token chunks, then three empty ones
    assert p.query_start == [0, 1, 4, 5, 6, 7, 8, 8, 8, 8]
    assert p.context_lens == [5, 3] + [1] * 7
    assert p.logits_indices == [0, 0, 0]
    assert p.block_tables == [[4, 0], [2, 2]] + [[12, 12]] * 7
    # (chunk, first row) tiles of 16 rows, padded with (-1, 0) to 8 // 16 + 9 pairs
    assert p.query_tiles == [0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0] + [-1, 0] * 3
    assert Bucket("mixed", 4, 2, 1).fits(MIXED)  # no padded token, one row: fits
    assert not Bucket("mixed", 8, 2, 0).fits(MIXED)  # no room for its logits row
    assert not Bucket("mixed", 2, 2, 1).fits(MIXED)  # too few tokens


ALL_STEPS = {"prefill_1_chunk", "mixed_2_chunks", "mixed_3_chunks", "mixed_4_chunks", "decode"}


def _assert_padded_matches(steps: dict, names=ALL_STEPS) -> None:
    assert set(steps) == names
    for name, r in steps.items():
        kind, tokens, _, rows = r["bucket"]
        assert r["padded"].shape == (rows, 96), name
        assert tokens > r["rows"], name  # padded tokens there were
        torch.testing.assert_close(r["padded"][: r["rows"]], r["eager"], rtol=1e-5, atol=1e-5)
        # padded tokens wrote the pad block only
        torch.testing.assert_close(r["kv_padded"], r["kv_eager"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_padded_static_steps_match_eager_on_the_cpu_kernels(window):
    _assert_padded_matches(steps_padded_and_eager("cpp", window))


def test_padded_static_steps_match_eager_on_the_torch_path():
    _assert_padded_matches(steps_padded_and_eager("torch", 5))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    pytest.importorskip("triton", reason="triton (a test extra) is not installed")
    from tests.unit.triton_interpret import interpreted_outputs

    return interpreted_outputs("tests.unit.step_graph_cases", tmp_path_factory.mktemp("steps"))


def test_padded_static_steps_match_eager_on_the_triton_kernels(interpreted):
    _assert_padded_matches(interpreted["window"], TRITON_STEPS)
