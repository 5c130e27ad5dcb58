"""The GGUF metadata rules of wattserve/daemon/engine/gguf_config.py, without a file."""

from __future__ import annotations

import pytest

from wattserve.daemon.engine.gguf_config import GGUFConfigError, check_gguf, complete_config


def test_mixtral_under_the_llama_architecture_is_refused_by_name():
    with pytest.raises(GGUFConfigError, match="'llama' with experts"):
        check_gguf({"general.architecture": "llama", "llama.expert_count": 8}, [])
    assert check_gguf({"general.architecture": "llama"}, []) == "llama"


def test_an_architecture_not_taken_from_gguf_is_named():
    with pytest.raises(GGUFConfigError, match="GGUF architecture 'phi3' is not supported"):
        check_gguf({"general.architecture": "phi3"}, [])


@pytest.mark.parametrize(("layers", "scalar"), [(26, 256), (46, 144)])
def test_gemma2_attention_scale_follows_llama_cpp(layers, scalar):
    """gemma-2-2b/9b: head_dim; gemma-2-27b (46 layers): hidden / heads = 4608 / 32."""
    from transformers import Gemma2Config

    cfg = Gemma2Config(
        hidden_size=4608, num_attention_heads=32, num_hidden_layers=layers, head_dim=128
    )
    meta = {
        "general.architecture": "gemma2",
        "gemma2.attention.key_length": 256 if layers == 26 else 128,
        "gemma2.attn_logit_softcapping": 40.0,
    }
    complete_config(cfg, meta)
    assert cfg.query_pre_attn_scalar == scalar
    assert cfg.attn_logit_softcapping == 40.0 and cfg.final_logit_softcapping == 30.0
