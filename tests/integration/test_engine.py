"""The engine end to end on tiny random-weight models, checked against HF transformers."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from wattserve.daemon.engine import engine as engine_module
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import load_model
from wattserve.daemon.engine.request import InvalidRequestError, RequestOutput, SamplingParams
from wattserve.daemon.engine.scheduler import DECODE_INTERVAL_MAX_MS

DEVICE = torch.device("cpu")  # the engine is always given its device explicitly

NEW_TOKENS = 16
# EOS stays on: HF's min_new_tokens would mask EOS out of the argmax, ignore_eos does not.
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


def prompts_for(vocab: int, n: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 3, 60, 47] + [rng.randint(1, 60) for _ in range(n - 5)]
    return [[rng.randrange(3, vocab) for _ in range(k)] for k in lengths]


def hf_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids, max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def block_bytes(loaded, block_size=16) -> int:
    cfg = loaded.hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * 4


def engine_with_blocks(loaded, blocks: int, **options) -> Engine:
    """An engine on the CPU whose KV pool holds `blocks` blocks; options as EngineOptions."""
    return Engine(
        loaded, EngineOptions(kv_cache_bytes=blocks * block_bytes(loaded), **options), device=DEVICE
    )


def recording(engine: Engine) -> list:
    """Wrap the scheduler so the test can see every plan the engine ran."""
    plans = []
    real = engine.scheduler.schedule

    def schedule(limits):
        plan = real(limits)
        plans.append(plan)
        return plan

    engine.scheduler.schedule = schedule
    return plans


@pytest.fixture(scope="module")
def loaded_models(tiny_dirs, cache_dir):
    return {arch: load_model(str(d), cache_dir) for arch, d in tiny_dirs.items()}


@pytest.fixture(scope="module")
def references(loaded_models):
    refs = {}
    for arch, lm in loaded_models.items():
        prompts = prompts_for(len(lm.tokenizer))
        refs[arch] = (prompts, hf_greedy(lm.hf_model, prompts))
    return refs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_batched_greedy_matches_hf_generate(arch, loaded_models, references):
    lm = loaded_models[arch]
    prompts, expected = references[arch]
    engine = Engine(
        lm,
        EngineOptions(
            kv_cache_bytes=256 * block_bytes(lm), max_num_seqs=64, max_num_batched_tokens=2048
        ),
        device=DEVICE,
    )
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    for o in outs:
        ended_on_eos = o.token_ids[-1] in engine.eos_token_ids
        assert o.finish_reason == ("stop" if ended_on_eos else "length")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_prefill_and_preemption_keep_outputs_identical(arch, loaded_models, references):
    lm = loaded_models[arch]
    prompts, expected = references[arch]
    # 10 blocks of 16 = 160 tokens for 24 sequences of up to 76 tokens, 16 tokens a step.
    engine = Engine(
        lm,
        EngineOptions(
            kv_cache_bytes=10 * block_bytes(lm), max_num_seqs=8, max_num_batched_tokens=16
        ),
        device=DEVICE,
    )
    plans = recording(engine)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert engine.counters.preemptions > 0
    partial = [c for p in plans for c in p.chunks if c.num_tokens > 1 and not c.samples]
    assert partial, "some prompt should have been split over steps"
    assert max(p.num_tokens for p in plans) <= 16
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_runtime_cap_changes_lose_nothing_and_change_nothing(loaded_models, references):
    lm = loaded_models["llama"]
    prompts, expected = references["llama"]
    engine = Engine(lm, EngineOptions(kv_cache_bytes=256 * block_bytes(lm)), device=DEVICE)
    caps = [(1, 8), (5, 64), (2, 3), (16, 512), (3, 7)]
    seen_running = []

    def turn_knobs(stats):
        seqs, tokens = caps[stats.step % len(caps)]
        engine.set_limits(max_num_seqs=seqs, max_num_batched_tokens=tokens)
        seen_running.append(stats.num_running)

    engine.add_step_hook(turn_knobs)
    results: dict[str, list[int]] = {}
    done = threading.Event()
    lock = threading.Lock()
    order = []

    def sink(out: RequestOutput) -> None:
        with lock:
            results.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finished.append(out.request_id)
                if len(finished) == len(prompts):
                    done.set()

    finished: list[str] = []
    engine.start()
    try:
        for p in prompts:
            order.append(engine.add_request(p, GREEDY, sink))
        assert done.wait(120), "requests did not finish"
    finally:
        engine.stop()
    assert [results[rid] for rid in order] == expected
    assert engine.counters.preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_abort_frees_blocks_within_one_step(tiny_llama):
    engine = Engine(
        tiny_llama, EngineOptions(kv_cache_bytes=64 * block_bytes(tiny_llama)), device=DEVICE
    )
    first = threading.Event()
    finished = threading.Event()
    final: list[RequestOutput] = []
    steps_at = {}

    def sink(out: RequestOutput) -> None:
        if out.finished:
            steps_at["finish"] = engine.counters.steps
            final.append(out)
            finished.set()
        elif out.token_ids:
            first.set()

    engine.start()
    try:
        rid = engine.add_request([5] * 30, SamplingParams(max_tokens=400, ignore_eos=True), sink)
        assert first.wait(30)
        steps_at["abort"] = engine.counters.steps
        engine.abort(rid)
        assert finished.wait(30)
    finally:
        engine.stop()
    assert final[0].finish_reason == "abort"
    assert steps_at["finish"] - steps_at["abort"] <= 1
    assert engine.kv.num_used_blocks == 0 and engine.num_running == 0


def test_each_step_hands_its_events_over_in_one_delivery(tiny_llama):
    engine = Engine(
        tiny_llama, EngineOptions(kv_cache_bytes=64 * block_bytes(tiny_llama)), device=DEVICE
    )
    batches: list[list[tuple[object, RequestOutput]]] = []
    engine.set_delivery(batches.append)
    seen: dict[str, list[int]] = {}

    def sink(out: RequestOutput) -> None:
        seen.setdefault(out.request_id, []).extend(out.token_ids)

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([3 + i] * 5, params, sink) for i in range(4)]
    steps = 0
    while engine.has_work():
        before = len(batches)
        if engine.step() is not None:
            steps += 1
            # One delivery per step, carrying every running request's token (or finish).
            assert len(batches) == before + 1
            assert {out.request_id for _, out in batches[-1]} == set(ids)
    assert steps == 6 and len(batches) == 6
    for batch in batches:  # nothing was called before the delivery ran
        assert all(sink_ is sink for sink_, _ in batch)
    assert not seen
    for batch in batches:
        for sink_, out in batch:
            sink_(out)
    assert sorted(seen) == sorted(ids) and all(len(t) == 6 for t in seen.values())


def test_nan_in_one_request_fails_it_alone(tiny_llama):
    engine = Engine(
        tiny_llama, EngineOptions(kv_cache_bytes=64 * block_bytes(tiny_llama)), device=DEVICE
    )
    prompts = prompts_for(len(tiny_llama.tokenizer), n=6, seed=3)
    expected = hf_greedy(tiny_llama.hf_model, prompts)
    victim = prompts[2]
    real_forward = engine.model.forward

    def poisoned(inputs):
        logits = real_forward(inputs).clone()  # inference tensors are read-only outside
        for row, chunk in enumerate(inputs.sampled_chunks):
            if chunk.seq.prompt_token_ids == victim and chunk.seq.output_token_ids:
                logits[row, 0] = float("nan")
        return logits

    engine.model.forward = poisoned
    outs = engine.generate(prompts, GREEDY)
    assert outs[2].finish_reason == "error" and "non-finite" in outs[2].error
    for i in (0, 1, 3, 4, 5):
        assert outs[i].token_ids == expected[i] and outs[i].finish_reason in ("length", "stop")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_bad_input_is_rejected_by_name_and_others_keep_going(tiny_llama):
    engine = Engine(
        tiny_llama,
        EngineOptions(kv_cache_bytes=16 * block_bytes(tiny_llama), max_model_len=128),
        device=DEVICE,
    )
    bad = [
        ("", SamplingParams(), "prompt", None),
        ([], SamplingParams(), "prompt", None),
        ([1] * 128, SamplingParams(), "prompt", "context_length_exceeded"),
        ([1] * 100, SamplingParams(max_tokens=29), "max_tokens", "context_length_exceeded"),
        ([10**9], SamplingParams(), "prompt", None),
        ([3, 4], SamplingParams(max_tokens=0), "max_tokens", None),
        ([3, 4], SamplingParams(temperature=-1.0), "temperature", None),
        ([3, 4], SamplingParams(top_p=0.0), "top_p", None),
    ]
    for prompt, params, param, code in bad:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(prompt, params, lambda out: None)
        assert err.value.param == param and err.value.code == code
    out = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.finish_reason == "length" and out.completion_tokens == 4
    assert not engine.has_work()


def test_stop_conditions(tiny_llama):
    engine = Engine(
        tiny_llama, EngineOptions(kv_cache_bytes=64 * block_bytes(tiny_llama)), device=DEVICE
    )
    prompt = [7, 8, 9, 10]
    full = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    # A stop token id ends the request at its first occurrence.
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = engine.generate(
        [prompt],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,)),
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    # A stop string is matched in the text and not emitted.
    text = full.text
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(needle,))
    )[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(needle)]
    # EOS ends a request unless ignore_eos; the engine treats the tokenizer's EOS as such.
    eos = next(iter(engine.eos_token_ids))
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=())
    )[0]
    assert out.finish_reason == "stop" if eos in out.token_ids else out.finish_reason == "length"


def test_seeded_sampling_is_reproducible(tiny_llama):
    engine = Engine(
        tiny_llama, EngineOptions(kv_cache_bytes=64 * block_bytes(tiny_llama)), device=DEVICE
    )
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    a = engine.generate([[5, 6, 7]], p)[0].token_ids
    b = engine.generate([[5, 6, 7]], p)[0].token_ids
    c = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=20, temperature=1.0, seed=43, ignore_eos=True)
    )[0].token_ids
    assert a == b and a != c


def test_decode_pacing_holds_decode_only_steps_until_an_arrival(tiny_llama, monkeypatch):
    # The engine's clock stands still, so the interval never runs out by itself however
    # slowly this test runs; only an arrival or turning pacing off ends the wait.
    frozen_s = time.monotonic()
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(monotonic=lambda: frozen_s))
    engine = Engine(
        tiny_llama, EngineOptions(kv_cache_bytes=64 * block_bytes(tiny_llama)), device=DEVICE
    )
    engine.set_limits(decode_interval_ms=DECODE_INTERVAL_MAX_MS)
    outs: list[RequestOutput] = []
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request([5] * 20, params, outs.append)
    first = engine.step()
    assert first is not None and first.prefill_tokens == 20
    # After a step with prefill the next one runs at once; after a decode-only step the
    # engine waits for the interval and computes nothing meanwhile.
    second = engine.step()
    assert second is not None and second.prefill_tokens == 0 and second.decode_tokens == 1
    assert engine.step() is None and engine.step() is None
    assert engine.pacing_wait_s() == DECODE_INTERVAL_MAX_MS / 1000.0
    assert engine.counters.steps == 2
    # An arrival ends the wait: its prefill step runs at once.
    engine.add_request([7] * 9, params, outs.append)
    third = engine.step()
    assert third is not None and third.prefill_tokens == 9 and third.decode_tokens == 1
    # Turning pacing off takes effect at the next step.
    engine.step()
    assert engine.pacing_wait_s() > 0
    engine.set_limits(decode_interval_ms=0.0)
    assert engine.pacing_wait_s() == 0.0 and engine.step() is not None


def test_decode_pacing_changes_no_output(loaded_models, references):
    lm = loaded_models["llama"]
    prompts, expected = references["llama"]
    engine = Engine(lm, EngineOptions(kv_cache_bytes=256 * block_bytes(lm)), device=DEVICE)
    engine.set_limits(decode_interval_ms=2.0)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert engine.limits.decode_interval_ms == 2.0


def test_decode_interval_must_be_a_finite_number_at_least_zero(tiny_llama):
    engine = Engine(
        tiny_llama, EngineOptions(kv_cache_bytes=16 * block_bytes(tiny_llama)), device=DEVICE
    )
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="decode_interval_ms"):
            engine.set_limits(decode_interval_ms=bad)
    assert engine.limits.decode_interval_ms == 0.0
