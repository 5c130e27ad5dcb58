"""`wattserve bench gpu` on a machine without a GPU: one clear line, non-zero exit, no
model loaded, no NVML call that sets anything. The measuring part needs a GPU machine."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from bench import gpu
from daemon.cli import main as cli_main


def test_without_a_gpu_it_fails_loudly(capsys, monkeypatch):
    monkeypatch.setattr(gpu, "_run", lambda args: pytest.fail("measured without a GPU"))
    rc = cli_main(["bench", "gpu"])
    out, err = capsys.readouterr()
    assert rc == gpu.NO_GPU_EXIT != 0
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
