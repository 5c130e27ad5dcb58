"""Keeps the engine's on-disk caches under one size limit (`engine.cache_max_bytes`).

Two caches grow on a machine as models and the project change: converted weights (each
directory under `<cache_dir>/converted`, one per GGUF file and version) and builds of the
C++ CPU kernels (each `wattserve_cpu_kernels_*` directory under torch's extension root,
one per source, compiler-flag, torch and CPU combination). An entry's last use is its
directory's modification time, which the loader and the kernel build touch on every use.
While the entries together exceed the limit, the least recently used is removed first;
never an entry in use, a conversion still in progress (`*.tmp<pid>`, leftovers.py's), or
a kernel build whose build lock another process holds. It must not decide what is cached
or where; it never follows a symlink, and a failure to remove one entry is logged and
the others still go.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from wattserve.kernels.extension import BUILD_PREFIX, build_lock, build_name, build_root

log = logging.getLogger(__name__)

_CONVERTED = "converted"
_TMP_MARK = ".tmp"  # a conversion in progress: <entry>.tmp<pid>


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    nbytes: int
    last_used_s: float  # the directory's mtime (unix seconds)
    kernel_build: bool = False  # removed only under its build lock


def tree_nbytes(path: Path) -> int:
    """Bytes of the files under path (links counted as themselves, never followed)."""
    total = 0
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in files + dirs:
            with contextlib.suppress(OSError):  # gone meanwhile
                st = os.lstat(os.path.join(root, name))
                if not stat.S_ISDIR(st.st_mode):
                    total += st.st_size
    return total


def _entries(directory: Path, wanted: Iterable[str] | None, kernel_build: bool) -> list[CacheEntry]:
    try:
        paths = sorted(directory.iterdir())
    except OSError:
        return []  # no cache there yet
    out: list[CacheEntry] = []
    for path in paths:
        if wanted is not None and not any(path.name.startswith(p) for p in wanted):
            continue
        if _TMP_MARK in path.name:
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            out.append(CacheEntry(path, tree_nbytes(path), st.st_mtime, kernel_build))
    return out


def cache_entries(cache_dir: Path, kernel_root: Path | None) -> list[CacheEntry]:
    """The converted-weights entries under cache_dir and the kernel builds under
    kernel_root (None: none looked at)."""
    entries = _entries(cache_dir / _CONVERTED, None, kernel_build=False)
    if kernel_root is not None:
        entries += _entries(kernel_root, (BUILD_PREFIX,), kernel_build=True)
    return entries


def prune(entries: list[CacheEntry], max_bytes: int, in_use: Iterable[Path]) -> list[Path]:
    """Remove least recently used entries until the rest fit max_bytes; returns what was
    removed. Entries in use are kept (and counted) whatever their size."""
    keep = {Path(p).resolve() for p in in_use}
    total = sum(e.nbytes for e in entries)
    removed: list[Path] = []
    for entry in sorted(entries, key=lambda e: e.last_used_s):
        if total <= max_bytes:
            break
        if entry.path.resolve() in keep:
            continue
        if _remove(entry):
            total -= entry.nbytes
            removed.append(entry.path)
    if total > max_bytes:
        log.warning(
            "caches hold %.1f MiB, over engine.cache_max_bytes (%.1f MiB), in entries in use",
            total / 2**20,
            max_bytes / 2**20,
        )
    return removed


def _remove(entry: CacheEntry) -> bool:
    with _claimed(entry) as claimed:
        if not claimed:
            log.info("cache: keeping %s: another process is building it", entry.path)
            return False
        try:
            shutil.rmtree(entry.path)
        except OSError as e:
            log.warning("cache: cannot remove %s: %s", entry.path, e)
            return False
    log.info(
        "cache: removed %s (%.1f MiB, least recently used) to stay under engine.cache_max_bytes",
        entry.path,
        entry.nbytes / 2**20,
    )
    return True


@contextlib.contextmanager
def _claimed(entry: CacheEntry) -> Iterator[bool]:
    """Whether entry may go now: a kernel build only while we hold its build lock."""
    if not entry.kernel_build:
        yield True
        return
    with contextlib.ExitStack() as stack:
        try:
            held = stack.enter_context(build_lock(entry.path, wait=False))
        except OSError:  # its lock file cannot be opened (read-only, gone): leave it be
            held = False
        yield held


def prune_engine_caches(
    cache_dir: Path, max_bytes: int, model_entry: Path | None = None
) -> list[Path]:
    """Prune the converted weights under cache_dir and the kernel builds to max_bytes,
    keeping the loaded model's entry (model_entry) and this code's kernel build."""
    root = build_root()
    in_use = [root / build_name(), *([model_entry] if model_entry is not None else [])]
    return prune(cache_entries(cache_dir, root), max_bytes, in_use)
