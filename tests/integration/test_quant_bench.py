"""`wattserve bench quant` on a tiny random model: its perplexity against transformers,
and the whole command end to end (last line JSON, table saved where the controller reads)."""

from __future__ import annotations

import json
import math

import torch

from tests.integration.test_engine import block_bytes
from wattserve.bench.quant import perplexity
from wattserve.daemon.cli import main
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.quant_table import load_quality_table, quality_table_path


def test_perplexity_matches_transformers_loss(tiny_llama):
    engine = Engine(tiny_llama, EngineOptions(kv_cache_bytes=64 * block_bytes(tiny_llama)))
    ids = [(7 * i) % 400 + 3 for i in range(300)]
    window = 128
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window]])
            loss = tiny_llama.hf_model(chunk, labels=chunk).loss.item()
            nll += loss * (chunk.shape[1] - 1)
            count += chunk.shape[1] - 1
    ours = perplexity(engine.model, ids, window)
    assert math.isclose(ours, math.exp(nll / count), rel_tol=1e-4)


def test_bench_quant_command_prints_json_and_saves_the_table(
    tiny_dirs, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WATTSERVE_CACHE", str(tmp_path))
    argv = ["bench", "quant", "--model", str(tiny_dirs["llama"]), "--levels", "int8,int4"]
    argv += ["--prompts", "4", "--new-tokens", "6", "--ppl-tokens", "300", "--rounds", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert "LICENSE" in result["text_file"] or "NEWS" in result["text_file"]
    assert result["text_file"] in out[0]  # the text used is named up front too
    assert list(result["levels"]) == ["fp32", "int8", "int4"]
    for row in result["levels"].values():
        for key in ("ppl", "ppl_increase_pct", "greedy_agreement_pct", "decode_tok_s_bs1"):
            assert math.isfinite(row[key]), key
        assert row["decode_tok_s_bs16"] > 0 and row["weight_mb"] > 0
    fp32, int4 = result["levels"]["fp32"], result["levels"]["int4"]
    assert fp32["ppl_increase_pct"] == 0 and fp32["greedy_agreement_pct"] == 100
    assert int4["weight_mb"] < result["levels"]["int8"]["weight_mb"] < fp32["weight_mb"]
    assert result["dtype"] == "float32" and result["threads"] >= 1
    saved = load_quality_table(quality_table_path(tmp_path, tiny_dirs["llama"].name))
    assert saved is not None and saved["levels"] == result["levels"]
