"""overlap_detokenize: step N's text is made after step N+1's forward is launched.

On the CPU the option is off by default; these tests force it on (and compare with it
off) on tiny random-weight models: the order of the work, stop strings cut exactly as
without the overlap, the in-flight token of a request a stop string ended dropped, aborts,
and greedy outputs equal to HF transformers through chunked prefill, preemption and the
prefix cache.
"""

from __future__ import annotations

import pytest

from tests.integration.test_engine import (
    GREEDY,
    engine_with_blocks,
    hf_greedy,
    prompts_for,
    recording,
)
from wattserve.daemon.engine import detokenizer as detokenizer_module
from wattserve.daemon.engine.engine import Engine
from wattserve.daemon.engine.request import RequestOutput, SamplingParams

PROMPT = [7, 8, 9, 10]
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def make_engine(loaded, overlap: bool, blocks: int = 64, **options) -> Engine:
    return engine_with_blocks(loaded, blocks, overlap_detokenize=overlap, **options)


def test_the_default_is_on_for_cuda_only(tiny_llama):
    assert make_engine(tiny_llama, None)._overlap_detokenize is False  # type: ignore[arg-type]
    assert make_engine(tiny_llama, True)._overlap_detokenize is True


@pytest.mark.parametrize("overlap", [False, True])
def test_step_n_is_detokenized_after_step_n_plus_1_is_launched(tiny_llama, monkeypatch, overlap):
    engine = make_engine(tiny_llama, overlap)
    order: list[tuple[str, int]] = []
    real_forward = engine.model.forward

    def forward(inputs):
        order.append(("forward", len(order)))
        return real_forward(inputs)

    real_stream = detokenizer_module.text_stream

    def text_stream(*args):
        step = real_stream(*args)

        def recorded(token_id):
            order.append(("text", token_id))
            return step(token_id)

        return recorded

    engine.model.forward = forward
    monkeypatch.setattr(detokenizer_module, "text_stream", text_stream)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    delivered: list[int] = []
    engine.add_request(PROMPT, params, lambda out: delivered.extend(out.token_ids))
    calls = 0
    while engine.has_work():
        engine.step()
        calls += 1
    kinds = "".join("F" if kind == "forward" else "T" for kind, _ in order)
    # Five tokens, five forwards. With the overlap each step's text comes after the next
    # forward (the last step has none to launch); without it, right after its own.
    assert kinds == ("FFTFTFTFTT" if overlap else "FTFTFTFTFT")
    assert [t for kind, t in order if kind == "text"] == delivered and len(delivered) == 5
    assert calls == 5  # one step() per step, as without the overlap


def _needles(tokenizer, token_ids: list[int]) -> dict[str, str]:
    """Stop strings cut from the greedy continuation's tokens: inside one token, from
    the middle of one token into the next, and over three tokens."""
    pieces = [tokenizer.decode([t]) for t in token_ids]
    ok = [p.isascii() and p.isprintable() for p in pieces]
    inner = next(p for p, good in zip(pieces, ok, strict=True) if good and len(p) >= 3)
    k = next(
        i
        for i in range(1, len(pieces) - 4)
        if all(ok[i : i + 3]) and len(pieces[i]) >= 2 and len(pieces[i + 2]) >= 2
    )
    return {
        "inside one token": inner[1:-1],
        "mid-token into the next": pieces[k][1:] + pieces[k + 1][:1],
        "over three tokens": pieces[k][-1] + pieces[k + 1] + pieces[k + 2][:1],
    }


def _summary(out: RequestOutput) -> tuple:
    return (
        out.text,
        out.finish_reason,
        out.token_ids,
        out.completion_tokens,
        out.prompt_tokens,
        out.logprobs,
    )


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_cut_the_same_text_with_and_without_the_overlap(tiny_llama, include_stop):
    full = make_engine(tiny_llama, False).generate([PROMPT], LONG)[0]
    needles = _needles(tiny_llama.tokenizer, full.token_ids)
    # A batch: one request per needle, and one without a stop string sharing its steps.
    params = [
        SamplingParams(
            max_tokens=24,
            temperature=0.0,
            ignore_eos=True,
            logprobs=2,
            stop=(needle,),
            include_stop_str_in_output=include_stop,
        )
        for needle in needles.values()
    ] + [LONG]
    prompts = [PROMPT] * len(params)
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_llama, overlap)
        results[overlap] = engine.generate(prompts, params)
        assert engine.kv.num_used_blocks == 0 and not engine.has_work()
        assert engine.counters.generation_tokens == sum(
            o.completion_tokens for o in results[overlap]
        )
    assert [_summary(o) for o in results[True]] == [_summary(o) for o in results[False]]
    for (what, needle), out in zip(needles.items(), results[True], strict=False):
        at = full.text.index(needle)
        cut = at + (len(needle) if include_stop else 0)
        assert (out.text, out.finish_reason) == (full.text[:cut], "stop"), what
        assert out.token_ids == full.token_ids[: len(out.token_ids)], what
        assert len(out.token_ids) < len(full.token_ids), what
        assert out.completion_tokens == len(out.token_ids) == len(out.logprobs), what
    assert _summary(results[True][-1]) == _summary(full)


def test_a_request_a_stop_string_ends_loses_its_in_flight_token(tiny_llama):
    full = make_engine(tiny_llama, False).generate([PROMPT], LONG)[0]
    needle = _needles(tiny_llama.tokenizer, full.token_ids)["mid-token into the next"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(needle,))
    steps_with_it = {}
    outs = {}
    for overlap in (False, True):
        engine = make_engine(tiny_llama, overlap)
        plans = recording(engine)
        events: list[RequestOutput] = []
        engine.add_request(PROMPT, params, events.append, request_id="stopped")
        while engine.has_work():
            engine.step()
        steps_with_it[overlap] = sum(
            any(c.seq.seq_id == "stopped" for c in plan.chunks) for plan in plans
        )
        assert [e.finished for e in events].count(True) == 1 and events[-1].finished
        outs[overlap] = [t for e in events for t in e.token_ids]
        assert events[-1].completion_tokens == len(outs[overlap])
        assert engine.counters.generation_tokens == len(outs[overlap])
        assert engine.kv.num_used_blocks == 0 and engine.num_running == 0
    # With the overlap the step after the stop was already launched with the request in it;
    # its token was computed and dropped: not delivered, not counted, blocks freed.
    assert steps_with_it[False] == len(outs[False])
    assert steps_with_it[True] == len(outs[True]) + 1
    assert outs[True] == outs[False] == full.token_ids[: len(outs[False])]


def test_an_abort_frees_blocks_at_the_next_step_and_ends_after_its_tokens(tiny_llama):
    engine = make_engine(tiny_llama, True)
    batches: list[list[tuple[object, RequestOutput]]] = []
    engine.set_delivery(batches.append)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(PROMPT, params, lambda out: None)
    other = engine.add_request([11, 12, 13], params, lambda out: None)
    engine.step()
    engine.step()  # two tokens each delivered; the third step is in flight
    engine.abort(rid)
    stats = engine.step()
    # This step's token of the aborted request is delivered, then its end; the step that
    # was launched meanwhile does not hold it and its blocks are free.
    events = [out for _, out in batches[-1] if out.request_id == rid]
    assert [(len(e.token_ids), e.finished) for e in events] == [(1, False), (0, True)]
    assert events[-1].finish_reason == "abort" and events[-1].completion_tokens == 3
    assert stats is not None and engine.scheduler.get(rid) is None
    assert [s.seq_id for s in engine.scheduler.running] == [other]
    while engine.has_work():
        engine.step()
    delivered = [out for batch in batches for _, out in batch if out.request_id == rid]
    assert delivered[-1].finished and len(delivered) == 4  # nothing after its end
    assert engine.kv.num_used_blocks == 0


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    prompts = prompts_for(len(tiny_llama.tokenizer))
    return prompts, hf_greedy(tiny_llama.hf_model, prompts)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_outputs_match_hf_through_chunked_prefill_and_preemption(
    tiny_llama, llama_reference, prefix_caching
):
    prompts, expected = llama_reference
    # A shared head on half the prompts gives the prefix cache something to find.
    head = prompts[3][:40]
    prompts = [head + p if i % 2 else p for i, p in enumerate(prompts)]
    expected = [
        e if i % 2 == 0 else hf_greedy(tiny_llama.hf_model, [prompts[i]])[0]
        for i, e in enumerate(expected)
    ]
    engine = make_engine(
        tiny_llama,
        True,
        blocks=12,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        enable_prefix_caching=prefix_caching,
    )
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert engine.counters.preemptions > 0
    if prefix_caching:
        assert engine.counters.prefix_cache_hit_tokens > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
