"""Shared fixtures: tiny random-weight models built in the test session, the real model once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.tiny_model import make_tiny_model_dir

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """Converted-weights cache shared by the whole session (and later runs)."""
    path = Path(os.environ.get("WATTSERVE_CACHE") or REPO / ".cache" / "wattserve-test")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: make_tiny_model_dir(root / arch, arch=arch) for arch in ("llama", "qwen2", "mistral")
    }


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs, cache_dir):
    from daemon.engine.loader import load_model

    return load_model(str(tiny_dirs["llama"]), cache_dir)


@pytest.fixture(scope="session")
def real_model(cache_dir):
    from daemon.engine.loader import load_model

    return load_model("embedded", cache_dir)
