"""`wattserve bench host`'s counts on the fake CUDA device: what stays true of a step.

The absolute kernel counts are the bench's to report (the budgets in its JSON); what is
held here is their shape: the same kernels a layer at batch 1, 64 and 256 and with 1 to 4
prompt chunks (a per-sequence or per-chunk loop would grow them), and one read-back a step.
"""

from __future__ import annotations

import json

import pytest
import torch

from wattserve.bench import host

# On CUDA the engine's one-launch attention is the Triton kernel (a test extra, as on torch's
# CUDA wheels); without triton the torch path's per-chunk calls would be what is counted.
pytest.importorskip("triton", reason="triton (a test extra) is not installed")


@pytest.fixture(scope="module")
def counts() -> dict:
    return host.measure(torch.bfloat16)


def test_a_layer_launches_as_many_kernels_at_any_batch_and_chunk_count(counts):
    assert counts["kernel_growth_with_batch"] == 0, counts["per_step"]
    assert counts["kernels_per_layer_mixed"] == counts["kernels_per_layer_decode"]
    # one attention launch a layer, whatever the step holds
    for name, step in counts["per_step"].items():
        attention = {k: v for k, v in step["layer_ops"].items() if "attention" in k}
        assert sum(attention.values()) == 1, (name, step["layer_ops"])


def test_a_layer_and_the_rest_of_a_step_fit_their_kernel_budgets(counts):
    for key in ("kernels_per_layer_decode", "kernels_per_layer_mixed", "kernels_outside_layers"):
        assert counts[key] <= host.BUDGETS[key], (key, counts[key])
    # rope and the KV write are one launch, never an index_copy or a gather of K/V again
    for name, step in counts["per_step"].items():
        gathers = [k for k in step["layer_ops"] if "index" in k or "gather" in k]
        assert not gathers, (name, step["layer_ops"])


def test_a_step_reads_back_once(counts):
    # the forward and sampler alone: one read-back, no scalar read
    assert all(s["d2h_copies"] == 1 for s in counts["per_step"].values())
    assert all(s["scalar_reads"] == 0 for s in counts["per_step"].values())
    # the engine's steps: one pinned non-blocking read-back a step, waited on only after
    # the next step is launched, and every upload from pinned memory
    assert counts["d2h_copies_per_step"] == 1
    assert counts["unpinned_or_blocking_d2h_copies"] == 0
    assert counts["syncs_before_next_launch"] == 0
    assert counts["pageable_h2d_copies_per_step"] == 0


def test_the_command_prints_its_keys_and_budgets_last(capsys, monkeypatch):
    monkeypatch.setattr(
        host,
        "measure",
        lambda dtype: {
            "kernels_per_layer_decode": 10,
            "kernels_per_layer_mixed": 13,
            "kernel_growth_with_batch": 0,
            "kernels_outside_layers": 12,
            "d2h_copies_per_step": 1,
            "syncs_before_next_launch": 1,
            "pageable_h2d_copies_per_step": 0,
            "per_step": {},
        },
    )
    from wattserve.bench import host_time

    host_ms = {"host_ms_per_step_bs1": 0.2, "host_ms_per_step_bs64": 1.5}
    host_ms |= {"host_ms_per_step_bs256": 2.5, "host_ms_note": "how"}
    monkeypatch.setattr(host_time, "measure", lambda: host_ms)
    assert host.main([]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["met"] == {
        "kernels_per_layer_decode": True,
        "kernels_per_layer_mixed": True,
        "kernel_growth_with_batch": True,
        "syncs_before_next_launch": False,
        "d2h_copies_per_step": True,
        "kernels_outside_layers": True,
        "pageable_h2d_copies_per_step": True,
    }
    assert line["pageable_h2d_copies_per_step"] == 0
    assert line["dtype"] == "bfloat16" and line["host_ms_per_step_bs64"] == 1.5
    assert line["host_ms_note"] == "how"
    assert line["host_met"] == {
        "host_ms_per_step_bs1": True,
        "host_ms_per_step_bs64": False,
        "host_ms_per_step_bs256": True,
    }


# ---- quantized levels: the layer is bf16's with each linear's kernels swapped ----------

LEVEL_LINEAR_OPS = {
    "int8": {"wattserve.triton_int8_linear.default": 4},  # one launch a linear
    "fp8": {"wattserve.triton_fp8_quantize_rows.default": 4, "aten._scaled_mm.default": 4},
}


@pytest.fixture(scope="module", params=sorted(LEVEL_LINEAR_OPS))
def level_counts(request) -> tuple[str, dict]:
    return request.param, host.measure(torch.bfloat16, request.param)


def test_int8_and_fp8_layers_run_the_triton_ops_within_16_kernels(counts, level_counts):
    level, quantized = level_counts
    assert host.budgets(level)["kernels_per_layer_decode"] == 16
    for key in ("kernels_per_layer_decode", "kernels_per_layer_mixed"):
        assert quantized[key] <= 16, (level, key, quantized[key])
    assert quantized["kernel_growth_with_batch"] == 0
    for name, step in quantized["per_step"].items():
        bf16_ops = dict(counts["per_step"][name]["layer_ops"])
        assert bf16_ops.pop("aten.linear.default") == 4
        assert step["layer_ops"] == bf16_ops | LEVEL_LINEAR_OPS[level], (level, name)


def test_the_command_takes_a_level_and_its_budgets(capsys, monkeypatch):
    seen = []

    def fake_measure(dtype, level=None):
        seen.append(level)
        return {
            "kernels_per_layer_decode": 13,
            "kernels_per_layer_mixed": 13,
            "kernel_growth_with_batch": 0,
            "kernels_outside_layers": 10,
            "d2h_copies_per_step": 1,
            "syncs_before_next_launch": 1,
            "pageable_h2d_copies_per_step": 0,
            "per_step": {},
        }

    monkeypatch.setattr(host, "measure", fake_measure)
    assert host.main(["--level", "fp8", "--no-host-time"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert seen == ["fp8"] and line["level"] == "fp8"
    assert line["budgets"]["kernels_per_layer_decode"] == 16
    assert line["met"]["kernels_per_layer_decode"] and line["met"]["kernels_per_layer_mixed"]
    assert host.budgets(None) == host.BUDGETS  # bf16's stay the issue's


def test_an_int4_level_on_cuda_keeps_a_bf16_head():
    from wattserve.kernels.linear import Linear

    _, model = host.build_model(1, torch.bfloat16, "int4")
    head = model._active.lm_head
    assert isinstance(head, Linear) and head.out_features == host.SHAPE["vocab_size"]
