"""Per-token cost of grammar masks at a batch: xgrammar against llguidance.

`python -m wattserve.bench.grammar [--model embedded|tiny] [--batch 16] [--steps 200]` walks `batch`
matchers of one JSON schema through random allowed tokens (seeded), timing each step's
mask fill for the whole batch and each sampled token's advance, per library; and checks
that every walk that ends is valid JSON of the schema. `--engine` instead measures the
engine's output tok/s at `batch` with and without a json_schema, alternating, in one run.
It never serves. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "kind", "score"],
    "additionalProperties": False,
}


def _tokenizer(model: str):
    if model == "tiny":
        from tests.tiny_model import build_tokenizer

        tok = build_tokenizer()
        return tok, len(tok)
    from wattserve.daemon.engine.loader import load_model

    loaded = load_model("embedded", Path.home() / ".cache" / "wattserve")
    return loaded.tokenizer, loaded.hf_model.config.vocab_size


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.reshape(-1)[:vocab]).flatten().tolist()


def _walk(fill, advance, reset, batch: int, vocab: int, bitmask, steps: int, seed: int):
    """fill(): the whole batch's masks; advance(i, tok) -> terminated?; reset(i)."""
    rng = random.Random(seed)
    fill_s, adv_s, produced = [], [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        fill()
        fill_s.append(time.perf_counter() - t0)
        picks = [rng.choice(_allowed(bitmask[i], vocab)) for i in range(batch)]
        t0 = time.perf_counter()
        done = [advance(i, t) for i, t in enumerate(picks)]
        adv_s.append(time.perf_counter() - t0)
        produced += batch
        for i, d in enumerate(done):
            if d:
                reset(i)
    return fill_s, adv_s


def bench_xgrammar(tok, vocab: int, batch: int, steps: int, threads: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=threads)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    batcher = xgr.BatchGrammarMatcher(max_threads=threads)

    def fill() -> None:
        batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(i: int, t: int) -> bool:
        assert matchers[i].accept_token(t)
        return matchers[i].is_terminated()

    def reset(i: int) -> None:
        matchers[i].reset()

    fill_s, adv_s = _walk(fill, advance, reset, batch, vocab, bitmask, steps, 0)
    return _summary("xgrammar", version("xgrammar"), setup_s, compile_s, fill_s, adv_s, batch)


def bench_llguidance(tok, vocab: int, batch: int, steps: int, threads: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    executor = llguidance.LLExecutor(num_threads=threads)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    assert not matchers[0].is_error(), matchers[0].get_error()
    compile_s = time.perf_counter() - t0
    bitmask = llt.allocate_token_bitmask(batch, vocab)

    def fill() -> None:
        llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def advance(i: int, t: int) -> bool:
        assert matchers[i].consume_token(t), matchers[i].get_error()
        return matchers[i].is_stopped()

    def reset(i: int) -> None:
        matchers[i] = llguidance.LLMatcher(lltok, grammar)

    fill_s, adv_s = _walk(fill, advance, reset, batch, vocab, bitmask, steps, 0)
    return _summary("llguidance", version("llguidance"), setup_s, compile_s, fill_s, adv_s, batch)


def _walk_validity(tok, vocab: int, walks: int) -> dict:
    """Random walks to the end of SCHEMA per library: how many that end are not valid
    JSON (a walk still going after 2000 tokens is counted apart)."""
    import jsonschema_rs
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    import xgrammar as xgr

    eos = tok.eos_token_id
    compiled = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    ).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    rng = random.Random(1)
    invalid = {"xgrammar": 0, "llguidance": 0}
    unfinished = {"xgrammar": 0, "llguidance": 0}
    off_float = {"xgrammar": 0, "llguidance": 0}
    for _ in range(walks):
        for name in invalid:
            if name == "xgrammar":
                m = xgr.GrammarMatcher(compiled)
                fill = lambda bm, m=m: m.fill_next_token_bitmask(bm)  # noqa: E731
                step, done = m.accept_token, m.is_terminated
            else:
                m = llguidance.LLMatcher(lltok, grammar)
                fill = lambda bm, m=m: llt.fill_next_token_bitmask(m, bm, 0)  # noqa: E731
                step, done = m.consume_token, m.is_stopped
            bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
            out: list[int] = []
            for _ in range(2000):
                fill(bitmask)
                t = rng.choice(_allowed(bitmask[0], vocab))
                step(t)
                if t != eos:
                    out.append(t)
                if done():
                    break
            else:
                unfinished[name] += 1
                continue
            try:
                value = json.loads(tok.decode(out))
            except ValueError:
                invalid[name] += 1
                continue
            # Numbers past float range (1e999) parse as inf, which no schema validator
            # accepts as a number although the JSON is valid: counted apart.
            if not jsonschema_rs.is_valid(SCHEMA, value):
                off_float[name] += 1
    return {
        "walks": walks,
        "invalid_json": invalid,
        "valid_json_failing_schema": off_float,
        "unfinished_in_2000_tokens": unfinished,
    }


def engine_tokps(batch: int, max_tokens: int, rounds: int) -> dict:
    """Output tok/s of the embedded model at `batch`, greedy, without and with a JSON
    schema that cannot finish inside max_tokens (so both runs make the same tokens)."""
    from wattserve.daemon.engine.engine import Engine, EngineOptions
    from wattserve.daemon.engine.loader import load_model
    from wattserve.daemon.engine.request import GuidedDecoding, SamplingParams

    loaded = load_model("embedded", Path.home() / ".cache" / "wattserve")
    engine = Engine(loaded, EngineOptions(max_num_seqs=batch, max_num_batched_tokens=2048))
    schema = {
        "type": "object",
        "properties": {
            "fruits": {
                "type": "array",
                "items": {"type": "string", "maxLength": 16},
                "minItems": 100,
            }
        },
        "required": ["fruits"],
    }
    guide = GuidedDecoding("json", json.dumps(schema))
    engine.grammars.compile(guide, "bench")  # tokenizer table and grammar: not timed
    prompts = [f"List {i + 3} fruits as JSON:" for i in range(batch)]
    runs: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for _ in range(rounds):
        for name, g in (("plain", None), ("json_schema", guide)):
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True, guided=g
            )
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            dt = time.perf_counter() - t0
            made = sum(len(o.token_ids) for o in outs)
            assert made == batch * max_tokens, made
            runs[name].append(made / dt)
    plain, guided = statistics.median(runs["plain"]), statistics.median(runs["json_schema"])
    return {
        "plain_tok_s": round(plain, 1),
        "json_schema_tok_s": round(guided, 1),
        "cost_pct": round(100 * (plain - guided) / plain, 1),
        "runs": {k: [round(v, 1) for v in vs] for k, vs in runs.items()},
        "max_tokens": max_tokens,
        "dtype": str(loaded.dtype).removeprefix("torch."),
    }


def _summary(name, version, setup_s, compile_s, fill_s, adv_s, batch) -> dict:
    return {
        "library": name,
        "version": version,
        "tokenizer_setup_ms": round(setup_s * 1e3, 1),
        "schema_compile_ms": round(compile_s * 1e3, 1),
        "batch_fill_ms_median": round(statistics.median(fill_s) * 1e3, 3),
        "batch_fill_ms_p90": round(sorted(fill_s)[int(0.9 * len(fill_s))] * 1e3, 3),
        "advance_ms_per_token_median": round(statistics.median(adv_s) * 1e3 / batch, 4),
        "mask_us_per_token_median": round(statistics.median(fill_s) * 1e6 / batch, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "embedded"), default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--walks", type=int, default=50, help="validity walks per library")
    ap.add_argument("--engine", action="store_true", help="engine tok/s with and without")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.engine:
        r = engine_tokps(args.batch, args.max_tokens, args.rounds)
        load = [round(x, 2) for x in os.getloadavg()]
        print(
            json.dumps(
                {
                    "bench": "grammar-engine",
                    "model": "embedded",
                    "batch": args.batch,
                    "threads": args.threads,
                    "loadavg": load,
                    **r,
                }
            )
        )
        return
    tok, vocab = _tokenizer(args.model)
    results = []
    for bench in (bench_xgrammar, bench_llguidance):
        r = bench(tok, vocab, args.batch, args.steps, args.threads)
        print(json.dumps(r))
        results.append(r)
    validity = _walk_validity(tok, vocab, args.walks) if args.walks else None
    print(
        json.dumps(
            {
                "bench": "grammar",
                "model": args.model,
                "vocab": vocab,
                "batch": args.batch,
                "steps": args.steps,
                "threads": args.threads,
                "results": results,
                "validity": validity,
                "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
