"""engine.device resolution against the controlled GPU, with a fake NVML and fake CUDA lists.

The fake CUDA list applies CUDA_VISIBLE_DEVICES the way the driver does (indices or UUIDs,
in the variable's order), so these tests hold the rule that matters: NVML indices are
physical, CUDA ordinals are not, and only UUID / PCI bus id tie them together.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from wattserve.daemon.config import ConfigError, load_config
from wattserve.daemon.engine.placement import (
    GpuIdentity,
    Placement,
    PlacementError,
    check_controlled,
    normalize_pci_bus_id,
    nvml_gpu,
    resolve_placement,
)

# Three physical GPUs as NVML lists them (index order).
PHYSICAL = [
    GpuIdentity("GPU-aaaaaaaa-0000-0000-0000-000000000000", "00000000:19:00.0", "H200"),
    GpuIdentity("GPU-bbbbbbbb-0000-0000-0000-000000000000", "00000000:3B:00.0", "H200"),
    GpuIdentity("GPU-cccccccc-0000-0000-0000-000000000000", "00000000:4C:00.0", "H200"),
]


def fake_cuda(env: dict[str, str]):
    """What torch.cuda would list under env's CUDA_VISIBLE_DEVICES: torch reports the uuid
    without 'GPU-' and the bus id from its domain/bus/device numbers."""

    def probe() -> list[GpuIdentity]:
        spec = env.get("CUDA_VISIBLE_DEVICES")
        chosen = PHYSICAL
        if spec is not None:
            chosen = []
            for item in filter(None, spec.split(",")):
                if item.isdigit():
                    chosen.append(PHYSICAL[int(item)])
                else:
                    chosen.extend(g for g in PHYSICAL if g.uuid == item)
        return [
            GpuIdentity(g.uuid[4:], normalize_pci_bus_id(g.pci_bus_id).lower(), g.name)
            for g in chosen
        ]

    return probe


def nvml_by_selector(selector: str) -> GpuIdentity:
    if selector.isdigit():
        return PHYSICAL[int(selector)]
    return next(g for g in PHYSICAL if g.uuid == selector)


def resolve(setting, gpu="0", backend="nvml", env=None):
    env = {} if env is None else env
    return resolve_placement(
        setting, gpu, backend, cuda_gpus=fake_cuda(env), controlled_gpu=nvml_by_selector,
        environ=env,
    )


def test_auto_picks_the_controlled_gpu():
    p = resolve("auto", gpu="1")
    assert p.device == torch.device("cuda", 1) and p.is_cuda
    assert p.gpu.uuid == PHYSICAL[1].uuid[4:]


def test_auto_follows_cuda_visible_devices_reordering():
    # CUDA ordinal 0 is physical GPU 2: the index in device.gpu is NVML's, not CUDA's.
    env = {"CUDA_VISIBLE_DEVICES": "2,1"}
    assert resolve("auto", gpu="1", env=env).device == torch.device("cuda", 1)
    assert resolve("auto", gpu="2", env=env).device == torch.device("cuda", 0)
    env_uuid = {"CUDA_VISIBLE_DEVICES": f"{PHYSICAL[2].uuid},{PHYSICAL[0].uuid}"}
    assert resolve("auto", gpu=PHYSICAL[0].uuid, env=env_uuid).device == torch.device("cuda", 1)


def test_controlled_gpu_hidden_from_cuda_is_an_error():
    with pytest.raises(PlacementError, match="CUDA_VISIBLE_DEVICES='0'"):
        resolve("auto", gpu="1", env={"CUDA_VISIBLE_DEVICES": "0"})


def test_explicit_cuda_device_must_be_the_controlled_one():
    assert resolve("cuda:1", gpu="1").device == torch.device("cuda", 1)
    assert resolve("cuda", gpu="2").device == torch.device("cuda", 2)
    with pytest.raises(PlacementError, match="must be the same"):
        resolve("cuda:1", gpu="1", env={"CUDA_VISIBLE_DEVICES": "1,0"})
    with pytest.raises(PlacementError, match="sees 2 GPU"):
        resolve("cuda:2", gpu="0", env={"CUDA_VISIBLE_DEVICES": "0,1"})


def test_pci_bus_id_matches_when_uuids_are_missing():
    def cuda_without_uuid():
        return [GpuIdentity(None, "0000:3b:00.0"), GpuIdentity(None, "0000:19:00.0")]

    p = resolve_placement(
        "auto", "0", "nvml", cuda_gpus=cuda_without_uuid, controlled_gpu=nvml_by_selector,
        environ={},
    )
    assert p.device == torch.device("cuda", 1)


def test_cpu_where_cuda_sees_nothing():
    none = lambda: []  # noqa: E731
    p = resolve_placement("auto", "0", "nvml", cuda_gpus=none, controlled_gpu=nvml_by_selector)
    assert p.device == torch.device("cpu") and p.gpu is None
    with pytest.raises(PlacementError, match="CUDA sees no GPU"):
        resolve_placement("cuda", "0", "nvml", cuda_gpus=none, controlled_gpu=nvml_by_selector)
    assert resolve("cpu").device == torch.device("cpu")


def test_virtual_backend_matches_nothing_and_takes_the_first_cuda_device():
    asked = []

    def controlled(sel):
        asked.append(sel)
        return PHYSICAL[2]

    p = resolve_placement(
        "auto", "2", "virtual", cuda_gpus=fake_cuda({}), controlled_gpu=controlled, environ={}
    )
    assert p.device == torch.device("cuda", 0) and asked == []


def test_check_controlled_after_the_device_opened():
    p = resolve("auto", gpu="1")
    check_controlled(p, PHYSICAL[1], is_virtual=False)
    check_controlled(p, PHYSICAL[0], is_virtual=True)
    check_controlled(Placement(torch.device("cpu")), PHYSICAL[0], is_virtual=False)
    with pytest.raises(PlacementError, match="device layer controls"):
        check_controlled(p, PHYSICAL[0], is_virtual=False)


def test_nvml_probe_reads_identity_only(monkeypatch):
    calls = []

    class NVMLError(Exception):
        pass

    def rec(name, value=None):
        def f(*a):
            calls.append(name)
            return value

        return f

    pci = types.SimpleNamespace(busId=b"00000000:3B:00.0")
    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=rec("init"),
        nvmlShutdown=rec("shutdown"),
        nvmlDeviceGetHandleByIndex=rec("by_index", "h"),
        nvmlDeviceGetUUID=rec("uuid", b"GPU-bbbbbbbb-0000-0000-0000-000000000000"),
        nvmlDeviceGetPciInfo=rec("pci", pci),
        nvmlDeviceGetName=rec("name", b"NVIDIA H200"),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    g = nvml_gpu("1")
    assert g == GpuIdentity(PHYSICAL[1].uuid, "00000000:3B:00.0", "NVIDIA H200")
    assert calls[0] == "init" and calls[-1] == "shutdown"
    assert not any(c.startswith("set") or "reset" in c for c in calls)


def test_config_device_key(monkeypatch):
    for name in ("WATTSERVE_ENGINE__DEVICE",):
        monkeypatch.delenv(name, raising=False)
    assert load_config(None, {"engine": {"device": "cuda:3"}}).engine.device == "cuda:3"
    assert load_config(None).engine.device == "auto"
    with pytest.raises(ConfigError, match="engine.device"):
        load_config(None, {"engine": {"device": "gpu0"}})
