"""Model loading: HF directories, the embedded GGUF, and one-line errors for bad sources."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.integration.test_engine import hf_greedy
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import LoadError, load_model
from wattserve.daemon.engine.request import SamplingParams


def test_hf_directory_loads_with_chat_template(tiny_dirs, cache_dir):
    lm = load_model(str(tiny_dirs["qwen2"]), cache_dir)
    assert lm.hf_model.config.model_type == "qwen2"
    assert lm.hf_model.model.layers[0].self_attn.q_proj.bias is not None  # qwen2: qkv bias
    text = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert lm.load_time_s > 0 and not lm.converted_now


def test_bfloat16_is_selectable(tiny_dirs, cache_dir):
    import torch

    lm = load_model(str(tiny_dirs["llama"]), cache_dir, "bfloat16")
    assert lm.dtype == torch.bfloat16
    engine = Engine(lm, EngineOptions(kv_cache_bytes=1 << 20))
    out = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert out.completion_tokens == 5 and engine.model.k_cache[0].dtype == torch.bfloat16


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path(cache_dir, tmp_path):
    with pytest.raises(LoadError, match="no such file or directory"):
        load_model(str(tmp_path / "nope"), cache_dir)


def test_unsupported_architecture(tiny_dirs, cache_dir, tmp_path):
    d = copy_dir(tiny_dirs["llama"], tmp_path / "gpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="unsupported architecture 'gpt2'"):
        load_model(str(d), cache_dir)


def test_corrupt_weights(tiny_dirs, cache_dir, tmp_path):
    d = copy_dir(tiny_dirs["llama"], tmp_path / "corrupt")
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(LoadError) as err:
        load_model(str(d), cache_dir)
    assert str(d) in str(err.value) and "\n" not in str(err.value)


def test_missing_weights_and_bad_gguf(tiny_dirs, cache_dir, tmp_path):
    d = copy_dir(tiny_dirs["llama"], tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="no weight files"):
        load_model(str(d), cache_dir)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(LoadError, match="cannot read GGUF"):
        load_model(str(bad), cache_dir)


def test_cli_reports_one_line_and_nonzero_exit(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "wattserve.daemon.cli", "generate", "hi", "--model",
         str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("wattserve: error:") and "Traceback" not in proc.stderr


@pytest.mark.real_model
def test_embedded_model_converts_once_and_answers_sensibly(real_model, cache_dir):
    again = load_model("embedded", cache_dir)
    assert not again.converted_now  # second load comes from the safetensors cache
    assert real_model.hf_model.config.num_hidden_layers == 30
    engine = Engine(real_model, EngineOptions(kv_cache_bytes=256 << 20))
    tok = real_model.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    out = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


@pytest.mark.real_model
def test_embedded_model_greedy_matches_hf(real_model):
    tok = real_model.tokenizer
    texts = [
        "The quick brown fox",
        "Once upon a time, in a small village,",
        "def fibonacci(n):",
        "Water boils at a temperature of",
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    engine = Engine(real_model, EngineOptions(kv_cache_bytes=256 << 20))
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    assert [o.token_ids for o in outs] == hf_greedy(real_model.hf_model, prompts)
