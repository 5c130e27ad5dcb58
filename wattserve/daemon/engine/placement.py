"""Which torch device the engine serves from: `[engine] device` resolved against the GPU
the device layer controls.

"auto" is the CUDA device that *is* the GPU named by `[device] gpu` (matched by UUID, else
PCI bus id, never by index: NVML counts physical GPUs, CUDA counts the ones
CUDA_VISIBLE_DEVICES lets it see, in that variable's order), or the CPU where CUDA sees no
GPU. "cuda" and "cuda:N" are checked against the same GPU: serving from one GPU while NVML
steers another is a start-up error (PlacementError), never silent. With the virtual GPU
there is no real GPU to match, so "auto" takes the first visible CUDA device.
This module reads identities only: it never sets anything on a GPU, and it imports pynvml
(through wattserve.daemon.device.nvml) only when a CUDA device is visible.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The configured engine device cannot be used, or is not the controlled GPU."""


@dataclass(frozen=True)
class GpuIdentity:
    """One GPU as seen by NVML or by CUDA. uuid: 'GPU-…' (any case); pci_bus_id: any of
    NVML's forms ('00000000:65:00.0', '0000:65:00.0') or None when unknown."""

    uuid: str | None
    pci_bus_id: str | None
    name: str = ""


@dataclass(frozen=True)
class Placement:
    """The resolved engine device and, on CUDA, the GPU behind it."""

    device: torch.device
    gpu: GpuIdentity | None = None  # None on the CPU
    why: str = ""  # one line for the start-up log

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def normalize_uuid(uuid: str | None) -> str | None:
    if not uuid:
        return None
    text = str(uuid).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def normalize_pci_bus_id(bus_id: str | None) -> str | None:
    """'00000000:65:00.0' / '0000:65:00.0' / '65:00.0' -> '0000:65:00.0' (lower case)."""
    if not bus_id:
        return None
    text = str(bus_id).strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        return text
    domain, bus, devfn = parts
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{devfn}"


def same_gpu(a: GpuIdentity, b: GpuIdentity) -> bool:
    ua, ub = normalize_uuid(a.uuid), normalize_uuid(b.uuid)
    if ua and ub:
        return ua == ub
    pa, pb = normalize_pci_bus_id(a.pci_bus_id), normalize_pci_bus_id(b.pci_bus_id)
    return bool(pa and pb and pa == pb)


def cuda_visible_gpus() -> list[GpuIdentity]:
    """The CUDA devices this process sees, in CUDA ordinal order (CUDA_VISIBLE_DEVICES
    already applied by the driver)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = getattr(p, "uuid", None)
        bus = None
        if hasattr(p, "pci_bus_id"):
            bus = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        out.append(GpuIdentity(str(uuid) if uuid is not None else None, bus, p.name))
    return out


def nvml_gpu(selector: str) -> GpuIdentity | None:
    """The GPU `[device] gpu` names, through NVML (read-only); None when NVML is absent."""
    from wattserve.daemon.device.nvml import parse_gpu_selector
    from wattserve.daemon.device.protocol import NvmlUnavailableError

    try:
        from wattserve.daemon.device.nvml import import_pynvml

        nv = import_pynvml()
        nv.nvmlInit()
    except NvmlUnavailableError:
        return None
    except Exception as e:  # pynvml.NVMLError: no driver loaded
        log.info("placement: NVML unavailable (%s)", e)
        return None
    try:
        kind, key = parse_gpu_selector(selector)
        if kind == "index":
            h = nv.nvmlDeviceGetHandleByIndex(key)
        elif kind == "uuid":
            h = nv.nvmlDeviceGetHandleByUUID(key)
        else:
            h = nv.nvmlDeviceGetHandleByPciBusId(key)
        dec = _text
        return GpuIdentity(
            dec(nv.nvmlDeviceGetUUID(h)),
            dec(nv.nvmlDeviceGetPciInfo(h).busId),
            dec(nv.nvmlDeviceGetName(h)),
        )
    except nv.NVMLError as e:
        raise PlacementError(f"device.gpu {selector!r}: NVML cannot find it: {e}") from None
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a read-only session
            pass


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def resolve_placement(
    setting: str,
    gpu_selector: str,
    device_backend: str,
    *,
    cuda_gpus: Callable[[], Sequence[GpuIdentity]] = cuda_visible_gpus,
    controlled_gpu: Callable[[str], GpuIdentity | None] = nvml_gpu,
    environ: Mapping[str, str] | None = None,
) -> Placement:
    """Resolve `[engine] device` ("auto", "cpu", "cuda", "cuda:N") to a Placement.

    device_backend: `[device] backend` ("auto", "nvml", "virtual"): with "virtual" no real
    GPU is controlled, so there is nothing to match. cuda_gpus and controlled_gpu are the
    probes (fakes in tests). Raises PlacementError naming the key.
    """
    env = os.environ if environ is None else environ
    visible_note = (
        f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r})"
        if "CUDA_VISIBLE_DEVICES" in env
        else ""
    )
    if setting == "cpu":
        return Placement(torch.device("cpu"), None, "engine.device = cpu")
    gpus = list(cuda_gpus())
    if not gpus:
        if setting == "auto":
            return Placement(torch.device("cpu"), None, "engine.device = auto: no CUDA device")
        raise PlacementError(f"engine.device = {setting!r}: CUDA sees no GPU{visible_note}")
    ordinal: int | None = None
    if setting.startswith("cuda"):
        ordinal = int(setting.split(":", 1)[1]) if ":" in setting else None
        if ordinal is not None and not 0 <= ordinal < len(gpus):
            raise PlacementError(
                f"engine.device = {setting!r}: CUDA sees {len(gpus)} GPU(s){visible_note}"
            )
    elif setting != "auto":
        raise PlacementError(f"engine.device = {setting!r}: expected auto, cpu, cuda or cuda:N")
    controlled = None if device_backend == "virtual" else controlled_gpu(gpu_selector)
    if controlled is None:
        # Nothing real is steered (virtual GPU, or NVML absent: the device layer falls
        # back to the virtual GPU or fails on its own).
        n = ordinal or 0
        return Placement(
            torch.device("cuda", n), gpus[n], f"engine.device = {setting}: cuda:{n}, no NVML GPU"
        )
    matches = [i for i, g in enumerate(gpus) if same_gpu(g, controlled)]
    label = f"{controlled.name or 'GPU'} {controlled.uuid} (bus {controlled.pci_bus_id})"
    if not matches:
        raise PlacementError(
            f"engine.device = {setting!r}: the controlled GPU device.gpu = {gpu_selector!r}, "
            f"{label}, is not among the {len(gpus)} CUDA device(s) this process sees"
            f"{visible_note}"
        )
    if ordinal is not None and ordinal != matches[0]:
        raise PlacementError(
            f"engine.device = {setting!r} is {gpus[ordinal].uuid} but device.gpu = "
            f"{gpu_selector!r} controls {label} (cuda:{matches[0]}{visible_note}): the served "
            "and the controlled GPU must be the same"
        )
    n = matches[0]
    return Placement(
        torch.device("cuda", n), gpus[n], f"engine.device = {setting}: cuda:{n} is {label}"
    )


def check_controlled(placement: Placement, controlled: GpuIdentity, is_virtual: bool) -> None:
    """After the device layer opened its GPU: it must be the one the engine serves from.
    A CPU engine and the virtual GPU match anything. Raises PlacementError."""
    if not placement.is_cuda or is_virtual or placement.gpu is None:
        return
    if not same_gpu(placement.gpu, controlled):
        raise PlacementError(
            f"the engine serves from {placement.device} ({placement.gpu.uuid}) but the device "
            f"layer controls {controlled.uuid} (bus {controlled.pci_bus_id})"
        )
