"""The mixture-of-experts block alone against transformers' sparse MoE blocks, fp32 CPU."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_moe_model import tiny_moe_config, tiny_moe_hf
from wattserve.daemon.engine.moe import MoeSpec, build_moe_block, moe_spec
from wattserve.kernels.int_linear import int_linear_available
from wattserve.kernels.quant import Int8Linear, parse_level

CPU = torch.device("cpu")
# As tests/integration/test_quant_engine.py: int8 moves outputs by activation rounding
# only, against the same block run on its dequantized weights.
BF16_ROUNDING = 0.05
INT8_ACTIVATION_ROUNDING = 0.10


def hf_block(arch: str, **config):
    """Layer 0's sparse MoE block of a tiny random model, run by transformers' own loop."""
    model = tiny_moe_hf(arch, **config)
    model.config._experts_implementation = "eager"  # the plain per-expert reference
    return model.config, model.model.layers[0].mlp


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("tokens", [1, 17, 300])
def test_block_matches_the_transformers_sparse_block(arch, tokens):
    cfg, block = hf_block(arch)
    ours = build_moe_block(moe_spec(cfg, 0), block, None, torch.float32, CPU)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        ref = block(x.unsqueeze(0))[0]
        close(ours(x), ref)


def test_norm_topk_prob_is_read_from_the_config():
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    outs = {}
    for norm in (False, True):
        cfg, block = hf_block("qwen3_moe", norm_topk_prob=norm)
        ours = build_moe_block(moe_spec(cfg, 0), block, None, torch.float32, CPU)
        assert ours.spec.renormalize is norm
        with torch.inference_mode():
            close(ours(x), block(x.unsqueeze(0))[0])
            outs[norm] = ours(x)
    # With 4 of 64 experts the kept probability mass is well below one: the flag matters.
    assert not torch.allclose(outs[False], outs[True], rtol=1e-2, atol=0)


def test_mixtral_always_renormalises():
    cfg = tiny_moe_config("mixtral")
    assert moe_spec(cfg, 0) == MoeSpec(8, 2, 224, True)


def test_dense_layers_of_qwen3_moe_get_no_spec():
    cfg = tiny_moe_config("qwen3_moe", layers=4)
    cfg.mlp_only_layers = [0]
    cfg.decoder_sparse_step = 2  # sparse where (i + 1) % 2 == 0, so layers 1 and 3
    assert [moe_spec(cfg, i) is not None for i in range(4)] == [False, True, False, True]
    assert moe_spec(tiny_moe_config("qwen3_moe"), 0) == MoeSpec(64, 4, 24, True)


def test_experts_run_once_each_over_their_routed_rows():
    # Grouped execution: one gate_up call per expert that got tokens, over exactly the
    # rows routed to it; experts that got none are not called. 300 tokens x 4 of 64.
    cfg, block = hf_block("qwen3_moe")
    ours = build_moe_block(moe_spec(cfg, 0), block, None, torch.float32, CPU)
    calls: list[tuple[int, int]] = []

    def counting(expert, linear):
        def call(x):
            calls.append((expert, x.shape[0]))
            return linear(x)

        return call

    ours.gate_up = [counting(e, lin) for e, lin in enumerate(ours.gate_up)]
    x = torch.randn(300, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        _, experts = ours.route(x)
        ours(x)
    routed = torch.bincount(experts.reshape(-1), minlength=64).tolist()
    assert calls == [(e, n) for e, n in enumerate(routed) if n > 0]
    assert sum(n for _, n in calls) == 300 * 4


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_int8_experts_stay_within_the_quantization_bound(arch):
    cfg, block = hf_block(arch)
    spec = moe_spec(cfg, 0)
    int8 = build_moe_block(spec, block, parse_level("int8"), torch.float32, CPU)
    assert all(isinstance(lin, Int8Linear) for lin in (*int8.gate_up, *int8.down))
    assert int8.nbytes < build_moe_block(spec, block, None, torch.float32, CPU).nbytes / 3
    # Reference: transformers' block holding the int8 experts' dequantized weights.
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(torch.stack([lin.dequantize() for lin in int8.gate_up]))
        block.experts.down_proj.copy_(torch.stack([lin.dequantize() for lin in int8.down]))
    x = torch.randn(17, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = block(x.unsqueeze(0))[0]
        err = ((int8(x) - ref).abs().max() / ref.abs().max()).item()
    bound = INT8_ACTIVATION_ROUNDING if int_linear_available() else BF16_ROUNDING
    assert err < bound
