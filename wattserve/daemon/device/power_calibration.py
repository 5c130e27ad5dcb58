"""A GPU's power calibrated from measured loads, for the virtual GPU to reproduce.

`wattserve bench gpu` measures NVML power at a few loads (idle with a CUDA context, bs1
decode, batched decode, ...) and what the engine did in each window; `fit_power_calibration`
turns those points into four numbers at the clock they ran at:

    power_w = idle_w + active_w * busy + memory_w * memory_util + compute_w * compute_util

busy: the share of the window the engine spent inside steps; memory_util / compute_util:
the bytes read and FLOPs done over the window against the GPU's peak bandwidth and FLOP/s
(what the step *achieved*, not what the hardware could). The virtual GPU loads the file
(`[device] virtual_power_calibration`) and prices its steps with it, scaling the
clock-dependent terms with its own voltage-frequency curve. This module is pure: no torch,
no NVML, no clock; it must not decide anything about a device it has not been given.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = 1
# The clock-dependent parts of a calibration scale with f * V(f)^2 off the measured clock;
# a calibration is refused where a slope is negative (a fit that says more work costs less).
_SLOPES = ("active_w", "memory_w", "compute_w")


class PowerCalibrationError(ValueError):
    """A calibration file or its points that cannot be used; the message names the field."""


@dataclass(frozen=True)
class LoadPoint:
    """One measured load: NVML's mean power over a window and what the engine did in it."""

    label: str
    power_w: float
    busy_fraction: float  # share of the window inside engine steps, 0..1
    memory_utilization: float  # bytes read / (window_s * peak bytes/s)
    compute_utilization: float  # FLOPs / (window_s * peak FLOP/s)
    sm_clock_mhz: float
    gpu_temp_c: float | None = None

    def __post_init__(self) -> None:
        for name in ("power_w", "sm_clock_mhz"):
            _check(f"points[{self.label}].{name}", getattr(self, name), lo=0.0, open_lo=True)
        for name in ("busy_fraction", "memory_utilization", "compute_utilization"):
            _check(f"points[{self.label}].{name}", getattr(self, name), lo=0.0, hi=1.0)


@dataclass(frozen=True)
class PowerCalibration:
    """Power at the clock it was measured at; see the module docstring for the formula."""

    gpu_name: str
    sm_clock_mhz: float
    idle_w: float
    active_w: float
    memory_w: float
    compute_w: float
    idle_temp_c: float | None = None
    source: str = ""
    points: tuple[LoadPoint, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _check("sm_clock_mhz", self.sm_clock_mhz, lo=0.0, open_lo=True)
        _check("idle_w", self.idle_w, lo=0.0, open_lo=True)
        for name in _SLOPES:
            _check(name, getattr(self, name), lo=0.0)

    def predict_w(self, busy: float, memory_util: float, compute_util: float) -> float:
        """Mean power over a window at the calibrated clock and temperature."""
        return (
            self.idle_w
            + self.active_w * busy
            + self.memory_w * memory_util
            + self.compute_w * compute_util
        )

    def to_json(self) -> str:
        body = asdict(self)
        body["schema"] = SCHEMA
        return json.dumps(body, indent=2)

    @staticmethod
    def from_json(text: str, where: str = "power calibration") -> PowerCalibration:
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise PowerCalibrationError(f"{where}: not JSON ({e})") from None
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
            raise PowerCalibrationError(f"{where}: schema must be {SCHEMA}")
        try:
            points = tuple(LoadPoint(**p) for p in raw.get("points", []))
            fields = {k: v for k, v in raw.items() if k not in ("schema", "points")}
            return PowerCalibration(**fields, points=points)
        except TypeError as e:
            raise PowerCalibrationError(f"{where}: {e}") from None
        except PowerCalibrationError as e:
            raise PowerCalibrationError(f"{where}: {e}") from None

    @staticmethod
    def load(path: Path) -> PowerCalibration:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PowerCalibrationError(f"{path}: {e.strerror or e}") from None
        return PowerCalibration.from_json(text, str(path))


def fit_power_calibration(
    points: list[LoadPoint],
    *,
    gpu_name: str,
    prior_memory_w: float,
    prior_compute_w: float,
    source: str = "",
) -> PowerCalibration:
    """Least squares over the loaded points, idle from the unloaded ones.

    idle_w is the mean of the points with busy_fraction 0 (at least one is needed). With
    four or more loaded points every slope is fitted (non-negative: the best of the
    least-squares fits over each subset of slopes held at zero); with fewer, memory_w and
    compute_w stay at the priors (the virtual GPU profile's) and active_w alone is fitted,
    since two or three points cannot tell three slopes apart. The clock is the points' mean.
    """
    idle = [p for p in points if p.busy_fraction == 0]
    loaded = [p for p in points if p.busy_fraction > 0]
    if not idle:
        raise PowerCalibrationError("points: need one idle point (busy_fraction 0)")
    if not loaded:
        raise PowerCalibrationError("points: need at least one loaded point")
    idle_w = sum(p.power_w for p in idle) / len(idle)
    temps = [p.gpu_temp_c for p in idle if p.gpu_temp_c is not None]
    features = [(p.busy_fraction, p.memory_utilization, p.compute_utilization) for p in loaded]
    targets = [p.power_w - idle_w for p in loaded]
    if len(loaded) >= 4:
        slopes = _nonnegative_least_squares(features, targets)
    else:
        rest = [
            t - prior_memory_w * m - prior_compute_w * c
            for t, (_, m, c) in zip(targets, features, strict=True)
        ]
        busy = [b for b, _, _ in features]
        active = max(0.0, sum(b * r for b, r in zip(busy, rest, strict=True)) / _dot(busy, busy))
        slopes = (active, prior_memory_w, prior_compute_w)
    return PowerCalibration(
        gpu_name=gpu_name,
        sm_clock_mhz=sum(p.sm_clock_mhz for p in points) / len(points),
        idle_w=idle_w,
        active_w=slopes[0],
        memory_w=slopes[1],
        compute_w=slopes[2],
        idle_temp_c=sum(temps) / len(temps) if temps else None,
        source=source,
        points=tuple(points),
    )


def _nonnegative_least_squares(
    x: list[tuple[float, float, float]], y: list[float]
) -> tuple[float, float, float]:
    """min ||X b - y|| over b >= 0 for three columns: every subset of free columns is solved
    by its normal equations and the feasible fit with the least residual wins."""
    best: tuple[float, tuple[float, float, float]] | None = None
    for k in range(1, 4):
        for cols in itertools.combinations(range(3), k):
            sub = [[row[c] for c in cols] for row in x]
            coef = _solve_normal(sub, y)
            if coef is None or any(c < 0 for c in coef):
                continue
            full = [0.0, 0.0, 0.0]
            for c, v in zip(cols, coef, strict=True):
                full[c] = v
            resid = sum((_dot(row, full) - t) ** 2 for row, t in zip(x, y, strict=True))
            if best is None or resid < best[0]:
                best = (resid, (full[0], full[1], full[2]))
    if best is None:
        return (0.0, 0.0, 0.0)
    return best[1]


def _solve_normal(x: list[list[float]], y: list[float]) -> list[float] | None:
    """(X^T X) b = X^T y by Gaussian elimination; None when singular."""
    n = len(x[0])
    a = [[sum(r[i] * r[j] for r in x) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * t for r, t in zip(x, y, strict=True)) for i in range(n)]
    for i in range(n):
        pivot = max(range(i, n), key=lambda r: abs(a[r][i]))
        if abs(a[pivot][i]) < 1e-12:
            return None
        a[i], a[pivot], b[i], b[pivot] = a[pivot], a[i], b[pivot], b[i]
        for r in range(i + 1, n):
            f = a[r][i] / a[i][i]
            a[r] = [u - f * v for u, v in zip(a[r], a[i], strict=True)]
            b[r] -= f * b[i]
    out = [0.0] * n
    for i in reversed(range(n)):
        out[i] = (b[i] - sum(a[i][j] * out[j] for j in range(i + 1, n))) / a[i][i]
    return out


def _dot(a, b) -> float:
    return sum(u * v for u, v in zip(a, b, strict=True))


def _check(
    name: str,
    value: float,
    lo: float | None = None,
    hi: float | None = None,
    open_lo: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PowerCalibrationError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value < lo or (open_lo and value == lo)):
        raise PowerCalibrationError(f"{name} must be {'>' if open_lo else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise PowerCalibrationError(f"{name} must be <= {hi}, got {value}")
