"""Calibration of the engine model: per quantization level, a linear fit of the real
engine's step time on this CPU, the measured rows it came from, and its cache file.

Measuring the real engine is the bench's job (`wattserve/bench/control_real.py: calibrate`); this
module only holds, fits, saves and loads the figures. It must not import torch or bench.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class LevelFit:
    """Step time of one level on this CPU: t = base + per-token costs, plus noise."""

    base_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float
    noise_cv: float
    weight_bytes: int
    prepare_s: float
    samples: int
    ppl_increase_pct: float | None = None
    steps: tuple = ()  # the measured (prefill, decode, context, seconds) rows, for refits

    def step_s(self, prefill: int, decode: int, context: int) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill
            + self.per_decode_token_s * decode
            + self.per_context_token_s * context
        )


@dataclass(frozen=True)
class Calibration:
    model: str
    dtype: str
    threads: int
    full_precision: str
    shape: dict
    kv_bytes_per_token: int
    block_size_tokens: int
    levels: dict[str, LevelFit]
    measured_at: str

    def to_json(self) -> str:
        d = asdict(self)
        d["version"] = CALIBRATION_VERSION
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration | None:
        d = json.loads(text)
        if d.pop("version", None) != CALIBRATION_VERSION:
            return None
        d["levels"] = {k: LevelFit(**v) for k, v in d["levels"].items()}
        return cls(**d)


def calibration_path(cache_dir: Path, model: str, dtype: str, threads: int) -> Path:
    return Path(cache_dir) / "control" / f"engine-{model}-{dtype}-t{threads}.json"


def fit_steps(rows: list[list[float]]) -> tuple[list[float], float, int]:
    """t = base + a * prefill + b * decode tokens, least squares on *relative* error (a 10 ms
    step counts as much as a 1 s one) with non-negative coefficients, refitted without the
    steps that ran over 1.5x the fit (a neighbour on the shared CPU, not the engine). The
    attention's context cost is folded into the per-decode-token cost: on this model it is
    small, and its column is too collinear with the decode count to separate from noisy
    timings. Returns (base, per prefill, per decode, per context = 0), cv, steps kept."""
    import numpy as np

    x = np.array([[1.0, p, d] for p, d, _, _ in rows])
    y = np.array([t for *_, t in rows])
    keep = np.ones(len(rows), dtype=bool)
    scale = y.copy()
    coef = np.zeros(3)
    for _ in range(8):
        xs, ys = x[keep] / scale[keep, None], y[keep] / scale[keep]
        cols = list(range(3))
        while True:
            sol, *_ = np.linalg.lstsq(xs[:, cols], ys, rcond=None)
            neg = [cols[i] for i, v in enumerate(sol) if v < 0]
            if not neg:
                break
            cols = [c for c in cols if c not in neg]
        coef = np.zeros(3)
        coef[cols] = sol
        pred = np.maximum(x @ coef, 1e-6)
        new_keep = y <= pred * 1.5
        if (new_keep == keep).all() and np.allclose(scale, pred):
            break
        keep, scale = new_keep, pred
    pred = np.maximum(x[keep] @ coef, 1e-9)
    cv = float(np.std(y[keep] / pred - 1.0))
    return [float(v) for v in coef] + [0.0], cv, int(keep.sum())


def refit(cal: Calibration) -> Calibration:
    """The same measurements fitted again (after a change to fit_steps)."""
    import dataclasses

    levels = {}
    for name, lv in cal.levels.items():
        coef, cv, kept = fit_steps([list(r) for r in lv.steps])
        levels[name] = dataclasses.replace(
            lv,
            base_s=coef[0],
            per_prefill_token_s=coef[1],
            per_decode_token_s=coef[2],
            per_context_token_s=coef[3],
            noise_cv=cv,
            samples=kept,
        )
    return dataclasses.replace(cal, levels=levels)
