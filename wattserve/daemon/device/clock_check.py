"""Whether an SM clock lock is the one the GPU enforces, judged from the clocks NVML reads.

NVML cannot read a locked-clock range back, so a lock this daemon set and someone else
reset (`nvidia-smi -rgc`) or replaced looks unchanged to it. What the GPU does shows it:
while it is busy its SM clock sits inside the lock, or below it only when a power or
thermal cap (a clock-event reason) holds it down. An idle GPU's clock sits low whatever
the lock, so an idle reading says nothing. A contradiction counts only once it has
lasted `confirm_s` of readings, so a clock still settling after a write is not drift.
This module only judges readings: it must not call NVML or change a setting (nvml.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

from wattserve.daemon.device.protocol import (
    REASON_GPU_IDLE,
    REASON_HW_POWER_BRAKE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
)

# NVML's utilization is the share of its sample period with a kernel running; below
# this the clock may be coming down from or going up to the locked one.
BUSY_UTIL_PCT = 50.0
# The reported clock may sit a ladder step (15 MHz on current data-center parts) off the
# requested one.
CLOCK_TOLERANCE_MHZ = 30
# Reasons that legitimately hold a locked clock below its lower end.
_HELD_DOWN = (
    REASON_SW_POWER_CAP
    | REASON_HW_SLOWDOWN
    | REASON_SW_THERMAL
    | REASON_HW_THERMAL
    | REASON_HW_POWER_BRAKE
)


@dataclass(frozen=True)
class LockCheck:
    """One reading's verdict: enforced True / False, or None when it cannot tell."""

    enforced: bool | None
    why: str = ""


def check_lock(
    lock_mhz: tuple[int, int] | None,
    sm_clock_mhz: int | None,
    gpu_util_pct: float | None,
    reasons_mask: int | None,
    app_clock_mhz: int | None = None,
) -> LockCheck:
    """Whether one reading of the GPU agrees with `lock_mhz` being in force."""
    if lock_mhz is None or sm_clock_mhz is None or gpu_util_pct is None:
        return LockCheck(None)
    if gpu_util_pct < BUSY_UTIL_PCT or (reasons_mask or 0) & REASON_GPU_IDLE:
        return LockCheck(None)
    lo, hi = lock_mhz
    app = f"; application clock {app_clock_mhz} MHz" if app_clock_mhz is not None else ""
    if sm_clock_mhz > hi + CLOCK_TOLERANCE_MHZ:  # nothing lets a clock exceed its lock
        return LockCheck(
            False, f"busy at {sm_clock_mhz} MHz, above the locked {lo}-{hi} MHz{app}"
        )
    if sm_clock_mhz < lo - CLOCK_TOLERANCE_MHZ:
        if reasons_mask is None or reasons_mask & _HELD_DOWN:
            return LockCheck(None)  # a cap may hold it down (or the reasons are unknown)
        return LockCheck(
            False,
            f"busy at {sm_clock_mhz} MHz, below the locked {lo}-{hi} MHz with no power or "
            f"thermal cap{app}",
        )
    return LockCheck(True)


class LockWatch:
    """Confirms a contradiction that lasts: `observe` says True once readings have
    contradicted the lock for confirm_s with no agreeing busy reading between."""

    def __init__(self, confirm_s: float = 1.0) -> None:
        self._confirm_s = confirm_s
        self._since_s: float | None = None

    def reset(self) -> None:
        """Forget what was seen (a new lock was written)."""
        self._since_s = None

    def observe(self, now_s: float, check: LockCheck) -> bool:
        if check.enforced is None:
            return False  # an idle or capped reading neither confirms nor clears
        if check.enforced:
            self._since_s = None
            return False
        if self._since_s is None:
            self._since_s = now_s
        return now_s - self._since_s >= self._confirm_s
