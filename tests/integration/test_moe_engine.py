"""Mixture-of-experts families end to end on tiny random-weight models, against transformers:
logits through chunked prefill, greedy tokens through the engine, the int8 level."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_engine import hf_greedy, recording
from tests.integration.test_quant_engine import (
    BF16_ROUNDING,
    INT8_ACTIVATION_ROUNDING,
    relative_error,
)
from tests.tiny_moe_model import make_tiny_moe_dir
from wattserve.bench.quant import sequence_logits
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.loader import load_model
from wattserve.daemon.engine.moe import MoeBlock
from wattserve.daemon.engine.request import SamplingParams
from wattserve.daemon.engine.scheduler import ScheduledChunk, Sequence
from wattserve.kernels.int_linear import int_linear_available

DEVICE = torch.device("cpu")
MOE_ARCHS = ["mixtral", "qwen3_moe"]
PROMPT_LENGTHS = (1, 17, 300)
CHUNK_TOKENS = 16
NEW_TOKENS = 48


def block_bytes(loaded, block_size: int = 16) -> int:
    """fp32 K+V bytes of one block (Qwen3-MoE's head_dim is its own, not hidden / heads)."""
    cfg = loaded.hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * 4


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("tiny_moe")
    return {
        arch: load_model(str(make_tiny_moe_dir(root / arch, arch)), cache_dir) for arch in MOE_ARCHS
    }


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def chunked_prefill_logits(model, ids: list[int], chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """float32 logits of every position of `ids`, run `chunk` tokens a step over the KV
    cache (each step attends to what the earlier ones wrote)."""
    seq = Sequence("chunked", list(ids))
    table = list(range(-(-len(ids) // model.block_size)))
    rows = []
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        inputs = model.prepare([ScheduledChunk(seq, start, n, True)], {"chunked": table})
        inputs.logits_indices = torch.arange(n)
        rows.append(model.forward(inputs))
    return torch.cat(rows)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_transformers_through_chunked_prefill(arch, moe_models):
    lm = moe_models[arch]
    engine = Engine(lm, EngineOptions(kv_cache_bytes=32 * block_bytes(lm)), device=DEVICE)
    assert any(isinstance(lw.mlp, MoeBlock) for lw in engine.model.layers)
    for ids in prompts(len(lm.tokenizer)):
        ours = chunked_prefill_logits(engine.model, ids)
        with torch.inference_mode():
            ref = lm.hf_model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_tokens_match_generate_through_chunks_and_preemption(arch, moe_models):
    lm = moe_models[arch]
    ps = prompts(len(lm.tokenizer)) + prompts(len(lm.tokenizer))[1:]
    expected = hf_greedy(lm.hf_model, ps, NEW_TOKENS)
    # 26 blocks of 16 = 416 tokens for 348 + 2 x 65 of them, 16 tokens a step.
    engine = Engine(
        lm,
        EngineOptions(
            kv_cache_bytes=26 * block_bytes(lm), max_num_seqs=4, max_num_batched_tokens=16
        ),
        device=DEVICE,
    )
    plans = recording(engine)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outs = engine.generate(ps, greedy)
    assert [o.token_ids for o in outs] == expected
    assert any(len(e) == NEW_TOKENS for e in expected)  # not all cut short by EOS
    assert engine.counters.preemptions > 0
    assert any(c.num_tokens > 1 and not c.samples for p in plans for c in p.chunks)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_int8_level_matches_the_model_with_its_dequantized_experts(arch, moe_models):
    import copy

    lm = moe_models[arch]
    engine = Engine(
        lm,
        EngineOptions(kv_cache_bytes=32 * block_bytes(lm), quantization_levels=("fp32", "int8")),
        device=DEVICE,
    )
    model = engine.model
    predicted = model.level_bytes("int8")
    weights = model.prepare_level("int8")
    assert weights.linear_bytes == predicted
    model.use_level("int8")
    ids = prompts(len(lm.tokenizer))[1] * 4  # 68 tokens
    ours_routes: list[torch.Tensor] = []
    for lw in model.layers:
        if isinstance(lw.mlp, MoeBlock):
            lw.mlp.route = recording_route(lw.mlp.route, ours_routes)
    ours = sequence_logits(model, ids)
    ref_model = copy.deepcopy(lm.hf_model)
    own_routes: list[torch.Tensor] = []  # what the dequantized model would pick itself
    with torch.no_grad():
        forced_routes = iter(ours_routes)
        for layer, lw in zip(ref_model.model.layers, weights.layers, strict=True):
            att = layer.self_attn
            q_rows, k_rows = att.q_proj.weight.shape[0], att.k_proj.weight.shape[0]
            qkv = lw.qkv.dequantize()
            att.q_proj.weight.copy_(qkv[:q_rows])
            att.k_proj.weight.copy_(qkv[q_rows : q_rows + k_rows])
            att.v_proj.weight.copy_(qkv[q_rows + k_rows :])
            att.o_proj.weight.copy_(lw.o.dequantize())
            mlp = layer.mlp
            if not isinstance(lw.mlp, MoeBlock):  # a dense layer of qwen3_moe
                inter = mlp.gate_proj.weight.shape[0]
                gate_up = lw.mlp.gate_up.dequantize()
                mlp.gate_proj.weight.copy_(gate_up[:inter])
                mlp.up_proj.weight.copy_(gate_up[inter:])
                mlp.down_proj.weight.copy_(lw.mlp.down.dequantize())
                continue
            mlp.experts.gate_up_proj.copy_(torch.stack([e.dequantize() for e in lw.mlp.gate_up]))
            mlp.experts.down_proj.copy_(torch.stack([e.dequantize() for e in lw.mlp.down]))
            mlp.gate.forward = routed_as(
                mlp.gate.forward, next(forced_routes), lw.mlp.spec.renormalize, own_routes
            )
        ref_model.get_output_embeddings().weight.copy_(weights.lm_head.dequantize())
        ref = ref_model(torch.tensor([ids])).logits[0]
        fp32 = lm.hf_model(torch.tensor([ids])).logits[0]
    # The reference takes our expert choices: int8's activation rounding moves ~6 % of
    # (token, layer) choices to another expert here, a discrete change that the bound on
    # rounding is not about (a 3-layer run showed 0.14-0.77 on those tokens).
    agree = [
        (a.sort(-1).values == b.sort(-1).values).all(-1)
        for a, b in zip(ours_routes, own_routes, strict=True)
    ]
    assert torch.cat(agree).float().mean() > 0.8
    bound = INT8_ACTIVATION_ROUNDING if int_linear_available() else BF16_ROUNDING
    assert relative_error(ours, ref) < bound
    assert relative_error(ours, fp32) > 1e-3  # the level did change the weights


def recording_route(route, into: list[torch.Tensor]):
    """`route` that also appends each call's expert ids to `into`."""

    def wrapped(x: torch.Tensor):
        weights, experts = route(x)
        into.append(experts)
        return weights, experts

    return wrapped


def routed_as(router_forward, experts: torch.Tensor, renormalize: bool, own: list[torch.Tensor]):
    """A transformers router forward that picks `experts` [T, k] (weighting them by its own
    probabilities) and appends the ids it would have picked to `own`."""

    def forward(hidden: torch.Tensor):
        logits, _, picked = router_forward(hidden)
        own.append(picked)
        weights = torch.softmax(logits.float(), dim=-1).gather(1, experts)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts

    return forward


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_step_counts_the_weights_of_the_experts_it_ran(arch, moe_models):
    # The virtual GPU prices a step by the bytes it reads: a decode at batch 1 reads top-k
    # experts of each MoE layer, not all of them.
    lm = moe_models[arch]
    engine = Engine(lm, EngineOptions(kv_cache_bytes=8 * block_bytes(lm)), device=DEVICE)
    steps = []
    engine.add_step_hook(steps.append)
    engine.generate([prompts(len(lm.tokenizer))[1]], SamplingParams(max_tokens=3, temperature=0))
    blocks = [lw.mlp for lw in engine.model._active.layers if isinstance(lw.mlp, MoeBlock)]
    assert blocks
    every_expert = engine.model.weight_bytes()
    spec = blocks[0].spec
    decode = steps[-1]  # one token through every layer: at most top_k experts each
    fewest = every_expert - len(blocks) * (spec.num_experts - 1) * blocks[0].expert_nbytes
    most = every_expert - len(blocks) * (spec.num_experts - spec.top_k) * blocks[0].expert_nbytes
    assert fewest <= decode.weight_bytes <= most < every_expert
