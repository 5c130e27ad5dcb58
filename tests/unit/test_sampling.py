"""Sampler, incremental detokenizer and request validation."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.tiny_model import build_tokenizer
from wattserve.daemon.engine.detokenizer import IncrementalDetokenizer
from wattserve.daemon.engine.logits import RowHistory, logprobs_of, process
from wattserve.daemon.engine.request import InvalidRequestError, SamplingParams
from wattserve.daemon.engine.sampler import make_generator, sample


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _logits(rows=3, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_take_the_argmax():
    logits = _logits()
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(top_k=1)]
    out = sample(logits, params, [make_generator(i) for i in range(3)])
    assert out == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_other_seed_differs():
    logits = _logits(rows=1, vocab=1000)
    p = SamplingParams(temperature=1.5, seed=7)

    def draw(seed):
        g = make_generator(seed)
        return [sample(logits, [p], [g])[0] for _ in range(30)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_p_and_top_k_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]])
    g = make_generator(0)
    top_p = {sample(logits, [SamplingParams(top_p=0.5)], [g])[0] for _ in range(200)}
    assert top_p == {0}  # token 0 alone holds > 50% of the mass
    top_k = {sample(logits, [SamplingParams(top_k=2, temperature=5.0)], [g])[0] for _ in range(300)}
    assert top_k == {0, 1}


def test_non_finite_row_fails_alone():
    logits = _logits()
    logits[1, 3] = float("nan")
    out = sample(logits, [SamplingParams(temperature=0.0)] * 3, [make_generator(0)] * 3)
    assert out[1] is None
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_detokenizer_streams_multibyte_text_exactly(tok):
    text = "café 日本語 €uro naïve ünïcödé"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], ())
    pieces = []
    for t in ids:
        detok.add(t)
        pieces.append(detok.take())
    pieces.append(detok.take(final=True))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_the_backend_stream_and_the_window_decoder_give_decode_s_text(tok):
    from wattserve.daemon.engine import detokenizer

    context = tok.encode("say:", add_special_tokens=False)
    ids = tok.encode(" café 日本語 €uro, naïve ünïcödé!", add_special_tokens=False)
    want = tok.decode(context + ids)[len(tok.decode(context)) :]
    stream = detokenizer.text_stream(tok, context, True)
    assert isinstance(stream, functools.partial)  # tokenizers' DecodeStream here
    window = detokenizer._WindowDecoder(tok.decode, context).step
    for step in (stream, window):
        pieces = [step(t) for t in ids]
        assert "".join(p for p in pieces if p) == want
        assert None in pieces  # a character split over tokens waits for its last piece
    detok = IncrementalDetokenizer(tok, context)  # no stop strings: step()'s short path
    assert "".join(detok.step(t) for t in ids) + detok.take(final=True) == want
    assert detok.text_length == len(want)


def test_stop_string_matched_across_tokens_and_not_emitted(tok):
    ids = tok.encode("abc def ghi jkl", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], ("f gh",))
    emitted = []
    stopped_at = None
    for i, t in enumerate(ids):
        if detok.add(t):
            stopped_at = i
            break
        emitted.append(detok.take())
    emitted.append(detok.take(final=True))
    assert stopped_at is not None
    assert "".join(emitted) == "abc de"


@pytest.mark.parametrize(
    "values,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"frequency_penaltyy": 1}, "frequency_penaltyy"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_parameters_are_named(values, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict(values)
    assert err.value.param == param


def test_good_parameters_round_trip():
    p = SamplingParams.from_dict({"max_tokens": 5, "stop": "x", "temperature": 0})
    assert p.stop == ("x",) and p.greedy and p.max_tokens == 5


def test_extreme_but_valid_values_do_not_break_sampling():
    logits = _logits(rows=1)
    best = int(logits[0].argmax())
    g = make_generator(0)
    assert sample(logits, [SamplingParams(temperature=5e-324)], [g]) == [best]
    assert sample(logits, [SamplingParams(top_p=5e-324)], [g]) == [best]


def test_penalties_bias_and_min_tokens_ban_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0], [0.1, 0.2, 0.3, 0.4]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(logit_bias=((2, -100.0),), min_tokens=3, stop_token_ids=(1,)),
        SamplingParams(),
    ]
    hist = [RowHistory([0], [1, 1, 3]), RowHistory([0], [2]), RowHistory([1], [1])]
    out = process(logits, params, hist, frozenset({3}))
    # Row 0: token 0 seen in the prompt (2 / 2); 1 twice in the output (-1 * 2 - 2 x 0.5
    # - 0.25); 3 once (3 / 2 - 0.5 - 0.25); 2 unseen.
    assert out[0].tolist() == pytest.approx([1.0, -3.25, 0.5, 0.75])
    assert out[1].tolist() == [1.0, -float("inf"), -99.0, -float("inf")]
    assert out[2].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert logits[0, 0] == 2.0  # the input is left alone
    # Nothing asked: the same tensor back, no copy.
    assert process(logits, [SamplingParams()] * 3, hist, frozenset({3})) is logits


def test_banned_tokens_are_never_sampled_and_do_not_fail_the_row():
    logits = torch.tensor([[5.0, 4.0, -float("inf"), 0.0]])
    g = make_generator(0)
    seen = {sample(logits, [SamplingParams(temperature=2.0)], [g])[0] for _ in range(300)}
    assert 2 not in seen and None not in seen


def test_min_p_keeps_tokens_near_the_top():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    g = make_generator(0)
    seen = {sample(logits, [SamplingParams(min_p=0.5)], [g])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_logprobs_of_reports_chosen_and_top():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    out = logprobs_of(logits, [0, 2], [2, 0])
    lp = torch.log_softmax(logits, dim=-1)
    assert out[0].token_id == 0 and out[0].logprob == pytest.approx(float(lp[0, 0]))
    assert [t for t, _ in out[0].top] == [2, 1]
    assert out[0].top[0][1] == pytest.approx(float(lp[0, 2]))
    assert out[1].top == ()


def test_stop_string_kept_with_include_stop(tok):
    ids = tok.encode("abc de fgh", add_special_tokens=False)
    for include, want in ((False, "abc"), (True, "abc de")):
        detok = IncrementalDetokenizer(tok, [], (" de",), include_stop=include)
        text = ""
        for t in ids:
            stopped = detok.add(t)
            text += detok.take()
            if stopped:
                break
        assert stopped and text + detok.take(final=True) == want


def _frequencies(logits, params, draws=4000, seed=0):
    """How often each token is drawn for each row, the rows sampled together each time."""
    gens = [make_generator(seed + i) for i in range(len(params))]
    counts = torch.zeros(logits.shape)
    for _ in range(draws):
        for row, tok in enumerate(sample(logits, params, gens)):
            counts[row, tok] += 1
    return counts / draws


def _expected(logits_row, p):
    """The distribution each row must be drawn from, by the definitions: top-k, then top-p
    and min-p on the probabilities renormalized over the top k."""
    values, idx = torch.sort(logits_row / p.temperature, descending=True)
    if p.top_k:
        values, idx = values[: p.top_k], idx[: p.top_k]
    probs = torch.softmax(values, -1)
    keep = (probs.cumsum(-1) - probs) < p.top_p
    keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    probs = probs * keep
    out = torch.zeros_like(logits_row)
    out[idx] = probs / probs.sum()
    return out


def test_rows_sampled_together_follow_each_rows_own_distribution():
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(3)) * 2
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
    ]
    freq = _frequencies(logits, params)
    for row, p in enumerate(params):
        expected = _expected(logits[row], p)
        assert (freq[row][expected == 0] == 0).all()  # never outside the kept set
        # 4000 draws: a standard error below 0.008 per token; 0.035 is over four of them.
        assert torch.allclose(freq[row], expected, atol=0.035), (row, freq[row], expected)


def test_a_nucleus_past_the_candidates_is_still_drawn_from_the_whole_vocabulary():
    # Flat logits over 3000 tokens: top_p 0.9 keeps ~2700 of them, past the top 1024.
    logits = torch.zeros(1, 3000)
    logits[0, 2900:] = -30.0  # the last 100 tokens hold almost no mass
    gens = [make_generator(1)]
    drawn = {sample(logits, [SamplingParams(top_p=0.9)], gens)[0] for _ in range(3000)}
    assert max(drawn) < 2900 and len(drawn) > 1200  # far more than 1024 distinct tokens


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_steps():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(5))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    alone_gen = make_generator(11)
    alone = [sample(logits[:1], [seeded], [alone_gen])[0] for _ in range(20)]
    shared_gens = [make_generator(11), make_generator(1), make_generator(2)]
    others = [SamplingParams(temperature=0.5), SamplingParams(temperature=2.0, top_k=3)]
    shared = [sample(logits, [seeded, *others], shared_gens)[0] for _ in range(20)]
    assert alone == shared
