"""`wattserve bench gpu` on a machine without a GPU: one clear line, non-zero exit, no
model loaded, no NVML call that sets anything. Its CPU dry run goes through every section
that needs no NVML (a tiny random model, tiny sizes); the measuring part needs a GPU."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from wattserve.bench import gpu
from wattserve.daemon.cli import main as cli_main


def test_without_a_gpu_it_fails_loudly(capsys, monkeypatch):
    monkeypatch.setattr(gpu, "_run", lambda *a: pytest.fail("measured without a GPU"))
    rc = cli_main(["bench", "gpu"])
    out, err = capsys.readouterr()
    assert rc == gpu.NO_GPU_EXIT != 0
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("wattserve bench gpu: no GPU") or "no NVML" in err
    assert "nothing measured" in err
    last = json.loads(out.strip().splitlines()[-1])
    assert last["bench"] == "gpu" and last["ok"] is False


def test_a_cuda_build_with_no_device_is_refused(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(gpu.NoGpuError, match="CUDA sees no device"):
        gpu.preflight()


def test_a_gpu_without_nvml_is_refused(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    class NVMLError(Exception):
        pass

    def init():
        raise NVMLError("Driver Not Loaded")

    monkeypatch.setitem(
        sys.modules, "pynvml", types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=init)
    )
    with pytest.raises(gpu.NoGpuError, match="no NVML: Driver Not Loaded"):
        gpu.preflight()


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def test_the_cpu_dry_run_goes_through_every_section(tmp_path, cache_dir, capsys, monkeypatch):
    monkeypatch.setenv("WATTSERVE_CACHE", str(cache_dir))  # the suite's converted SmolLM2
    rc = cli_main(["bench", "gpu", "--dry-run-cpu", "--out-dir", str(tmp_path)])
    out, _ = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    failed = {k: v["error"] for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert rc == 0 and report["ok"] and report["errors"] == {}, (failed, report["errors"])
    assert report["dry_run_cpu"] is True and "no NVML" in report["skipped"]["nvml"]
    for name in ("smollm2_bfloat16", "smollm2_float32", "llama_1b_shaped"):
        section = report[name]
        assert _number(section["hf_generate_bs1_tok_s"]), name
        assert section["hf_continuous_batching_tok_s"] > 0, name
        assert _number(section["ratio_vs_hf_continuous_batching"]), name
    for name in ("smollm2_bfloat16", "smollm2_float32"):
        section = report[name]
        assert section["greedy_vs_hf"]["of"] == 3
        for key in ("bs1_decode_tok_s_graphs_on", "batch3_tok_s_graphs_off"):
            assert section[key] > 0, (name, key)
    llama = report["llama_1b_shaped"]
    assert llama["bf16"]["bs1_decode_tok_s"] > 0 and llama["bf16_batch3_tok_s"] > 0
    for name in ("smollm2_bfloat16", "llama_1b_shaped"):
        serving = report[name]["serving"]
        assert serving["completed"] == serving["requests"] == 3 and serving["failed"] == 0
        assert serving["output_tok_s"] > 0
        for key in ("ttft_ms", "tpot_ms"):
            assert all(_number(serving[key][q]) for q in ("p50", "p99")), (name, key)
    power = dict(report["power"])
    # No NVML reading in the dry run: no power calibration is fitted, and it says why.
    assert power.pop("calibration") == {"skipped": "no NVML power reading"}
    assert set(power) == {"idle", "bs1", "batch8", "batch3"}
    for name, load in power.items():
        assert load["measured"].startswith("CPU dry run"), name
        assert load["virtual_gpu"]["predicted_w_mean"] > 0, name
        assert load["predicted_over_measured"] is None, name
    for name in ("bs1", "batch8", "batch3"):
        assert power[name]["tokens"] > 0 and power[name]["steps"] > 0
        assert power[name]["virtual_gpu"]["busy_fraction"] > 0
        idle_w = power["idle"]["virtual_gpu"]["predicted_w_mean"]
        assert power[name]["virtual_gpu"]["predicted_w_mean"] > idle_w
    doc = Path(report["doc"])
    assert doc.parent == tmp_path and doc.name.startswith("gpu-dry-run-")
    assert "virtual GPU" in doc.read_text()


def test_the_prediction_prices_busy_and_idle_time_with_the_virtual_gpu_model():
    from wattserve.daemon.device.protocol import EngineActivity
    from wattserve.daemon.device.virtual import VirtualGpuParams, compute_fraction, power_w

    p = VirtualGpuParams()
    step = EngineActivity(step_duration_s=0.5, decode_tokens=8, weight_bytes_read=10**9, flops=4e12)
    busy_w = power_w(p, 1500, 50.0, compute_fraction(p, step))
    idle = gpu.predict_power([], 2.0, [(10.0, 900, 40.0), (10.1, 1500, 60.0)])
    assert idle["predicted_w_mean"] == round(power_w(p, 1200, 50.0, None), 2)
    # The step takes the clock and temperature read last before it started (1500 MHz,
    # 50 C), the idle half of the window their mean (1500 MHz, 50 C here).
    readings = [(10.0, 1500, 50.0), (10.4, 1500, 50.0), (11.0, 345, 30.0)]
    half = gpu.predict_power([(10.5, step)], 1.0, readings[:2])
    assert half["busy_fraction"] == 0.5 and half["sm_clock_mhz_busy_mean"] == 1500
    assert half["predicted_w_mean"] == round((busy_w + power_w(p, 1500, 50.0, None)) / 2, 2)
    whole = gpu.predict_power([(10.5, step)], 0.5, readings)
    assert whole["predicted_w_mean"] == round(busy_w, 2)  # busy all window: idle clock unused
    no_nvml = gpu.predict_power([(0.0, step)], 0.5, [])
    assert no_nvml["sm_clock_mhz_busy_mean"] == p.sm_clock_max_mhz


def test_a_failed_part_is_reported_and_fails_the_run_without_stopping_it():
    report = {"ok": True, "errors": {}, "skipped": {}}
    args = types.SimpleNamespace(deadline_s=math.inf, max_seconds=450.0)

    def boom():
        raise RuntimeError("CB needs more memory")

    assert gpu._part(report, "smollm2_bfloat16.hf_continuous_batching", boom, args) is None
    assert gpu._part(report, "power", lambda: {"idle": {}}, args) == {"idle": {}}
    assert report == {
        "ok": False,
        "errors": {"smollm2_bfloat16.hf_continuous_batching": "RuntimeError: CB needs more memory"},
        "skipped": {},
    }
    args.deadline_s = -math.inf  # the time budget is spent: the part does not run
    assert gpu._part(report, "llama_1b_shaped.serving", boom, args) is None
    assert report["skipped"] == {"llama_1b_shaped.serving": "--max-seconds 450.0 spent"}
    assert "llama_1b_shaped.serving" not in report["errors"]


def test_sections_runs_only_those_named_and_saves_its_json(
    tmp_path, cache_dir, capsys, monkeypatch
):
    monkeypatch.setenv("WATTSERVE_CACHE", str(cache_dir))
    argv = ["bench", "gpu", "--dry-run-cpu", "--sections", "smollm2_float32"]
    rc = cli_main([*argv, "--out-dir", str(tmp_path)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["ok"], report["errors"]
    assert "smollm2_float32" in report and "power" not in report
    assert "smollm2_bfloat16" not in report and "llama_1b_shaped" not in report
    for name in ("smollm2_bfloat16", "llama_1b_shaped"):
        assert report["skipped"][name] == "not in --sections"
    saved = json.loads(Path(report["doc"]).with_suffix(".json").read_text())
    assert saved["smollm2_float32"] == report["smollm2_float32"]
    assert saved["seconds"] == report["seconds"]


def test_an_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu.build_parser().parse_args(["--sections", "smollm2_float32,smollm2_fp16"])
    assert "unknown section(s) ['smollm2_fp16']" in capsys.readouterr().err
