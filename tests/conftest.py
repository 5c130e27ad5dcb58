"""Shared fixtures: tiny random-weight models built in the test session, the real model once,
private Mosquitto brokers on random loopback ports (tests/mqtt_broker.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.mqtt_broker import ACL_EXAMPLE, USERS, Broker
from tests.tiny_model import make_tiny_model_dir

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture
def clean_wattserve_env(monkeypatch) -> None:
    """No WATTSERVE_* variable from the caller's environment reaches the test's config."""
    for name in list(os.environ):
        if name.startswith("WATTSERVE_"):
            monkeypatch.delenv(name)


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
    from wattserve.daemon.engine.loader import load_model

    return load_model(str(tiny_dirs["llama"]), cache_dir)


@pytest.fixture(scope="session")
def real_model(cache_dir):
    from wattserve.daemon.engine.loader import load_model

    return load_model("embedded", cache_dir)


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    """An anonymous broker shared by a test module (tests use their own node ids)."""
    b = Broker(tmp_path_factory.mktemp("mosquitto"))
    b.start()
    yield b
    b.stop()


@pytest.fixture
def own_broker(tmp_path) -> Iterator[Broker]:
    """A broker of the test's own, not yet started, for tests that kill and restart it."""
    b = Broker(tmp_path)
    yield b
    b.stop()


@pytest.fixture(scope="module")
def auth_broker(tmp_path_factory) -> Iterator[Broker]:
    """Password auth (USERS) plus the ACL docs/mqtt.md documents."""
    b = Broker(tmp_path_factory.mktemp("mosquitto-auth"), users=USERS, acl=ACL_EXAMPLE.read_text())
    b.start()
    yield b
    b.stop()
