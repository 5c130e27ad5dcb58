"""The model step on a CUDA device, traced without a GPU: FakeTensorMode with a fake cuda:0.

What is checked here on a CPU-only torch build (2.13.0+cpu):
- LlamaModel builds its weights, rotary table and KV pool on the fake cuda:0;
- prepare() stages the step's tensors on the host and moves them with one copy;
- a decode step and a prefill (mixed) step of forward() and the sampler run with every
  op's tensors on cuda:0 -- no host tensor is touched (the fake mode refuses real tensors,
  and a dispatch mode records any op that sees a CPU tensor) -- and read back to the host
  exactly once, the sampled ids (one device-to-host copy; no .item() / .tolist() on a
  cuda tensor: `aten._local_scalar_dense` on a cuda tensor would count as a sync too).

What cannot be faked here, and is left to `wattserve bench gpu` on a GPU machine:
- numerics and speed (fake tensors carry shapes, dtypes and devices, no values);
- pinned memory itself: under FakeTensorMode `torch.empty(pin_memory=True)` yields a fake
  CPU tensor, so that the staging buffer is really page-locked is not observable;
- CUDA generators (non-greedy sampling): `torch.Generator(device="cuda")` needs the CUDA
  library, so only greedy rows are sampled here;
- CUDA-graph capture (torch.cuda.CUDAGraph needs a real device);
- the int4 levels: building an Int4Linear makes a contiguous copy of its scales, and a copy
  between (fake) CUDA tensors needs the CUDA library; int8 and fp8 steps are traced here.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.tiny_model import tiny_hf_llama
from wattserve.daemon.engine.model import LlamaModel
from wattserve.daemon.engine.request import SamplingParams
from wattserve.daemon.engine.sampler import sample
from wattserve.daemon.engine.scheduler import ScheduledChunk, Sequence

CUDA0 = torch.device("cuda", 0)
HAVE_TRITON = importlib.util.find_spec("triton") is not None
_SCALAR = torch.ops.aten._local_scalar_dense.default
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


def _tensors(tree) -> list[torch.Tensor]:
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


class HostTraffic(TorchDispatchMode):
    """Counts host synchronisations and records ops that touch a CPU tensor.

    A sync is a device-to-host copy, or a scalar read (`_local_scalar_dense`, what .item()
    and .tolist() dispatch to) of a device tensor. Scalar reads return 0 so that fake
    tensors can be "read". Ops on the CPU copy that a sync produced are the host's own
    (reading back the ids) and are not flagged.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.host_ops: list[str] = []
        self._readback: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if func is _SCALAR:
            if inputs[0].device.type != "cpu":
                self.syncs.append(str(func))
            return 0
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        on_host = [t for t in inputs if t.device.type == "cpu"]
        if func in _COPIES and any(t.device.type != "cpu" for t in inputs) and all(
            t.device.type == "cpu" for t in outputs
        ):
            self.syncs.append(str(func))
            self._readback.update(id(t) for t in outputs)
        elif on_host and not all(id(t) in self._readback for t in on_host):
            self.host_ops.append(str(func))
        elif on_host:
            self._readback.update(id(t) for t in outputs)
        return out


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_llama()


def _chunks(kind: str) -> tuple[list[ScheduledChunk], dict[str, list[int]]]:
    a = Sequence("a", list(range(1, 11)))  # 10 prompt tokens
    b = Sequence("b", list(range(20, 27)))  # 7 prompt tokens
    tables = {"a": [3, 1, 4], "b": [0, 2]}
    if kind == "decode":  # both have their prompt cached and decode one token each
        a.output_token_ids.append(5)
        b.output_token_ids.append(6)
        return [ScheduledChunk(a, 10, 1, True), ScheduledChunk(b, 7, 1, True)], tables
    # mixed: a prefills its whole prompt, b a chunk after 3 cached tokens (no sampling)
    return [ScheduledChunk(a, 0, 10, True), ScheduledChunk(b, 3, 4, False)], tables


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize(
    "dtype,level",
    [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, "int8"),
     (torch.bfloat16, "fp8")],
)
def test_a_cuda_step_touches_no_host_tensor_and_syncs_once(hf_model, kind, dtype, level):
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the real HF weights go in once
    with fake:
        model = LlamaModel(hf_model, 8, 4, dtype, CUDA0)
        if level is not None:
            model.use_level(level)  # quantized on the (fake) device
    assert model.attention_backend == ("triton" if HAVE_TRITON else "torch")
    for t in [model.embed, model.final_norm, model.rope.cos, *model.k_cache, *model.v_cache]:
        assert t.device == CUDA0
    qkv = model.layers[0].qkv
    assert next(t for t in vars(qkv).values() if isinstance(t, torch.Tensor)).device == CUDA0
    fake.allow_non_fake_inputs = False  # from here a real tensor in any op raises
    chunks, tables = _chunks(kind)
    with fake:
        inp = model.prepare(chunks, tables)
        for t in (inp.input_ids, inp.slots, inp.block_tables, inp.context_lens):
            assert t.device == CUDA0
        assert inp.decode_only == (kind == "decode")
        traffic = HostTraffic()
        with traffic:
            logits = model.forward(inp)
            n = len(inp.sampled_chunks)
            ids = sample(logits, [SamplingParams(temperature=0.0)] * n, [None] * n)
    assert logits.shape == (n, 96) and logits.device == CUDA0
    assert len(ids) == n
    assert traffic.host_ops == [], f"ops on host tensors in the step: {traffic.host_ops}"
    assert len(traffic.syncs) == 1, f"host syncs in one step: {traffic.syncs}"
    # Sampled rows (temperature, top-p, top-k) are drawn on the device with the greedy
    # ones: still one read-back for the batch.
    mixed = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(top_k=5)][:n]
    mixed[0:0] = [SamplingParams(temperature=0.0)] * (n - len(mixed))
    with fake:
        sampled_traffic = HostTraffic()
        with sampled_traffic:
            drawn = sample(logits, mixed, [None] * n)
    assert len(drawn) == n and len(sampled_traffic.syncs) == 1, sampled_traffic.syncs
    # The host's only part: one upload of the sampled rows' parameters.
    uploads = [op for op in sampled_traffic.host_ops if op == "aten._to_copy.default"]
    assert len(uploads) == 1, sampled_traffic.host_ops
    assert set(sampled_traffic.host_ops) <= {
        "aten.lift_fresh.default", "prim.device.default", "aten._to_copy.default"
    }, sampled_traffic.host_ops


def test_prepare_moves_the_step_in_one_copy(hf_model):
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = LlamaModel(hf_model, 8, 4, torch.bfloat16, CUDA0)
    chunks, tables = _chunks("mixed")
    with fake:
        traffic = _CopyCounter()
        with traffic:
            model.prepare(chunks, tables)
    assert traffic.host_to_device == 1


class _CopyCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.host_to_device = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = _tensors((args, kwargs))
        if func in _COPIES and any(t.device.type == "cpu" for t in ins) and any(
            t.device.type == "cuda" for t in _tensors(out)
        ):
            self.host_to_device += 1
        return out


def test_the_counter_sees_item_and_tolist_as_syncs():
    with FakeTensorMode():
        x = torch.zeros(4, device=CUDA0)
        traffic = HostTraffic()
        with traffic:
            x.sum().item()
            x.tolist()  # one scalar read per element: four
    assert len(traffic.syncs) == 5


def test_kv_budget_on_cuda_is_what_the_weights_leave_of_gpu_memory_utilization(monkeypatch):
    from wattserve.daemon.engine.engine import EngineOptions, _kv_budget_bytes

    gib = 2**30
    # 140 GiB GPU, 6 GiB in use (weights, another process): 0.9 * 140 - 6 = 120 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (134 * gib, 140 * gib))
    budget = _kv_budget_bytes(CUDA0, EngineOptions(gpu_memory_utilization=0.9))
    assert budget == int(140 * gib * 0.9) - 6 * gib
    # more in use than the share allows: no room, never a negative budget
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10 * gib, 140 * gib))
    assert _kv_budget_bytes(CUDA0, EngineOptions(gpu_memory_utilization=0.5)) == 0


def test_every_tensor_factory_in_the_engine_and_kernels_names_its_device():
    """A static guard for what the trace checks dynamically: torch.tensor / zeros / arange
    / empty / ... / Generator in wattserve/daemon/engine and wattserve.kernels always pass device=
    (the *_like factories inherit their input's device and are not listed)."""
    import ast
    from pathlib import Path

    factories = {"tensor", "zeros", "ones", "empty", "full", "arange", "eye", "randn", "rand",
                 "randint", "linspace", "as_tensor", "Generator"}
    root = Path(__file__).resolve().parents[2]
    missing = []
    sources = [
        *(root / "wattserve/daemon/engine").glob("*.py"),
        *(root / "wattserve/kernels").glob("*.py"),
    ]
    checked = 0
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in factories
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                checked += 1
                if not any(k.arg == "device" for k in node.keywords):
                    missing.append(f"{path.relative_to(root)}:{node.lineno} torch.{node.func.attr}")
    assert checked > 10 and missing == []


class _OpLog(TorchDispatchMode):
    """Every op of a traced step (views and prim metadata queries excluded), and those that
    take a tensor shaped like the KV pool (the write takes a flat view of it)."""

    def __init__(self, pool_shape: torch.Size) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.pool_readers: list[str] = []
        self._pool_shape = pool_shape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.namespace != "prim":
            self.ops.append(str(func))
            if any(t.shape == self._pool_shape for t in _tensors((args, kwargs))):
                self.pool_readers.append(str(func))
        return out


def _step_chunks(decodes: int, prompts: int) -> tuple[list[ScheduledChunk], dict]:
    """`decodes` sequences decoding one token after 9 cached ones, then `prompts` chunks
    of 6 tokens after 5 cached ones; every sequence in 4 blocks of 4."""
    chunks, tables = [], {}
    for i in range(decodes + prompts):
        seq = Sequence(f"s{i}", list(range(1, 16)))
        tables[seq.seq_id] = [4 * i + b for b in range(4)]
        if i < decodes:
            chunks.append(ScheduledChunk(seq, 9, 1, True))
        else:
            chunks.append(ScheduledChunk(seq, 5, 6, True))
    return chunks, tables


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton)")
def test_cuda_attention_is_one_triton_launch_per_layer_for_every_step_kind(hf_model):
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = LlamaModel(hf_model, 64, 4, torch.bfloat16, CUDA0)
    assert model.attention_backend == "triton"
    fake.allow_non_fake_inputs = False
    layers, pool = model.shape.num_layers, model.k_cache[0].shape
    counts = {}
    for decodes, prompts in [(1, 0), (8, 0), (1, 1), (8, 4), (0, 3)]:
        chunks, tables = _step_chunks(decodes, prompts)
        with fake:
            inp = model.prepare(chunks, tables)
            log = _OpLog(pool)
            with log:
                model.forward(inp)
        launches = log.ops.count("wattserve.triton_paged_attention.default")
        assert launches == layers, (decodes, prompts, log.ops)
        # The pool is touched by two launches a layer alone: rope with the KV write, then
        # the attention kernel; never gathered, never written by an index_copy.
        assert log.pool_readers == POOL_OPS * layers
        assert "aten.index_copy_.default" not in log.ops
        assert not any("scaled_dot_product" in op for op in log.ops), log.ops
        counts[decodes, prompts] = len(log.ops)
    # No op per sequence or per chunk: a step's op count does not grow with its batch.
    assert counts[1, 0] == counts[8, 0]
    assert counts[1, 1] == counts[8, 4] == counts[0, 3]
    # A window and a soft-cap (Mistral, Gemma 2) are arguments of the same launch.
    model.sliding_windows = [4] * layers
    model.logit_softcap = 30.0
    chunks, tables = _step_chunks(8, 4)
    with fake:
        inp = model.prepare(chunks, tables)
        log = _OpLog(pool)
        with log:
            model.forward(inp)
    assert len(log.ops) == counts[8, 4]
    assert log.pool_readers == POOL_OPS * layers


POOL_OPS = ["wattserve.triton_rope_write_kv.default", "wattserve.triton_paged_attention.default"]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton)")
def test_query_tiles_travel_with_a_mixed_step_only(hf_model):
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = LlamaModel(hf_model, 64, 4, torch.bfloat16, CUDA0)
        mixed = model.prepare(*_step_chunks(2, 2))
        decode = model.prepare(*_step_chunks(3, 0))
    # 2 + 12 query tokens in 4 chunks: 14 // 16 + 4 tiles, on the device
    assert mixed.query_tiles.shape == (4, 2) and mixed.query_tiles.device == CUDA0
    assert decode.query_tiles.shape == (0, 2)  # the decode-only variant needs none
