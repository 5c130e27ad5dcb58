"""The grammar mask as a tensor op, and compile errors, on the tiny test tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_model import build_tokenizer
from wattserve.daemon.engine.grammar import Grammars, apply_masks
from wattserve.daemon.engine.request import GuidedDecoding, InvalidRequestError, SamplingParams


def test_bit_j_of_word_w_allows_token_32w_plus_j() -> None:
    logits = torch.zeros(2, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # token 5
    bitmask[0, 2] = 1 << 3  # token 67
    bitmask[1] = -1  # a row without a grammar: everything allowed
    out = apply_masks(logits, bitmask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5, 67]
    assert torch.isfinite(out[1]).all()
    assert torch.equal(logits, torch.zeros(2, 70))  # the input is left as it was
    assert apply_masks(logits, None) is logits


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = build_tokenizer()
    return Grammars(tok, len(tok), frozenset({tok.eos_token_id}))


def test_a_choice_walks_to_its_end_and_then_allows_nothing_else(grammars) -> None:
    tok = grammars._tokenizer
    state = grammars.state(GuidedDecoding("choice", json.dumps(["ab"])))
    for t in tok.encode("ab", add_special_tokens=False):
        mask = apply_masks(torch.zeros(1, grammars.vocab_size), grammars.fill_masks([state]))
        assert torch.isfinite(mask[0, t])
        assert not torch.isfinite(mask[0, tok.eos_token_id])  # not complete yet
        assert state.advance(t)
    assert state.terminated
    assert grammars.fill_masks([None]) is None


@pytest.mark.parametrize(
    "guide",
    [
        GuidedDecoding("json", '{"type": "nope"}'),
        GuidedDecoding("json", "{"),
        GuidedDecoding("regex", "(("),
        GuidedDecoding("grammar", "start: undefined_rule"),
    ],
)
def test_what_cannot_compile_is_an_invalid_request(grammars, guide) -> None:
    with pytest.raises(InvalidRequestError) as info:
        grammars.compile(guide, "guided_x")
    assert info.value.param == "guided_x"
    assert info.value.code == "invalid_grammar"


def test_min_tokens_and_a_guide_are_refused_together() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(min_tokens=1, guided=GuidedDecoding("regex", "a")).validate()
    assert info.value.param == "min_tokens"
