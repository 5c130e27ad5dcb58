"""The benchmark commands (`wattserve bench ...`): each prints one JSON line last.

They write plots, tables and reports under an output directory, by default one per bench
under the cache (`output_dir`), never into the source tree unless a flag names it there.
"""

from __future__ import annotations

from pathlib import Path


def output_dir(bench: str) -> Path:
    """Where `bench` writes its files when no flag says: <cache>/bench/<bench>/."""
    from wattserve.daemon.config import default_cache_dir

    return default_cache_dir() / "bench" / bench
