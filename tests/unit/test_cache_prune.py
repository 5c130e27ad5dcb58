"""The engine's caches (converted weights, C++ kernel builds) are pruned to a size limit:
least recently used first, never an entry in use, a conversion in progress, something
that is not ours, or a kernel build another process holds the lock of."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from wattserve.daemon.engine.cache_prune import cache_entries, prune, prune_engine_caches
from wattserve.kernels.extension import build_lock, build_name

KIB = 1024


def entry(parent: Path, name: str, nbytes: int, last_used_s: float) -> Path:
    path = parent / name
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(b"\0" * nbytes)
    os.utime(path, (last_used_s, last_used_s))
    return path


def caches(tmp_path: Path) -> tuple[Path, Path, dict[str, Path]]:
    cache_dir, kernels = tmp_path / "cache", tmp_path / "torch_extensions"
    converted = cache_dir / "converted"
    paths = {
        "kernels_old": entry(kernels, "wattserve_cpu_kernels_000000000000", 10 * KIB, 1000),
        "model_a": entry(converted, "a-1111", 10 * KIB, 2000),
        "model_b": entry(converted, "b-2222", 10 * KIB, 3000),
        "model_c": entry(converted, "c-3333", 10 * KIB, 4000),
        # never entries: a conversion in progress and another project's extension
        "converting": entry(converted, "d-4444.tmp12345", 10 * KIB, 500),
        "not_ours": entry(kernels, "someone_elses_ext", 10 * KIB, 500),
    }
    return cache_dir, kernels, paths


def test_least_recently_used_go_first_until_the_rest_fit(tmp_path, caplog):
    cache_dir, kernels, p = caches(tmp_path)
    entries = cache_entries(cache_dir, kernels)
    assert sorted(e.path for e in entries) == sorted(
        [p["kernels_old"], p["model_a"], p["model_b"], p["model_c"]]
    )
    assert all(e.nbytes == 10 * KIB for e in entries)
    with caplog.at_level(logging.INFO, logger="wattserve.daemon.engine.cache_prune"):
        removed = prune(entries, 25 * KIB, in_use=[p["model_c"]])
    assert removed == [p["kernels_old"], p["model_a"]]
    assert not p["kernels_old"].exists() and not p["model_a"].exists()
    for kept in ("model_b", "model_c", "converting", "not_ours"):
        assert p[kept].exists(), kept
    assert sum("least recently used" in r.getMessage() for r in caplog.records) == 2


def test_an_entry_in_use_stays_even_alone_over_the_limit(tmp_path, caplog):
    cache_dir, kernels, p = caches(tmp_path)
    os.utime(p["model_a"], (1, 1))  # in use and the oldest of all
    with caplog.at_level(logging.WARNING, logger="wattserve.daemon.engine.cache_prune"):
        removed = prune(cache_entries(cache_dir, kernels), 1 * KIB, in_use=[p["model_a"]])
    assert sorted(removed) == sorted([p["kernels_old"], p["model_b"], p["model_c"]])
    assert p["model_a"].exists()
    assert any("in entries in use" in r.getMessage() for r in caplog.records)


def test_nothing_goes_while_the_caches_fit(tmp_path):
    cache_dir, kernels, _ = caches(tmp_path)
    assert prune(cache_entries(cache_dir, kernels), 40 * KIB, in_use=[]) == []


def test_a_kernel_build_another_process_holds_is_kept(tmp_path):
    cache_dir, kernels, p = caches(tmp_path)
    with build_lock(p["kernels_old"]):  # a build in progress there
        removed = prune(cache_entries(cache_dir, kernels), 25 * KIB, in_use=[p["model_c"]])
    assert p["kernels_old"].exists()
    assert removed == [p["model_a"], p["model_b"]]


def test_the_daemons_prune_keeps_the_loaded_model_and_this_codes_kernel_build(
    tmp_path, monkeypatch
):
    cache_dir, kernels, p = caches(tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(kernels))
    current = entry(kernels, build_name(), 10 * KIB, 100)  # the oldest of all, in use
    removed = prune_engine_caches(cache_dir, 15 * KIB, model_entry=p["model_a"])
    assert current.exists() and p["model_a"].exists()
    assert sorted(removed) == sorted([p["kernels_old"], p["model_b"], p["model_c"]])


def test_loading_from_the_converted_cache_marks_the_entry_used(tmp_path, monkeypatch):
    import torch

    from wattserve.daemon.engine import loader

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    converted = tmp_path / "cache" / "converted" / f"m-{loader._cache_key(gguf)}"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    os.utime(converted, (1000, 1000))
    monkeypatch.setattr(loader, "_load_hf_dir", lambda path, dtype: (object(), object()))
    loaded = loader.load_model(str(gguf), tmp_path / "cache", "float32")
    assert loaded.cache_entry == converted and loaded.dtype == torch.float32
    assert converted.stat().st_mtime > 1000  # the pruner now sees it as just used
