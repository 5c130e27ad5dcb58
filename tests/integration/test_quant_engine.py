"""Quantization levels in the engine on tiny random models: whole-model references,
switching mid-generation under load, the KV cache kept across a switch, allowed levels."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch

from tests.integration.test_engine import engine_with_blocks, prompts_for
from wattserve.bench.quant import sequence_logits
from wattserve.daemon.engine.engine import Engine
from wattserve.daemon.engine.loader import load_model
from wattserve.daemon.engine.request import RequestOutput, SamplingParams
from wattserve.kernels.int_linear import int_linear_available
from wattserve.kernels.quant import QuantLevelError

QUANT_LEVELS = ("int8", "int4", "int4-g128")
ALL_LEVELS = ("fp32", "bf16") + QUANT_LEVELS
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
BF16_ROUNDING = 0.05  # max |logit error| / max |logit| from bf16 activations, tiny models
# On CPUs with the integer kernel the int8/int4 levels round activations to int8 per 32
# in-features instead (half a step of amax / 127 each): on these random 2-layer models
# that moved logits 3.1-6.8 % of their range against the dequantized-weight model (bf16
# activations: 1.4-2.3 %). The kernel's own arithmetic is checked exactly in
# tests/unit/test_int_linear.py.
INT8_ACTIVATION_ROUNDING = 0.10


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_dirs, cache_dir):
    return load_model(str(tiny_dirs["qwen2"]), cache_dir)


def make_engine(loaded, blocks: int = 64, **options) -> Engine:
    options.setdefault("quantization_levels", ALL_LEVELS)
    return engine_with_blocks(loaded, blocks, **options)


def dequantized_hf(hf_model, weights):
    """A copy of the transformers model whose linears hold one level's dequantized weights."""
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for layer, lw in zip(model.model.layers, weights.layers, strict=True):
            att, mlp = layer.self_attn, layer.mlp
            q_rows, k_rows = att.q_proj.weight.shape[0], att.k_proj.weight.shape[0]
            qkv = lw.qkv.dequantize()
            att.q_proj.weight.copy_(qkv[:q_rows])
            att.k_proj.weight.copy_(qkv[q_rows : q_rows + k_rows])
            att.v_proj.weight.copy_(qkv[q_rows + k_rows :])
            att.o_proj.weight.copy_(lw.o.dequantize())
            inter = mlp.gate_proj.weight.shape[0]
            gate_up = lw.mlp.gate_up.dequantize()
            mlp.gate_proj.weight.copy_(gate_up[:inter])
            mlp.up_proj.weight.copy_(gate_up[inter:])
            mlp.down_proj.weight.copy_(lw.mlp.down.dequantize())
        model.get_output_embeddings().weight.copy_(weights.lm_head.dequantize())
    return model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_level_matches_the_model_with_its_dequantized_weights(arch, tiny_llama, tiny_qwen2):
    # Whole-model reference: the same transformers model, weights replaced by the level's
    # dequantized ones, run in fp32. Our levels differ by bf16 activation rounding only,
    # which on these random 2-layer models moves logits by up to ~3% of their range
    # (the bf16 level against fp32 shows the same); int8 itself moves them ~5%, int4 ~60%.
    loaded = {"llama": tiny_llama, "qwen2": tiny_qwen2}[arch]
    engine = make_engine(loaded)
    ids = prompts_for(len(loaded.tokenizer), n=6, seed=1)[3]  # 60 tokens
    with torch.inference_mode():
        fp32 = loaded.hf_model(torch.tensor([ids])).logits[0]
    for level in QUANT_LEVELS:
        weights = engine.model.prepare_level(level)
        engine.model.use_level(level)
        ours = sequence_logits(engine.model, ids)
        with torch.inference_mode():
            ref = dequantized_hf(loaded.hf_model, weights)(torch.tensor([ids])).logits[0]
        bound = INT8_ACTIVATION_ROUNDING if int_linear_available() else BF16_ROUNDING
        assert relative_error(ours, ref) < bound, level
        assert relative_error(ours, fp32) > 1e-3, level  # the level did change the weights
    engine.model.use_level("bf16")
    assert relative_error(sequence_logits(engine.model, ids), fp32) < BF16_ROUNDING


def test_switch_mid_generation_under_load_loses_nothing(tiny_llama):
    prompts = prompts_for(len(tiny_llama.tokenizer), n=24, seed=2)
    expected = [o.token_ids for o in make_engine(tiny_llama).generate(prompts, GREEDY)]
    # 24 blocks of 16 tokens for 24 sequences of up to 76: preemption joins in.
    engine = make_engine(tiny_llama, blocks=24, max_num_seqs=12, max_num_batched_tokens=64)
    cycle = ["int8", "int4", "bf16", "int4-g128", "fp32"]
    switch_every = 3
    levels_seen: list[str] = []

    def turn_knob(stats):
        levels_seen.append(stats.quant_level)
        if stats.step % switch_every == switch_every - 1:
            engine.set_quant_level(cycle[(stats.step // switch_every) % len(cycle)])

    engine.add_step_hook(turn_knob)
    tokens: dict[str, list[tuple[str, int]]] = {}
    finished: list[RequestOutput] = []
    done = threading.Event()
    lock = threading.Lock()

    def sink(out: RequestOutput) -> None:
        with lock:
            level = engine.quant_level  # the loop thread runs the sink: the step's level
            tokens.setdefault(out.request_id, []).extend((level, t) for t in out.token_ids)
            if out.finished:
                finished.append(out)
                if len(finished) == len(prompts):
                    done.set()

    engine.start()
    try:
        order = [engine.add_request(p, GREEDY, sink) for p in prompts]
        assert done.wait(120), "requests did not finish"
    finally:
        engine.stop()
    assert all(o.finish_reason == "length" and o.error is None for o in finished)
    assert all(len(tokens[rid]) == GREEDY.max_tokens for rid in order)
    assert engine.counters.preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    # Every level ran, each for whole steps, switching only at the planned step boundaries.
    assert set(levels_seen) == set(cycle)
    for step, level in enumerate(levels_seen):
        k = step // switch_every
        assert level == ("fp32" if k == 0 else cycle[(k - 1) % len(cycle)]), step
    # Tokens produced before the first switch are those of the unswitched run.
    before = 0
    for rid, exp in zip(order, expected, strict=True):
        prefix = [t for lvl, t in tokens[rid][: len(exp)] if lvl == "fp32"]
        first_switch = next((i for i, (lvl, _) in enumerate(tokens[rid]) if lvl != "fp32"), None)
        if first_switch is not None:
            prefix = prefix[:first_switch]
        assert prefix == exp[: len(prefix)]
        before += len(prefix)
    assert before > 0


def test_switch_continues_from_the_kv_cache_written_before_it(tiny_llama):
    # Reference: transformers runs prompt + the tokens before the switch at fp32, then
    # continues from that very cache with the int8 weights (teacher-forced on our tokens).
    engine = make_engine(tiny_llama)
    prompt = prompts_for(len(tiny_llama.tokenizer), n=6, seed=3)[3]
    logits: list[torch.Tensor] = []
    real_forward = engine.model.forward

    def recording(inputs):
        out = real_forward(inputs)
        logits.append(out[0].clone())
        return out

    engine.model.forward = recording
    switch_after = 5  # steps at fp32: the prefill and 4 decodes

    def hook(stats):
        if stats.step == switch_after - 1:
            engine.set_quant_level("int8")

    engine.add_step_hook(hook)
    out = engine.generate([prompt], GREEDY)[0]
    gen = out.token_ids
    hf = tiny_llama.hf_model
    int8_hf = dequantized_hf(hf, engine.model.prepare_level("int8"))
    with torch.inference_mode():
        head = torch.tensor([prompt + gen[: switch_after - 1]])
        cached = hf(head, use_cache=True)
        tail = torch.tensor([gen[switch_after - 1 : -1]])
        ref = int8_hf(tail, cache=cached.cache, use_cache=True).logits[0]
        fp32 = hf(torch.tensor([prompt + gen[:-1]])).logits[0, len(prompt) - 1 :]
    ours = torch.stack(logits[switch_after:])
    assert len(ours) == len(ref) == GREEDY.max_tokens - switch_after
    assert relative_error(ours, ref) < BF16_ROUNDING
    # A cache lost at the switch would leave the continuation attending to nothing.
    with torch.inference_mode():
        no_cache = int8_hf(tail).logits[0]
    assert relative_error(no_cache, ref) > 4 * BF16_ROUNDING
    assert relative_error(torch.stack(logits[:switch_after]), fp32[:switch_after]) < 1e-4


def test_disallowed_unknown_and_unavailable_levels_are_rejected(tiny_llama):
    engine = make_engine(tiny_llama, quantization_levels=("fp32", "int8", "fp8"))
    assert engine.set_quant_level("int8") == "int8"
    with pytest.raises(QuantLevelError, match="'int4' is not allowed.*quantization_levels"):
        engine.set_quant_level("int4")
    with pytest.raises(QuantLevelError, match="unknown quantization level 'int3'"):
        engine.set_quant_level("int3")
    with pytest.raises(QuantLevelError, match="'fp8' is not allowed: fp8: needs a CUDA GPU"):
        engine.set_quant_level("fp8")
    status = engine.quant_status()
    assert list(status["levels"]) == ["fp32", "int8"] and "fp8" in status["unavailable"]
    assert status["requested"] == "int8" and status["level"] == "fp32"  # lands at next step
    engine.generate([[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.quant_status()["level"] == "int8"
    with pytest.raises(QuantLevelError, match="'int4' is not allowed"):
        make_engine(tiny_llama, quantization_levels=("fp32", "int8"), quantization_level="int4")
    with pytest.raises(QuantLevelError, match="'fp32' is not allowed"):
        make_engine(tiny_llama, quantization_levels=("int8",))


def test_start_level_prepare_modes_and_reported_memory(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="wattserve.daemon.engine.engine"):
        lazy = make_engine(tiny_llama, quantization_level="int4")
    assert "int8" in caplog.text and "not built yet" in caplog.text
    status = lazy.quant_status()
    assert status["level"] == "int4"
    assert {lvl for lvl, row in status["levels"].items() if row["prepared"]} == {"fp32", "int4"}
    estimates = {lvl: row["weight_bytes"] for lvl, row in status["levels"].items()}
    eager = make_engine(tiny_llama, quant_prepare="start")
    built = eager.quant_status()["levels"]
    assert all(row["prepared"] for row in built.values())
    assert {lvl: row["weight_bytes"] for lvl, row in built.items()} == estimates
    assert estimates["int4"] < estimates["int8"] < estimates["bf16"] < estimates["fp32"]
    steps = []
    eager.add_step_hook(steps.append)
    eager.generate([[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0.0))
    eager.set_quant_level("int4")
    eager.generate([[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0.0))
    assert steps[0].quant_level == "fp32" and steps[-1].quant_level == "int4"
    assert steps[-1].weight_bytes < steps[0].weight_bytes / 2


def test_switching_from_another_thread_while_levels_are_built_lazily(tiny_llama):
    # The control loop calls set_quant_level from a worker thread; a level not yet
    # built is built there while the loop keeps stepping at the current level.
    prompts = prompts_for(len(tiny_llama.tokenizer), n=8, seed=4)
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    levels_seen: list[str] = []
    first_switch = threading.Event()

    def hook(stats) -> None:
        levels_seen.append(stats.quant_level)
        # The first step waits for the first switch to be built and handed over, so the
        # requests cannot all finish before it lands (on a loaded machine they did); the
        # later levels are built while the loop keeps stepping.
        if len(levels_seen) == 1:
            assert first_switch.wait(60), "the first switch never returned"

    engine.add_step_hook(hook)
    finished: list[RequestOutput] = []
    done = threading.Event()

    def sink(out: RequestOutput) -> None:
        if out.finished:
            finished.append(out)
            if len(finished) == len(prompts):
                done.set()

    def switcher() -> None:
        for level in ["int4", "int8", "bf16", "int4-g128", "int8", "fp32"]:
            if done.wait(0.01):
                return
            engine.set_quant_level(level)
            first_switch.set()

    engine.start()
    try:
        for p in prompts:
            engine.add_request(p, params, sink)
        thread = threading.Thread(target=switcher)
        thread.start()
        assert done.wait(120), "requests did not finish"
        thread.join()
    finally:
        engine.stop()
    assert all(o.finish_reason == "length" and o.completion_tokens == 48 for o in finished)
    assert len(set(levels_seen)) > 1 and set(levels_seen) <= set(ALL_LEVELS)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
