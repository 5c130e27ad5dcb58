"""On CUDA the engine never builds or loads the project's C++ CPU kernels.

Their build takes tens of seconds on a GPU machine's first start and serves nothing there.
The engine starts on the fake cuda:0 of the device-trace tests (FakeTensorMode, no GPU),
with the sizes of unbuilt quantization levels computed for the start-up log, then runs a
decode and a mixed step at int8; the one function that builds and loads the kernels is
replaced by a recorder that must stay silent.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.unit.test_engine_device_trace import CUDA0, _chunks
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.kernels import extension
from wattserve.kernels.int_linear import int_linear_available
from wattserve.kernels.linear import dense_linear_available


@pytest.fixture
def kernel_loads(monkeypatch) -> list[str]:
    """Calls that would build or load the C++ kernels (answered 'unavailable')."""
    calls: list[str] = []

    def record() -> bool:
        calls.append("load_cpu_kernels")
        return False

    monkeypatch.setattr(extension, "_load_once", record)
    # Answers cached by earlier tests in this process would hide a call.
    int_linear_available.cache_clear()
    dense_linear_available.cache_clear()
    yield calls
    int_linear_available.cache_clear()
    dense_linear_available.cache_clear()


def test_the_recorder_sees_a_cpu_engines_load(tiny_llama, kernel_loads):
    """The seam is the one every path goes through: a CPU engine's start hits it."""
    Engine(tiny_llama, EngineOptions(kv_cache_bytes=1 << 20), "cpu")
    assert kernel_loads


def test_a_cuda_engine_never_builds_or_loads_the_cpu_kernels(tiny_llama, kernel_loads):
    options = EngineOptions(
        kv_cache_bytes=1 << 20,
        cuda_graphs=False,
        quantization_levels=("bf16", "int8"),
        quant_prepare="lazy",  # int8's size is computed, not measured, for the start log
    )
    loaded = dataclasses.replace(tiny_llama, dtype=torch.bfloat16)  # CUDA's "auto" dtype
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the real HF weights go in once
    with fake:
        engine = Engine(loaded, options, CUDA0)
        assert engine.model.attention_backend != "cpp"  # triton, or torch without it
        assert engine.model.level_bytes("int8") > 0
        engine.model.use_level("int8")
        for kind in ("decode", "mixed"):
            chunks, tables = _chunks(kind)
            engine.model.forward(engine.model.prepare(chunks, tables))
    assert kernel_loads == []
    assert torch.device(engine.model.embed.device) == CUDA0
