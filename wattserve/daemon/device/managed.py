"""ManagedDevice: the `Device` the daemon uses, wrapping one backend (NVML or virtual).

It owns what must be the same for every backend: clamping and snapping setter targets,
idempotence, the actuation gate, and the state file (original values recorded before
the first change, restored on close, after a crash, or by `wattserve device reset`).
Backends only read and write the hardware. This module must not import pynvml.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wattserve.daemon.device.gate import ActuationGate
from wattserve.daemon.device.protocol import (
    IN_FORCE,
    Capabilities,
    ClockLockResult,
    DeviceBackend,
    DeviceError,
    DeviceLostError,
    EngineActivity,
    Knob,
    KnobChange,
    KnobUnavailableError,
    PowerLimitResult,
    ResetResult,
    RestoreResult,
    SetOutcome,
    StateFileError,
    Telemetry,
)
from wattserve.daemon.device.state import StateFile

log = logging.getLogger(__name__)

# Power limits are set in whole milliwatts; closer than this counts as already in force.
_POWER_EQUAL_W = 0.5


@dataclass(frozen=True)
class _Original:
    """A knob's value before a change, to be recorded first; unreadable: do not change it."""

    value: Any
    readable: bool = True


def clamp_power_limit_w(requested_w: float, lo_w: float | None, hi_w: float | None) -> float:
    target = requested_w
    if lo_w is not None:
        target = max(target, lo_w)
    if hi_w is not None:
        target = min(target, hi_w)
    return target


def clamp_sm_clocks_mhz(
    min_mhz: int, max_mhz: int, ladder_mhz: tuple[int, ...], top_mhz: int | None
) -> tuple[int, int]:
    """Clamp a lock range into the device's range and snap it onto the supported ladder.

    The upper bound snaps down and the lower bound up, so the lock never allows more than
    was asked; a reversed range collapses onto its upper bound.
    """
    lo, hi = int(min_mhz), int(max_mhz)
    if lo > hi:
        lo = hi
    if not ladder_mhz:
        if top_mhz is not None:
            hi = min(hi, top_mhz)
            lo = min(lo, hi)
        return max(lo, 1), max(hi, 1)
    hi = min(max(hi, ladder_mhz[0]), ladder_mhz[-1])
    hi = ladder_mhz[bisect.bisect_right(ladder_mhz, hi) - 1]
    lo = min(max(lo, ladder_mhz[0]), hi)
    lo = ladder_mhz[bisect.bisect_left(ladder_mhz, lo)]
    return lo, hi


class ManagedDevice:
    """A `Device` over one backend, with the gate and the state file."""

    def __init__(self, backend: DeviceBackend, gate: ActuationGate, state: StateFile) -> None:
        self._backend = backend
        self._gate = gate
        self._state = state
        self._write_lock = threading.Lock()
        # True once this process recorded or took over the state file: close() restores then.
        self._owns_record = False
        self._closed = False
        for knob, reason in backend.unsupported_knobs().items():
            gate.mark_unavailable(knob, reason)
        if gate.mode == "control":  # observe mode writes nothing, so it removes nothing
            state.remove_leftover_temp_files()

    @property
    def backend(self) -> DeviceBackend:
        """The backend itself (for the virtual GPU's simulation controls)."""
        return self._backend

    @property
    def state_file(self) -> StateFile:
        return self._state

    def now_s(self) -> float:
        return self._backend.now_s()

    def capabilities(self) -> Capabilities:
        ident = self._backend.identity
        return Capabilities(
            backend=ident.backend,
            name=ident.name,
            uuid=ident.uuid,
            pci_bus_id=ident.pci_bus_id,
            mode=self._gate.mode,
            update_period_s=self._backend.update_period_s,
            readable=self._backend.readable_fields(),
            knobs=self._gate.knob_capabilities(),
        )

    def read(self) -> Telemetry:
        return self._backend.read()

    def record_engine_step(self, activity: EngineActivity) -> float:
        return self._backend.record_engine_step(activity)

    # -- setters -------------------------------------------------------------------------

    def set_power_limit_w(self, power_limit_w: float) -> PowerLimitResult:
        """Set the board power limit, clamped to the device's [min, max]."""
        if not math.isfinite(power_limit_w):
            raise ValueError(f"power limit must be a finite number of watts, got {power_limit_w!r}")
        limits = self._backend.limits()
        target = clamp_power_limit_w(
            power_limit_w, limits.power_limit_min_w, limits.power_limit_max_w
        )
        clamped = abs(target - power_limit_w) > 1e-9
        with self._write_lock:
            outcome, detail = self._apply_power_limit(target)
        if clamped and not detail:
            lo_w, hi_w = limits.power_limit_min_w, limits.power_limit_max_w
            detail = f"clamped to the device range {lo_w}-{hi_w} W"
        return PowerLimitResult(power_limit_w, target, clamped, outcome, detail)

    def lock_sm_clocks_mhz(self, min_mhz: int, max_mhz: int) -> ClockLockResult:
        """Lock the SM clock into [min_mhz, max_mhz], clamped and snapped to the device ladder."""
        limits = self._backend.limits()
        lo, hi = clamp_sm_clocks_mhz(
            min_mhz, max_mhz, limits.sm_clock_ladder_mhz, limits.sm_clock_max_mhz
        )
        clamped = (lo, hi) != (min_mhz, max_mhz)
        with self._write_lock:
            current = self._backend.current_sm_clock_lock_mhz()
            outcome, detail = self._apply(
                Knob.SM_CLOCKS,
                lambda: self._backend.write_sm_clock_lock_mhz(lo, hi),
                original=_Original(current),
                unchanged=current == (lo, hi),
            )
        if clamped and not detail:
            detail = "clamped and snapped to the supported SM clock ladder"
        return ClockLockResult(min_mhz, max_mhz, lo, hi, clamped, outcome, detail)

    def reset(self) -> ResetResult:
        """Default power limit and SM clocks unlocked (the unlock is always sent: it is
        idempotent on the device, and a lock set by a crashed run is not visible to NVML)."""
        limits = self._backend.limits()
        changes: list[KnobChange] = []
        with self._write_lock:
            default_w = limits.power_limit_default_w
            if default_w is None:
                changes.append(
                    KnobChange(
                        Knob.POWER_LIMIT,
                        SetOutcome.UNAVAILABLE,
                        "the device reports no default power limit",
                    )
                )
            else:
                outcome, detail = self._apply_power_limit(default_w)
                changes.append(KnobChange(Knob.POWER_LIMIT, outcome, detail))
            outcome, detail = self._apply(
                Knob.SM_CLOCKS,
                self._backend.write_sm_clock_unlock,
                original=_Original(self._backend.current_sm_clock_lock_mhz()),
                unchanged=False,
            )
            changes.append(KnobChange(Knob.SM_CLOCKS, outcome, detail))
        return ResetResult(tuple(changes))

    def restore_original_settings(self) -> RestoreResult:
        """Put back every value the state file recorded, then remove the file.

        Each knob is restored on its own: one that fails (or raises) does not stop the
        next. The state file is only bookkeeping here: a failed update of it is logged
        once and reported in `state_file_error`, never a reason to stop restoring (the
        file then keeps originals already back in force; restoring them again is harmless).
        """
        with self._write_lock:
            record = self._state.load()
            if record is None:
                return RestoreResult(self._state.path, None)
            if record.uuid != self._backend.identity.uuid:
                raise DeviceError(
                    f"state file {self._state.path} belongs to GPU {record.uuid}, "
                    f"not {self._backend.identity.uuid}"
                )
            changes: list[KnobChange] = []
            file_error: StateFileError | None = None
            for knob in (Knob.POWER_LIMIT, Knob.SM_CLOCKS):
                if knob not in record.originals:
                    continue
                try:
                    write, unchanged, shown = self._restore_action(knob, record.originals[knob])
                    outcome, detail = self._apply(knob, write, original=None, unchanged=unchanged)
                except Exception as e:  # a backend bug must not keep the other knobs changed
                    log.exception("device: restoring %s failed", knob.value)
                    outcome, detail, shown = SetOutcome.FAILED, f"{type(e).__name__}: {e}", ""
                changes.append(KnobChange(knob, outcome, detail or shown))
                if outcome in IN_FORCE and file_error is None:
                    try:
                        self._state.forget(knob)
                    except StateFileError as e:
                        file_error = e
            if all(c.outcome in IN_FORCE for c in changes):
                if file_error is None:
                    try:
                        self._state.clear()
                    except StateFileError as e:
                        file_error = e
                self._owns_record = False  # the device is restored, whatever the file says
            if file_error is not None:
                log.error("device: settings restored where shown, but %s", file_error)
            return RestoreResult(
                self._state.path,
                record.pid,
                tuple(changes),
                state_file_error=str(file_error) if file_error is not None else None,
            )

    def adopt_leftover_record(self) -> None:
        """Take over a record left by an earlier run, so close() restores it."""
        self._owns_record = True

    def close(self, restore: bool = True) -> RestoreResult | None:
        """Restore what this process recorded (clean exit), then release the backend."""
        if self._closed:
            return None
        result = None
        try:
            if restore and self._owns_record and self._gate.mode == "control":
                result = self.restore_original_settings()
                if not result.complete:
                    log.error(
                        "device: could not restore every original setting: %s",
                        "; ".join(
                            f"{c.knob.value}: {c.outcome.value} {c.detail}" for c in result.changes
                        ),
                    )
        finally:
            self._closed = True
            self._backend.close()
        return result

    # -- internals -----------------------------------------------------------------------

    def _apply_power_limit(self, target_w: float) -> tuple[SetOutcome, str]:
        current = self._backend.current_power_limit_w()
        return self._apply(
            Knob.POWER_LIMIT,
            lambda: self._backend.write_power_limit_w(target_w),
            original=_Original(current, readable=current is not None),
            unchanged=current is not None and abs(current - target_w) < _POWER_EQUAL_W,
        )

    def _restore_action(self, knob: Knob, value: Any) -> tuple[Callable[[], None], bool, str]:
        if knob is Knob.POWER_LIMIT:
            watts = float(value)
            current = self._backend.current_power_limit_w()
            unchanged = current is not None and abs(current - watts) < _POWER_EQUAL_W
            return (lambda: self._backend.write_power_limit_w(watts)), unchanged, f"{watts:g} W"
        if value is None:
            # NVML cannot read a lock back, so an unlock is always sent (idempotent).
            return self._backend.write_sm_clock_unlock, False, "unlocked"
        lo, hi = value
        return (lambda: self._backend.write_sm_clock_lock_mhz(lo, hi)), False, f"{lo}-{hi} MHz"

    def _apply(
        self, knob: Knob, write: Callable[[], None], *, original: _Original | None, unchanged: bool
    ) -> tuple[SetOutcome, str]:
        """The only caller of a backend write: gate, then record the original, then write.

        original None: a restore, nothing to record.
        """
        decision = self._gate.decide(knob)
        if not decision.allowed:
            return decision.outcome or SetOutcome.OBSERVE_ONLY, decision.reason
        if self._backend.is_lost():
            return SetOutcome.DEVICE_LOST, "GPU lost; re-initialising"
        if unchanged:
            return SetOutcome.UNCHANGED, ""
        newly_recorded = False
        if original is not None:
            if not original.readable:
                return SetOutcome.FAILED, "current value unreadable, so it could not be restored"
            # Recorded before the write: if we die right after it, the next start restores.
            try:
                newly_recorded = self._state.record_original(
                    self._backend.identity, knob, original.value
                )
            except StateFileError as e:
                log.error("device: not changing %s: %s", knob.value, e)
                return SetOutcome.FAILED, f"not changed: {e}"
            self._owns_record = True
        try:
            write()
        except KnobUnavailableError as e:
            self._gate.mark_unavailable(knob, e.reason)
            if newly_recorded:
                self._state.forget(knob)  # nothing changed, nothing to restore
            log.warning("device: %s is now observe-only: %s", knob.value, e.reason)
            return SetOutcome.UNAVAILABLE, e.reason
        except DeviceLostError as e:
            return SetOutcome.DEVICE_LOST, str(e)
        except DeviceError as e:
            log.error("device: setting %s failed: %s", knob.value, e)
            return SetOutcome.FAILED, str(e)
        self._gate.mark_used(knob)
        return SetOutcome.APPLIED, ""
