"""The engine's device operations as recorded (device_ops.RecordingOps) under a fake CUDA
device: a real Engine with asynchronous steps waits on no step's read-back before the next
launch, reads each step back once into pinned memory, and uploads only from pinned memory;
a blocking read put between two launches shows in the record.
"""

from __future__ import annotations

import pytest
import torch

from wattserve.bench import host
from wattserve.daemon.engine import engine as engine_module
from wattserve.daemon.engine.device_ops import summarize


def test_a_wait_on_a_step_before_the_next_launch_is_a_sync():
    synchronous = [("launch", 0), ("d2h", "pinned", True), ("event", 0), ("wait", 0)]
    synchronous += [("launch", 1), ("d2h", "pinned", True), ("event", 1), ("wait", 1)]
    synchronous += [("launch", 2)]
    asynchronous = [("launch", 0), ("d2h", "pinned", True), ("event", 0)]
    asynchronous += [("launch", 1), ("d2h", "pinned", True), ("event", 1), ("wait", 0)]
    asynchronous += [("launch", 2), ("wait", 1)]
    assert summarize(synchronous)["syncs_before_next_launch"] == 1
    assert summarize(asynchronous)["syncs_before_next_launch"] == 0
    read = asynchronous[:4] + [("blocking_read", "aten.item")] + asynchronous[4:]
    assert summarize(read)["syncs_before_next_launch"] == 1
    pageable = asynchronous[:1] + [("h2d", "pageable"), ("d2h", "pageable", True)]
    got = summarize(pageable + asynchronous[1:])
    assert got["pageable_h2d_copies_per_step"] == 1
    assert got["unpinned_or_blocking_d2h_copies"] == 1 and got["d2h_copies_per_step"] == 2


@pytest.fixture(scope="module")
def tokenizer():
    from wattserve.bench.host_time import embedded_tokenizer

    return embedded_tokenizer()


def test_the_engine_launches_step_n_plus_1_before_waiting_on_step_n(tokenizer):
    record = host.record_engine(torch.bfloat16, tokenizer)
    got, ops = record["summary"], record["ops"]
    assert got["syncs_before_next_launch"] == 0, ops
    assert got["d2h_copies_per_step"] == 1 and got["unpinned_or_blocking_d2h_copies"] == 0
    assert got["pageable_h2d_copies_per_step"] == 0, ops
    # The prefill samples the first token, the decodes the rest; the step launched before
    # the last read-back showed the length finish computed a token that was dropped.
    assert got["launches"] == host.RECORD_NEW_TOKENS + 1
    launches = [i for i, op in enumerate(ops) if op[0] == "launch"]
    for step in range(len(launches) - 1):
        wait = ops.index(("wait", step))
        assert wait > launches[step + 1], (step, ops)
    assert not [op for op in ops if op[0] == "blocking_read"]


@pytest.mark.parametrize("read", ["item", "cpu"])
def test_a_blocking_read_between_two_launches_shows_in_the_record(tokenizer, monkeypatch, read):
    real = engine_module.device_ids

    def reading(logits, params, *args):
        ids = real(logits, params, *args)
        if read == "item":
            ids.amax().item()
        else:
            ids.cpu()
        return ids

    monkeypatch.setattr(engine_module, "device_ids", reading)
    got = host.record_engine(torch.bfloat16, tokenizer)["summary"]
    assert got["syncs_before_next_launch"] == 1
