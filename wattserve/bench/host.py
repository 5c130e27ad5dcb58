"""`wattserve bench host`: what one engine step asks of a CUDA device, counted without one.

A Llama-3.2-1B-shaped model (its layer shapes, SmolLM2's vocabulary) is built under torch's
FakeTensorMode on a fake `cuda:0`; decode steps at batch 1, 64 and 256 and mixed steps (64
decodes and 1 to 4 prompt chunks) run through the model's forward and the sampler while a
dispatch mode counts, per step, the kernels the device would run (every op that touches a
device tensor, views and allocations excluded; a custom op counts once), device-to-host
copies and scalar reads. Per-layer counts are the difference between a 2-layer and
a 1-layer model, so embedding, final norm, LM head and sampler are counted apart. Prints one
JSON line last with the issue's keys and their budgets.

syncs_before_next_launch, d2h_copies_per_step and pageable_h2d_copies_per_step come from
a real Engine with asynchronous steps run on the same fake device (record_engine): its
device operations go through a RecordingOps (wattserve.daemon.engine.device_ops), whose
record, with the blocking reads and pageable uploads its watch mode sees, gives them.

Host time per step (host_ms_per_step_bs1/64/256) is the engine loop's CPU time with the
forward stubbed, measured by wattserve.bench.host_time (host_ms_note says how); the
figures depend on the CPU and its load, so they are reported, never asserted.

It measures; it decides nothing and touches no real device.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

CUDA0 = torch.device("cuda", 0)
BLOCK_SIZE_TOKENS = 16
CONTEXT_TOKENS = 512  # each decoding sequence's length so far
PROMPT_CHUNK_TOKENS = 128
# Llama-3.2-1B's layer shapes with SmolLM2's vocabulary (as bench gpu's shaped model).
SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=4096,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
BUDGETS = {
    "kernels_per_layer_decode": 12,
    "kernels_per_layer_mixed": 14,
    "kernel_growth_with_batch": 0,
    "syncs_before_next_launch": 0,
    "d2h_copies_per_step": 1,
    "pageable_h2d_copies_per_step": 0,
    "kernels_outside_layers": 12,
}
# The budgets are for bf16; a layer at these levels may launch more.
LEVEL_LAYER_BUDGETS = {"int8": 16, "fp8": 16}


def budgets(level: str | None) -> dict[str, int]:
    """BUDGETS, with the per-layer ones of quantization `level` (None: as loaded)."""
    layer = LEVEL_LAYER_BUDGETS.get(level or "")
    if layer is None:
        return dict(BUDGETS)
    return BUDGETS | {"kernels_per_layer_decode": layer, "kernels_per_layer_mixed": layer}


# Process CPU ms per engine step with the forward stubbed (issue 48).
HOST_BUDGETS_MS = {
    "host_ms_per_step_bs1": 0.3,
    "host_ms_per_step_bs64": 1.0,
    "host_ms_per_step_bs256": 3.0,
}
# Ops that allocate or alias without a kernel of their own.
_NO_KERNEL = {
    "aten.empty.memory_format",
    "aten.empty_strided.default",
    "aten.empty_like.default",
    "aten.lift_fresh.default",
    "aten.detach.default",
    "aten.alias.default",
    "prim.device.default",
}
_SCALAR = torch.ops.aten._local_scalar_dense.default
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


def _tensors(tree) -> list[torch.Tensor]:
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


class KernelCount(TorchDispatchMode):
    """Counts device kernels, device-to-host copies and scalar reads of device tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: dict[str, int] = {}
        self.d2h_copies = 0
        self.scalar_reads = 0

    @property
    def total(self) -> int:
        return sum(self.kernels.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if func is _SCALAR:
            if inputs and inputs[0].device.type != "cpu":
                self.scalar_reads += 1
            return 0
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        on_device = any(t.device.type == "cuda" for t in inputs + outputs)
        # Under inference mode a cast arrives as aten.to (schema-marked a view: it may
        # return its input); it is a copy, with a kernel, when it returns a new tensor.
        copied = func in _COPIES or (
            func.overloadpacket is torch.ops.aten.to
            and not any(o is i for o in outputs for i in inputs)
        )
        viewed = getattr(func, "is_view", False) and not copied
        if (
            copied
            and any(t.device.type == "cuda" for t in inputs)
            and outputs
            and all(t.device.type == "cpu" for t in outputs)
        ):
            self.d2h_copies += 1
        elif on_device and not viewed and str(func) not in _NO_KERNEL:
            name = str(func)
            self.kernels[name] = self.kernels.get(name, 0) + 1
        return out


def build_model(num_layers: int, dtype: torch.dtype, level: str | None = None):
    """The shaped model on the fake cuda:0, with a KV pool for 256 sequences' contexts,
    its matmul weights at quantization `level` (None: as loaded), as the engine switches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from wattserve.daemon.engine.model import LlamaModel

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    blocks = 256 * (CONTEXT_TOKENS // BLOCK_SIZE_TOKENS + 1) + 4 * 16
    with fake:
        hf = LlamaForCausalLM(LlamaConfig(num_hidden_layers=num_layers, **SHAPE))
        model = LlamaModel(hf, blocks, BLOCK_SIZE_TOKENS, dtype, CUDA0)
        if level is not None:
            model.use_level(level)
    return fake, model


def step_chunks(decodes: int, prompt_chunks: int):
    """`decodes` sequences decoding at CONTEXT_TOKENS and `prompt_chunks` prompts each
    prefilling a chunk after as many cached tokens, with their block tables."""
    from wattserve.daemon.engine.scheduler import ScheduledChunk, Sequence

    per_seq = CONTEXT_TOKENS // BLOCK_SIZE_TOKENS + 1
    chunks, tables = [], {}
    for i in range(decodes):
        seq = Sequence(f"d{i}", list(range(1, CONTEXT_TOKENS)))
        seq.output_token_ids.append(7)
        tables[seq.seq_id] = list(range(i * per_seq, (i + 1) * per_seq))
        chunks.append(ScheduledChunk(seq, CONTEXT_TOKENS - 1, 1, True))
    base = decodes * per_seq
    for j in range(prompt_chunks):
        start = PROMPT_CHUNK_TOKENS * j
        seq = Sequence(f"p{j}", list(range(1, start + PROMPT_CHUNK_TOKENS + 2)))
        need = -(-(start + PROMPT_CHUNK_TOKENS) // BLOCK_SIZE_TOKENS)
        tables[seq.seq_id] = list(range(base, base + need))
        base += need
        chunks.append(ScheduledChunk(seq, start, PROMPT_CHUNK_TOKENS, False))
    return chunks, tables


def count_step(fake, model, decodes: int, prompt_chunks: int) -> KernelCount:
    """One step's forward and greedy sampling, counted (the inputs' upload apart)."""
    from wattserve.daemon.engine.request import SamplingParams
    from wattserve.daemon.engine.sampler import sample

    chunks, tables = step_chunks(decodes, prompt_chunks)
    with fake:
        inp = model.prepare(chunks, tables)
        counter = KernelCount()
        with counter:
            logits = model.forward(inp)
            n = len(inp.sampled_chunks)
            if n:
                sample(logits, [SamplingParams(temperature=0.0)] * n, [None] * n)
    return counter


# The engine run whose device operations are recorded: a few greedy requests decoding.
RECORD_BATCH = 4
RECORD_PROMPT_TOKENS = 24
RECORD_NEW_TOKENS = 6
FILL_TOKEN = 1000  # the read-back's stand-in token (a fake tensor holds no values)


def record_engine(
    dtype: torch.dtype = torch.bfloat16, tokenizer=None, num_layers: int = 1, patch=None
) -> dict:
    """Run a real Engine with asynchronous steps on the fake cuda:0 over the shaped model
    (greedy requests: prefill, then decodes) with recording device ops and their watch
    mode on; returns the record's summary (device_ops.summarize) and the ops themselves.
    patch(engine): called before the requests are added (tests put a blocking read in)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from wattserve.daemon.engine.device_ops import RecordingOps
    from wattserve.daemon.engine.engine import Engine, EngineOptions
    from wattserve.daemon.engine.kv_cache import bytes_per_block
    from wattserve.daemon.engine.loader import LoadedModel
    from wattserve.daemon.engine.request import SamplingParams

    if tokenizer is None:
        from wattserve.bench.host_time import embedded_tokenizer

        tokenizer = embedded_tokenizer()
    ops = RecordingOps(CUDA0, fill=lambda n: [float(FILL_TOKEN)] * n)
    per_seq = -(-(RECORD_PROMPT_TOKENS + RECORD_NEW_TOKENS + 1) // BLOCK_SIZE_TOKENS)
    bpb = bytes_per_block(
        num_layers,
        BLOCK_SIZE_TOKENS,
        SHAPE["num_key_value_heads"],
        SHAPE["head_dim"],
        dtype.itemsize,
    )
    options = EngineOptions(
        kv_cache_bytes=(RECORD_BATCH * per_seq + 4) * bpb,
        max_num_seqs=RECORD_BATCH,
        max_num_batched_tokens=RECORD_BATCH * RECORD_PROMPT_TOKENS,
        max_model_len=RECORD_PROMPT_TOKENS + RECORD_NEW_TOKENS + 1,
        cuda_graphs=False,  # capture needs a real device
        async_steps=True,
    )
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    params = SamplingParams(max_tokens=RECORD_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with fake:
        hf = LlamaForCausalLM(LlamaConfig(num_hidden_layers=num_layers, **SHAPE))
        loaded = LoadedModel(hf, tokenizer, "llama-3.2-1b-shaped", None, dtype, 0.0, False)
        engine = Engine(loaded, options, CUDA0, device_ops=ops)
        if patch is not None:
            patch(engine)
        for i in range(RECORD_BATCH):
            prompt = list(range(100 + i, 100 + i + RECORD_PROMPT_TOKENS))
            engine.add_request(prompt, params, lambda out: None)
        with ops.watch():
            while engine.has_work():
                engine.step()
    return {"summary": ops.summary(), "ops": ops.ops}


def measure(dtype: torch.dtype, level: str | None = None) -> dict:
    one, two = build_model(1, dtype, level), build_model(2, dtype, level)
    steps = {f"decode_bs{b}": (b, 0) for b in (1, 64, 256)}
    steps |= {f"mixed_64+{c}": (64, c) for c in (1, 2, 3, 4)}
    per_step = {}
    for name, (decodes, chunks) in steps.items():
        c1, c2 = count_step(*one, decodes, chunks), count_step(*two, decodes, chunks)
        per_layer = c2.total - c1.total
        per_step[name] = {
            "kernels_per_layer": per_layer,
            "kernels_outside_layers": c1.total - per_layer,
            "d2h_copies": c1.d2h_copies,
            "scalar_reads": c1.scalar_reads,
            "layer_ops": {
                k: c2.kernels.get(k, 0) - c1.kernels.get(k, 0)
                for k in sorted(set(c2.kernels) | set(c1.kernels))
                if c2.kernels.get(k, 0) - c1.kernels.get(k, 0)
            },
        }
    decode = [v for k, v in per_step.items() if k.startswith("decode")]
    mixed = [v for k, v in per_step.items() if k.startswith("mixed")]
    return {
        "kernels_per_layer_decode": max(v["kernels_per_layer"] for v in decode),
        "kernels_per_layer_mixed": max(v["kernels_per_layer"] for v in mixed),
        "kernel_growth_with_batch": max(
            per_step["decode_bs256"]["kernels_per_layer"]
            - per_step["decode_bs1"]["kernels_per_layer"],
            per_step["mixed_64+4"]["kernels_per_layer"]
            - per_step["mixed_64+1"]["kernels_per_layer"],
        ),
        "kernels_outside_layers": max(v["kernels_outside_layers"] for v in decode + mixed),
        # From the engine's own record of its device operations (record_engine).
        **recorded_keys(dtype),
        "per_step": per_step,
    }


@functools.lru_cache(maxsize=4)
def recorded_keys(dtype: torch.dtype) -> dict:
    """syncs_before_next_launch, d2h_copies_per_step (each pinned and non-blocking, else
    counted in unpinned_or_blocking_d2h_copies) and pageable_h2d_copies_per_step, from
    record_engine's run (at the loaded dtype, whatever level the kernels are counted at:
    the step's device operations do not depend on it)."""
    summary = record_engine(dtype)["summary"]
    keys = (
        "syncs_before_next_launch",
        "d2h_copies_per_step",
        "pageable_h2d_copies_per_step",
        "unpinned_or_blocking_d2h_copies",
    )
    return {k: summary[k] for k in keys} | {
        "device_ops_record": (
            f"a real Engine with asynchronous steps on the fake cuda:0, 1 layer of the "
            f"shape, {RECORD_BATCH} greedy requests of {RECORD_PROMPT_TOKENS} prompt and "
            f"{RECORD_NEW_TOKENS} new tokens: {summary['launches']} launches recorded"
        )
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench host", description=__doc__)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--per-step", action="store_true", help="print each step's op counts too")
    ap.add_argument(
        "--level",
        choices=["bf16", "int8", "int4", "int4-g128", "fp8"],
        help="quantization level of the matmul weights (default: as loaded, in --dtype)",
    )
    ap.add_argument(
        "--no-host-time", action="store_true", help="skip the host time per step (~1 minute)"
    )
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    line = measure(dtype) if args.level is None else measure(dtype, args.level)
    if not args.per_step:
        detail = line.pop("per_step")
        for name, v in detail.items():
            print(
                f"{name:>14}: {v['kernels_per_layer']} kernels a layer, "
                f"{v['kernels_outside_layers']} outside, {v['d2h_copies']} d2h",
                flush=True,
            )
    line["budgets"] = budgets(args.level)
    line["met"] = {k: line[k] <= b for k, b in line["budgets"].items()}
    if args.no_host_time:
        host = {k: None for k in HOST_BUDGETS_MS} | {"host_ms_note": "skipped (--no-host-time)"}
    else:
        from wattserve.bench import host_time

        host = host_time.measure()
    line |= host
    line["host_budgets_ms"] = HOST_BUDGETS_MS
    line["host_met"] = {
        k: None if host[k] is None else host[k] <= b for k, b in HOST_BUDGETS_MS.items()
    }
    line |= {
        "model": "llama-3.2-1b-shaped (SmolLM2 vocabulary)",
        "device": "fake cuda:0 (FakeTensorMode)",
        "dtype": args.dtype,
        "level": args.level or ("bf16" if dtype == torch.bfloat16 else "fp32"),
        "torch": torch.__version__,
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
