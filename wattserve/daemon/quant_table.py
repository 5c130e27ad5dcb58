"""The quantization quality table on disk: where it lives, how it is saved and read.

`wattserve bench quant` measures each weight quantization level of a model (perplexity
increase, decode and prefill speed) and saves the table here; the daemon reads it at
start and hands it to the control loop, whose `max_ppl_increase_pct` allows levels by
it and whose trials it orders. This module only stores and reads the table and applies
the quality limit to it; it must not measure anything, import torch or know the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

QUALITY_TABLE_VERSION = 1


def quality_table_path(cache_dir: Path, model_name: str) -> Path:
    """Where the table of `model_name` lives inside the cache directory."""
    return Path(cache_dir) / "quant" / f"{model_name}-quality.json"


def save_quality_table(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a table


def load_quality_table(path: Path) -> dict | None:
    """The saved table, or None when there is none (or it is of another version)."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(table, dict) or table.get("version") != QUALITY_TABLE_VERSION:
        return None
    return table


def levels_within_ppl_increase(table: dict, max_ppl_increase_pct: float) -> list[str]:
    """Levels whose measured perplexity increase over full precision is at most
    `max_ppl_increase_pct`, in table order. The full-precision level always qualifies;
    a level without a measurement does not (its quality cost is unknown)."""
    # The controller's rule, over the table read as the control loop reads it.
    from wattserve.controller.policy import allowed_quant_levels
    from wattserve.daemon.control_loop import quant_options

    options = quant_options(tuple(table.get("levels", {})), table)
    full_precision = table.get("full_precision", "")
    return list(allowed_quant_levels(options, full_precision, max_ppl_increase_pct))
