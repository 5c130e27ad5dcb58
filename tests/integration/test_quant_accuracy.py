"""`wattserve bench quant --prompts-file` on a tiny random model: per level, what the
daemon's HTTP API and lm-eval report must be what a direct forward of the same model at
the same level computes from the same items (accuracy, normalised accuracy, mean gold
log-likelihood, agreement with full precision)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.test_engine import block_bytes
from wattserve.bench.quant import sequence_logits
from wattserve.bench.quant_accuracy import EXAMPLE_PROMPTS_FILE, read_prompts_file
from wattserve.daemon.cli import main
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.request import SamplingParams

ITEMS = 8
LEVELS = ("fp32", "int8")


def _loglikelihood(engine, tok, context: str, continuation: str) -> float:
    """Sum of the continuation's token log-probabilities, split as lm-eval splits."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_context = len(tok.encode(context, add_special_tokens=False))
    with torch.inference_mode():
        logprobs = torch.log_softmax(sequence_logits(engine.model, whole), dim=-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(n_context, len(whole)))


def _direct(loaded, items: list[dict]) -> dict[str, dict]:
    """Per level: acc, acc_norm (log-likelihood per character), gold mean, chosen answers."""
    engine = Engine(
        loaded, EngineOptions(kv_cache_bytes=64 * block_bytes(loaded), quantization_levels=LEVELS)
    )
    out = {}
    for level in LEVELS:
        engine.set_quant_level(level)
        engine.generate([[3, 4, 5]], SamplingParams(max_tokens=1))  # applies the level
        assert engine.quant_level == level
        chosen, chosen_norm, gold = [], [], []
        for it in items:
            lls = [
                _loglikelihood(engine, loaded.tokenizer, it["context"], c) for c in it["choices"]
            ]
            per_char = [ll / len(c) for ll, c in zip(lls, it["choices"], strict=True)]
            chosen.append(max(range(len(lls)), key=lls.__getitem__))
            chosen_norm.append(max(range(len(lls)), key=per_char.__getitem__))
            gold.append(lls[it["answer"]])
        answers = [it["answer"] for it in items]
        out[level] = {
            "acc": sum(a == b for a, b in zip(chosen, answers, strict=True)) / len(items),
            "acc_norm": sum(a == b for a, b in zip(chosen_norm, answers, strict=True)) / len(items),
            "gold_loglikelihood_mean": sum(gold) / len(gold),
            "chosen": chosen,
        }
    return out


def test_accuracy_through_the_api_is_the_direct_forward_s(
    tiny_dirs, tiny_llama, tmp_path, monkeypatch, capsys
):
    items = read_prompts_file(EXAMPLE_PROMPTS_FILE)[:ITEMS]  # the shipped example parses
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    monkeypatch.setenv("WATTSERVE_CACHE", str(tmp_path / "cache"))
    argv = ["bench", "quant", "--model", str(tiny_dirs["llama"]), "--levels", "int8"]
    argv += ["--prompts", "2", "--new-tokens", "4", "--ppl-tokens", "100", "--rounds", "1"]
    argv += ["--no-save", "--prompts-file", str(path)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(result["levels"]) == list(LEVELS)  # the existing keys stay
    assert "ppl" in result["levels"]["int8"] and "decode_tok_s_bs1" in result["levels"]["int8"]
    accuracy = result["accuracy"]
    assert accuracy["prompts_file"] == str(path) and accuracy["items"] == ITEMS
    assert accuracy["reference_level"] == "fp32" and list(accuracy["levels"]) == list(LEVELS)

    direct = _direct(tiny_llama, items)
    tol = 5e-4  # the report rounds to 4 decimals; the API and the direct forward agree to ~1e-5
    # The levels differ by more than that: serving the wrong level fails the check.
    fp32_ll, int8_ll = (direct[lv]["gold_loglikelihood_mean"] for lv in LEVELS)
    assert abs(fp32_ll - int8_ll) > 4 * tol
    for level, want in direct.items():
        got = accuracy["levels"][level]
        assert got["items"] == ITEMS
        assert got["acc"] == pytest.approx(want["acc"], abs=1e-4), level
        assert got["acc_norm"] == pytest.approx(want["acc_norm"], abs=1e-4), level
        assert got["gold_loglikelihood_mean"] == pytest.approx(
            want["gold_loglikelihood_mean"], abs=tol
        ), level
        same = sum(a == b for a, b in zip(want["chosen"], direct["fp32"]["chosen"], strict=True))
        assert got["agreement_pct"] == pytest.approx(100.0 * same / ITEMS, abs=0.01), level
