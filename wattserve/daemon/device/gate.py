"""The one place that decides whether a device setter may run.

Audit rule: a backend's write_* methods are called only from ManagedDevice._apply
(managed.py), and _apply asks ActuationGate.decide first. decide() says no to every knob
in observe mode, and no to a knob the device refused (NO_PERMISSION / NOT_SUPPORTED),
which stays read-only for the life of the process. This module must not talk to a device.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from wattserve.daemon.device.protocol import DeviceMode, Knob, KnobCapability, SetOutcome


@dataclass(frozen=True)
class GateDecision:
    allowed: bool
    outcome: SetOutcome | None  # why not, when not allowed
    reason: str = ""


class ActuationGate:
    """Decides, per knob, whether a setter may reach the hardware."""

    def __init__(self, mode: DeviceMode, unavailable: Mapping[Knob, str] | None = None) -> None:
        if mode not in ("control", "observe"):
            raise ValueError(f"device mode must be 'control' or 'observe', got {mode!r}")
        self._mode: DeviceMode = mode
        self._unavailable: dict[Knob, str] = dict(unavailable or {})
        self._used: set[Knob] = set()
        self._lock = threading.Lock()

    @property
    def mode(self) -> DeviceMode:
        return self._mode

    def decide(self, knob: Knob) -> GateDecision:
        if self._mode != "control":
            return GateDecision(
                False, SetOutcome.OBSERVE_ONLY, "device.mode = observe: setters never run"
            )
        with self._lock:
            reason = self._unavailable.get(knob)
        if reason is not None:
            return GateDecision(False, SetOutcome.UNAVAILABLE, f"read-only: {reason}")
        return GateDecision(True, None)

    def mark_unavailable(self, knob: Knob, reason: str) -> None:
        """The device refused this knob for good; it becomes observe-only."""
        with self._lock:
            self._unavailable[knob] = reason

    def mark_used(self, knob: Knob) -> None:
        """The device accepted a write to this knob (shown in capabilities)."""
        with self._lock:
            self._used.add(knob)

    def knob_capabilities(self) -> tuple[KnobCapability, ...]:
        out = []
        with self._lock:
            for knob in Knob:
                if self._mode != "control":
                    out.append(KnobCapability(knob, False, "device.mode = observe"))
                elif knob in self._unavailable:
                    out.append(KnobCapability(knob, False, self._unavailable[knob]))
                elif knob in self._used:
                    out.append(KnobCapability(knob, True, "accepted by the device"))
                else:
                    out.append(KnobCapability(knob, True, "not exercised yet"))
        return tuple(out)
