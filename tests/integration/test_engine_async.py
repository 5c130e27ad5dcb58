"""Asynchronous steps (async_steps) run on the CPU with the recording device ops.

The engine's async code path, forced on over a tiny random-weight model: step N+1 is
launched (its decodes' input ids taken from step N's sampled ids, on the device) before N's
read-back is waited on; a request found finished one step late drops that extra token. What
it delivers must be what the synchronous path delivers: greedy prompts stopping on a stop
token id, on a stop string and on length, with logprobs.
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
from tests.integration.test_engine_overlap import _needles
from wattserve.daemon.engine.request import RequestOutput, SamplingParams

PROMPT = [7, 8, 9, 10]
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_engine(loaded, async_steps: bool | None, blocks: int = 64, **options):
    return engine_with_blocks(loaded, blocks, async_steps=async_steps, **options)


def _summary(out: RequestOutput) -> tuple:
    return (out.text, out.finish_reason, out.token_ids, out.completion_tokens, out.prompt_tokens)


def _logprobs_close(a: RequestOutput, b: RequestOutput) -> None:
    # the same log-softmax over a different number of rows: equal to float32 rounding
    assert (a.logprobs is None) == (b.logprobs is None)
    for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
        assert x.token_id == y.token_id
        assert x.logprob == pytest.approx(y.logprob, rel=1e-5, abs=1e-6)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], rel=1e-5, abs=1e-6)


def test_the_cpu_default_is_synchronous_and_records_nothing(tiny_llama):
    engine = make_engine(tiny_llama, None)
    assert engine._async is False
    engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0))
    assert not engine.device_ops.recording


def test_async_steps_deliver_what_synchronous_steps_deliver(tiny_llama):
    full = make_engine(tiny_llama, False).generate([PROMPT], LONG)[0]
    needles = _needles(tiny_llama.tokenizer, full.token_ids)
    stop_id = full.token_ids[5]
    common = dict(temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=24, stop=(needle,), logprobs=2, **common)
        for needle in needles.values()
    ]
    params += [
        SamplingParams(max_tokens=24, stop_token_ids=(stop_id,), **common),  # a stop id
        SamplingParams(max_tokens=7, logprobs=0, **common),  # length
        SamplingParams(max_tokens=12, temperature=0.0),  # EOS on
        LONG,
    ]
    prompts = [PROMPT] * len(params)
    prompts += prompts_for(len(tiny_llama.tokenizer), n=6)
    params += [SamplingParams(max_tokens=9 + i, temperature=0.0) for i in range(6)]
    results, counters = {}, {}
    for mode in (False, True):
        engine = make_engine(tiny_llama, mode, max_num_seqs=6, max_num_batched_tokens=48)
        results[mode] = engine.generate(prompts, params)
        assert engine.kv.num_used_blocks == 0 and not engine.has_work()
        counters[mode] = engine.counters.generation_tokens
        if mode:
            got = engine.device_ops.summary()
            assert got["syncs_before_next_launch"] == 0
            assert got["d2h_copies_per_step"] == 1
            assert got["unpinned_or_blocking_d2h_copies"] == 0
    assert counters[True] == counters[False] == sum(o.completion_tokens for o in results[True])
    for sync, asyn in zip(results[False], results[True], strict=True):
        assert _summary(asyn) == _summary(sync)
        _logprobs_close(asyn, sync)
    finishes = [o.finish_reason for o in results[True]]
    assert finishes[: len(needles) + 2] == ["stop"] * (len(needles) + 1) + ["length"]
    assert results[True][len(needles)].token_ids == full.token_ids[:6]


@pytest.mark.parametrize("how", ["stop id", "stop string", "length"])
def test_a_request_found_finished_one_step_late_drops_the_extra_token(tiny_llama, how):
    full = make_engine(tiny_llama, False).generate([PROMPT], LONG)[0]
    common = dict(temperature=0.0, ignore_eos=True)
    params = {
        "stop id": SamplingParams(max_tokens=24, stop_token_ids=(full.token_ids[4],), **common),
        "stop string": SamplingParams(
            max_tokens=24,
            stop=(_needles(tiny_llama.tokenizer, full.token_ids)["mid-token into the next"],),
            **common,
        ),
        "length": SamplingParams(max_tokens=6, **common),
    }[how]
    outs, steps_with_it = {}, {}
    for mode in (False, True):
        engine = make_engine(tiny_llama, mode)
        plans = recording(engine)
        events: list[RequestOutput] = []
        engine.add_request(PROMPT, params, events.append, request_id="r")
        while engine.has_work():
            engine.step()
        outs[mode] = [t for e in events for t in e.token_ids]
        steps_with_it[mode] = sum(any(c.seq.seq_id == "r" for c in p.chunks) for p in plans)
        assert [e.finished for e in events].count(True) == 1 and events[-1].finished
        assert events[-1].completion_tokens == len(outs[mode])
        assert engine.counters.generation_tokens == len(outs[mode])
        assert engine.kv.num_used_blocks == 0 and engine.num_running == 0
    assert outs[True] == outs[False] == full.token_ids[: len(outs[False])]
    assert steps_with_it[False] == len(outs[False])
    # the step launched before the finish was read back computed one more token, dropped;
    # a stop string is found in the text of step N after N+1 is launched, as with the
    # overlap, and N+2 is scheduled after that text: one extra step as well
    assert steps_with_it[True] == len(outs[True]) + 1


def test_rows_that_need_host_state_run_synchronously_with_the_same_outputs(tiny_llama):
    penalized = SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.5)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=3)
    outs = {}
    for mode in (False, True):
        engine = make_engine(tiny_llama, mode)
        outs[mode] = [_summary(o) for o in engine.generate([PROMPT] * 2, [penalized, sampled])]
        if mode:  # sampled on the host after each step: no read-back in flight, ever
            assert [op for op in engine.device_ops.ops if op[0] != "launch"] == []
    assert outs[True] == outs[False]


def test_sampled_rows_without_a_device_sampler_run_synchronously_with_the_same_outputs(
    tiny_llama,
):
    # Off CUDA device_ids has no sampler for them: the step's logits, processed once for
    # the device attempt, are what the host sampler draws from.
    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5, logprobs=2)
    outs = {}
    for mode in (False, True):
        engine = make_engine(tiny_llama, mode)
        outs[mode] = [_summary(o) for o in engine.generate([PROMPT], [sampled])]
        if mode:
            assert [op for op in engine.device_ops.ops if op[0] != "launch"] == []
    assert outs[True] == outs[False]


def test_greedy_outputs_match_hf_through_chunked_prefill_preemption_and_prefix_cache(
    tiny_llama,
):
    prompts = prompts_for(len(tiny_llama.tokenizer), n=12)
    head = prompts[3][:40]  # a shared head gives the prefix cache something to find
    prompts = [head + p if i % 2 else p for i, p in enumerate(prompts)]
    expected = hf_greedy(tiny_llama.hf_model, prompts)
    engine = make_engine(tiny_llama, True, blocks=12, max_num_seqs=8, max_num_batched_tokens=16)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert engine.counters.preemptions > 0 and engine.counters.prefix_cache_hit_tokens > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.device_ops.summary()["syncs_before_next_launch"] == 0
