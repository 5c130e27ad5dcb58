"""`wattserve models check DIR`: what a model directory is and whether it fits, before a start.

Reads config.json and the safetensors headers only (no weights are loaded): the family,
the parameter count, the weight bytes at every quantization level and whether they fit
the device's memory. It runs the same start-up checks as the loader (family, rope type,
window, shards), so a directory it passes is one `serve` will not refuse for those. It
must not load weights, allocate a KV cache or touch a GPU beyond asking its memory size.
"""

from __future__ import annotations

import os
from pathlib import Path

from wattserve.daemon.engine.families import text_config
from wattserve.daemon.engine.loader import (
    LoadError,
    _check_family,
    check_weight_files,
    checked_model_type,
)
from wattserve.daemon.engine.model import model_shape
from wattserve.kernels.quant import LEVEL_NAMES, head_level, linear_nbytes, parse_level


def device_memory_bytes(device: str) -> int:
    """Total memory of the device the engine would run on: the GPU's, or the host's RAM."""
    if device.startswith("cuda"):
        import torch

        _, total = torch.cuda.mem_get_info(torch.device(device))
        return int(total)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_model_dir(path: Path, memory_bytes: int) -> dict:
    """The report of one model directory; raises LoadError naming what is wrong."""
    from transformers import AutoConfig

    model_type = checked_model_type(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise LoadError(
            f"{path / 'config.json'}: cannot read config: {type(e).__name__}: {e}"
        ) from None
    _check_family(config, path)
    if not any(path.glob("*.safetensors")):
        raise LoadError(f"{path}: no weight files (*.safetensors) in the directory")
    check_weight_files(path)
    s = model_shape(config)
    cfg = text_config(config)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    layer_shapes = [
        (qkv_out, s.hidden_size),
        (s.hidden_size, s.num_heads * s.head_dim),
        (2 * s.intermediate_size, s.hidden_size),
        (s.hidden_size, s.intermediate_size),
    ]
    embed = s.vocab_size * s.hidden_size
    params = s.num_layers * sum(o * i for o, i in layer_shapes) + embed * (1 if tied else 2)
    levels = {}
    for name in LEVEL_NAMES:
        spec = parse_level(name)
        linear = s.num_layers * sum(linear_nbytes(o, i, spec) for o, i in layer_shapes)
        head = linear_nbytes(s.vocab_size, s.hidden_size, head_level(spec))
        # The embedding table stays in the model's dtype (bf16 below fp32): 2 or 4 bytes.
        embed_bytes = embed * (4 if name == "fp32" else 2)
        total = linear + head + embed_bytes
        levels[name] = {"weight_bytes": total, "fits": total < memory_bytes}
    return {
        "path": str(path),
        "architecture": model_type,
        "parameters": params,
        "layers": s.num_layers,
        "max_positions": s.max_position_embeddings,
        "device_memory_bytes": memory_bytes,
        "levels": levels,
    }


def format_report(report: dict) -> str:
    lines = [
        f"{report['path']}: {report['architecture']}, {report['parameters'] / 1e9:.2f} B "
        f"parameters, {report['layers']} layers, {report['max_positions']} positions",
        f"device memory {report['device_memory_bytes'] / 2**30:.1f} GiB",
    ]
    for name, lv in report["levels"].items():
        fits = "fits" if lv["fits"] else "does not fit"
        lines.append(f"  {name:10s} {lv['weight_bytes'] / 2**30:8.2f} GiB  {fits}")
    return "\n".join(lines)
