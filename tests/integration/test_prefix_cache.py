"""Prefix caching end to end on the tiny random Llama: greedy outputs are the same with and
without the cache, through chunked prefill, preemption and aborts, and the pool drains."""

from __future__ import annotations

import json
import random

from tests.integration.test_engine import engine_with_blocks
from wattserve.daemon.engine.engine import Engine
from wattserve.daemon.engine.request import RequestOutput, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(vocab: int, n: int = 10, seed: int = 5) -> list[list[int]]:
    """n prompts on one 100-token prefix (cut at 3 lengths, one a block boundary), each
    with its own 0-20 tokens after it; the last is an exact repeat of the first."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(100)]
    prompts = [
        prefix[: (100, 96, 83)[i % 3]]
        + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 20))]
        for i in range(n - 1)
    ]
    return prompts + [list(prompts[0])]


def engine(loaded, caching: bool, blocks: int = 128, **options) -> Engine:
    return engine_with_blocks(loaded, blocks, enable_prefix_caching=caching, **options)


def test_shared_prefix_greedy_outputs_match_without_cache(tiny_llama):
    prompts = shared_prefix_prompts(len(tiny_llama.tokenizer))
    expected = [o.token_ids for o in engine(tiny_llama, False).generate(prompts, GREEDY)]
    # 64 tokens a step: the first prompt is prefilled over two steps, the rest find its
    # blocks; then a second round finds whole prompts (and generated blocks) cached.
    eng = engine(tiny_llama, True, max_num_batched_tokens=64)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == expected
    first_hits = eng.counters.prefix_cache_hit_tokens
    assert first_hits >= 8 * 80
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == expected
    c = eng.counters
    assert c.prefix_cache_hit_tokens - first_hits >= sum(len(p) - 16 for p in prompts)
    assert c.prefix_cache_queried_tokens == 2 * sum(map(len, prompts))
    assert 0 < c.prefix_cache_hit_ratio < 1
    assert eng.kv.num_used_blocks == 0 and eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.kv.num_evictable_blocks > 0


def test_tight_pool_preemption_and_abort_free_every_reference(tiny_llama):
    prompts = shared_prefix_prompts(len(tiny_llama.tokenizer), n=12, seed=9)
    expected = [o.token_ids for o in engine(tiny_llama, False).generate(prompts, GREEDY)]
    # 14 blocks (224 tokens) for 12 sequences of up to 132 tokens: preemption and eviction.
    eng = engine(tiny_llama, True, blocks=14, max_num_seqs=8, max_num_batched_tokens=48)
    merged: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}

    def sink(out: RequestOutput) -> None:
        merged.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finished:
            reasons[out.request_id] = out.finish_reason

    rids = [eng.add_request(p, GREEDY, sink) for p in prompts]
    aborted = {rids[3], rids[10]}
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        if steps == 6:
            for rid in aborted:
                eng.abort(rid)
    assert {rid for rid, why in reasons.items() if why == "abort"} == aborted
    for rid, want in zip(rids, expected, strict=True):
        if rid not in aborted:
            assert merged[rid] == want
    assert eng.counters.preemptions > 0
    assert eng.counters.prefix_cache_hit_tokens > 0
    assert eng.kv.num_used_blocks == 0 and eng.kv.num_free_blocks == eng.kv.num_blocks


def test_bench_prefix_prints_both_modes_in_one_json_line(tiny_dirs, tmp_path, monkeypatch, capsys):
    from wattserve.daemon.cli import main

    monkeypatch.setenv("WATTSERVE_CACHE", str(tmp_path))
    argv = ["bench", "prefix", "--model", str(tiny_dirs["llama"]), "--requests", "6"]
    argv += ["--system-tokens", "80", "--max-suffix", "20", "--new-tokens", "3"]
    argv += ["--max-num-batched-tokens", "64", "--kv-cache-mib", "4"]
    assert main(argv) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("ttft_p50_ms_cache", "ttft_p50_ms_no_cache", "tok_s_cache", "tok_s_no_cache"):
        assert line[key] > 0, key
    assert 0 < line["prefix_hit_ratio"] < 1
    assert line["dtype"] == "float32" and line["threads"] >= 1 and line["requests"] == 6
