"""The GPUs of one attached server as one device: a tensor-parallel server's GPUs share one
power budget and run at the same clock.

Reads add power and limits up and take the hottest temperature, the lowest clock and the
union of throttle reasons; a power limit is split evenly (each GPU gets total / n); a clock
lock goes to every GPU. Each GPU stays a ManagedDevice with its own gate and state file, so
observe mode and the restore at exit are theirs. It must not decide any setting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from wattserve.daemon.device.managed import ManagedDevice
from wattserve.daemon.device.protocol import (
    IN_FORCE,
    Capabilities,
    ClockLockResult,
    EngineActivity,
    KnobCapability,
    PowerLimitResult,
    RestoreResult,
    Telemetry,
)


def _sum(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values)  # type: ignore[arg-type]


def _worst(results: list) -> object:
    """The first result whose outcome is not in force, else the first."""
    return next((r for r in results if r.outcome not in IN_FORCE), results[0])


class GpuGroup:
    """Several ManagedDevices steered as one (one GPU: the same as that GPU)."""

    def __init__(self, devices: Sequence[ManagedDevice]) -> None:
        if not devices:
            raise ValueError("an attached server needs at least one GPU")
        self.devices = tuple(devices)

    def capabilities(self) -> Capabilities:
        caps = [d.capabilities() for d in self.devices]
        first = caps[0]
        knobs = []
        for k in first.knobs:
            others = [next((o for o in c.knobs if o.knob == k.knob), None) for c in caps]
            writable = all(o is not None and o.writable for o in others)
            reasons = "; ".join(o.reason for o in others if o is not None and o.reason)
            knobs.append(KnobCapability(k.knob, writable, reasons))
        return dataclasses.replace(first, knobs=tuple(knobs))

    def read(self) -> Telemetry:
        reads = [d.read() for d in self.devices]
        if len(reads) == 1:
            return reads[0]
        first = reads[0]
        temps = [r.gpu_temp_c for r in reads if r.gpu_temp_c is not None]
        margins = [r.thermal_margin_c for r in reads if r.thermal_margin_c is not None]
        clocks = [r.sm_clock_mhz for r in reads if r.sm_clock_mhz is not None]
        masks = [r.clock_event_reasons_mask for r in reads if r.clock_event_reasons_mask]
        ladders = [set(r.sm_clock_ladder_mhz) for r in reads]
        locks = {r.sm_clock_lock_mhz for r in reads}
        mask = 0
        for m in masks:
            mask |= m
        return dataclasses.replace(
            first,
            timestamp_s=max(r.timestamp_s for r in reads),
            power_w=_sum([r.power_w for r in reads]),
            power_avg_w=_sum([r.power_avg_w for r in reads]),
            energy_j=_sum([r.energy_j for r in reads]),
            gpu_temp_c=max(temps) if temps else None,
            thermal_margin_c=min(margins) if margins else None,
            sm_clock_mhz=min(clocks) if clocks else None,
            clock_event_reasons_mask=mask if masks else first.clock_event_reasons_mask,
            clock_event_reasons=tuple(sorted({x for r in reads for x in r.clock_event_reasons})),
            power_limit_w=_sum([r.power_limit_w for r in reads]),
            power_limit_default_w=_sum([r.power_limit_default_w for r in reads]),
            power_limit_min_w=_sum([r.power_limit_min_w for r in reads]),
            power_limit_max_w=_sum([r.power_limit_max_w for r in reads]),
            sm_clock_ladder_mhz=tuple(sorted(set.intersection(*ladders))),
            sm_clock_lock_mhz=locks.pop() if len(locks) == 1 else None,
            device_lost=any(r.device_lost for r in reads),
            stale=any(r.stale for r in reads),
        )

    def set_power_limit_w(self, power_limit_w: float) -> PowerLimitResult:
        share_w = power_limit_w / len(self.devices)
        results = [d.set_power_limit_w(share_w) for d in self.devices]
        worst = _worst(results)
        return dataclasses.replace(
            worst,  # type: ignore[type-var]
            requested_w=power_limit_w,
            target_w=sum(r.target_w for r in results),
            clamped=any(r.clamped for r in results),
        )

    def lock_sm_clocks_mhz(self, min_mhz: int, max_mhz: int) -> ClockLockResult:
        results = [d.lock_sm_clocks_mhz(min_mhz, max_mhz) for d in self.devices]
        return _worst(results)  # type: ignore[return-value]

    def record_engine_step(self, activity: EngineActivity) -> float:
        """Book the server's work on each GPU (the virtual GPU prices it; NVML ignores it)."""
        return max(d.record_engine_step(activity) for d in self.devices)

    def restore_original_settings(self) -> list[RestoreResult]:
        return [d.restore_original_settings() for d in self.devices]

    def close(self) -> None:
        for d in self.devices:
            d.close()
