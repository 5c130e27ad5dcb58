"""Checkpoints of the new families in the shapes people download them: Gemma 3 with its
vision tower, and GGUF files. Each is held to transformers' own model of the same weights
at fp32 with the family test's tolerance (tests/integration/test_families.py)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.integration.test_families import assert_logits_close, block_bytes, recording_logits
from tests.tiny_gguf import write_gguf
from tests.tiny_model import make_family_dir, make_gemma3_vision_dir
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import LoadError, load_model
from wattserve.daemon.engine.request import SamplingParams

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def random_prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def engine_matches(lm, reference, prompts: list[list[int]]) -> None:
    """The engine's greedy run of each prompt: every step's logits close to the
    reference model's forward over the same tokens, and its tokens the reference's argmax."""
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    opts = EngineOptions(
        kv_cache_bytes=(-(-longest // 16) + 2) * block_bytes(lm), max_num_batched_tokens=64
    )
    engine = Engine(lm, opts, device="cpu")
    seen = recording_logits(engine)
    for prompt, out in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        rows = slice(len(prompt) - 1, len(prompt) - 1 + NEW_TOKENS)
        with torch.inference_mode():
            ref = reference(torch.tensor([prompt + out.token_ids])).logits[0, rows].float()
        assert_logits_close(torch.stack(seen[tuple(prompt)]), ref)
        assert out.token_ids == ref.argmax(-1).tolist()


def test_gemma3_with_vision_tower_serves_its_text_part(tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM

    path = make_gemma3_vision_dir(tmp_path / "gemma3-vision")
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(full).__name__ == "Gemma3ForConditionalGeneration"
    lm = load_model(str(path), cache_dir, "float32")
    # Only the language model is in memory: its weights, under the text model's names,
    # equal to the checkpoint's; nothing of the vision tower or the projector.
    assert type(lm.hf_model).__name__ == "Gemma3ForCausalLM"
    ours = lm.hf_model.model.state_dict()
    text = full.model.language_model.state_dict()
    assert ours.keys() == text.keys()
    assert all(torch.equal(ours[k], text[k]) for k in text)
    assert not any("vision" in n or "multi_modal" in n for n, _ in lm.hf_model.named_parameters())
    loaded = sum(p.numel() for p in lm.hf_model.parameters())
    assert loaded == sum(p.numel() for p in full.model.language_model.parameters())
    assert loaded < sum(p.numel() for p in full.parameters())
    # 300 tokens cross the 32-token window of the sliding layers.
    engine_matches(lm, full, random_prompts(len(lm.tokenizer), (1, 17, 300)))


def test_checkpoint_missing_text_weights_is_refused(tmp_path, cache_dir):
    from safetensors.torch import load_file, save_file

    path = make_gemma3_vision_dir(tmp_path / "gemma3-vision")
    weights = load_file(path / "model.safetensors")
    dropped = next(k for k in weights if k.endswith("layers.1.mlp.down_proj.weight"))
    del weights[dropped]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError, match="weights missing from the checkpoint") as err:
        load_model(str(path), cache_dir, "float32")
    assert "layers.1.mlp.down_proj.weight" in str(err.value) and "\n" not in str(err.value)


def family_gguf(tmp_path, family: str):
    """A random model of the family (tests/tiny_model.py) as the loader reads its HF
    directory, and the same weights written as GGUF."""
    path = make_family_dir(tmp_path / family, family)
    lm = load_model(str(path), tmp_path / "cache", "float32")
    return lm.hf_model, write_gguf(lm.hf_model, lm.tokenizer, tmp_path / f"{family}.gguf")


# qwen3: the head dim (2 x hidden / heads) comes from attention.key_length; gemma2: the
# attention scale and soft-caps from the GGUF's keys, the (1 + w) norms stored as llama.cpp does.
@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_gguf_of_a_family_matches_its_hf_directory(family, tmp_path):
    hf, gguf = family_gguf(tmp_path, family)
    lm = load_model(str(gguf), tmp_path / "cache", "float32")
    assert lm.converted_now and lm.hf_model.config.model_type == family
    ours = lm.hf_model.state_dict()
    for name, want in hf.state_dict().items():
        # exact but for gemma's norms, stored as 1 + w and read back as (1 + w) - 1
        torch.testing.assert_close(ours[name], want, rtol=0, atol=1e-7, msg=name)
    # 300 tokens cross gemma2's 32-token window.
    engine_matches(lm, hf, random_prompts(hf.config.vocab_size, (1, 17, 300)))


@pytest.mark.parametrize("family", ["phi3", "gemma3"])
def test_gguf_of_a_family_it_would_misread_is_refused_by_name(family, tmp_path):
    # phi3: transformers' GGUF reader drops the partial rotary and longrope factors;
    # gemma3: GGUF does not store the local/global layer pattern nor its rope scaling.
    _, gguf = family_gguf(tmp_path, family)
    with pytest.raises(LoadError) as err:
        load_model(str(gguf), tmp_path / "cache", "float32")
    line = str(err.value)
    assert f"GGUF architecture '{family}' is not supported" in line and "\n" not in line
