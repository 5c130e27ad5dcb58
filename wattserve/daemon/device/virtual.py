"""A deterministic simulated Hopper-class GPU (H200 SXM) implementing DeviceBackend.

Power = static (with temperature-dependent leakage) + clock tree + compute + HBM, where
the clock-dependent parts follow f * V(f)^2 with V flat below a knee and rising above it.
A first-order thermal model drives die and HBM temperature; simulated firmware lowers the
SM clock above the power limit (SwPowerCap) and above the thermal thresholds (SwThermal,
HwThermal). Each engine step is split by arithmetic intensity into a compute-bound part
that stretches with f_max / f and a memory-bound part that does not; the engine waits for
the difference. Runs on any monotonic clock: real time, or a SimClock for tests.
Every constant lives in VirtualGpuParams; docs/virtual-gpu.md gives each one's source.
This module must not import torch, pynvml or the engine.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from wattserve.daemon.device.power_calibration import PowerCalibration
from wattserve.daemon.device.protocol import (
    REASON_GPU_IDLE,
    REASON_HW_POWER_BRAKE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
    DeviceError,
    DeviceIdentity,
    DeviceLimits,
    EngineActivity,
    Knob,
    Telemetry,
    decode_clock_event_reasons,
    provided_measurements,
)


@dataclass(frozen=True)
class VirtualGpuParams:
    """Every constant of the simulated GPU. Sources: docs/virtual-gpu.md."""

    name: str = "NVIDIA H200 (virtual)"
    seed: int = 0  # noise seed; also names the GPU (GPU-virtual-<seed>)

    # Power limits (W).
    power_limit_default_w: float = 700.0
    power_limit_min_w: float = 200.0
    power_limit_max_w: float = 700.0

    # Clocks (MHz). The ladder is min..max in steps.
    sm_clock_min_mhz: int = 345
    sm_clock_max_mhz: int = 1980
    sm_clock_step_mhz: int = 15
    sm_clock_idle_mhz: int = 345  # no CUDA context and nothing running
    mem_clock_mhz: int = 3201

    # Voltage-frequency curve: flat floor up to the knee, then linear to the top.
    voltage_floor_v: float = 0.70
    voltage_knee_mhz: int = 1005
    voltage_max_v: float = 1.05

    # Power model.
    board_static_w: float = 66.0  # everything that does not scale with f V^2, at leakage_ref_temp_c
    leakage_w_per_c: float = 0.25  # leakage growth with die temperature
    leakage_ref_temp_c: float = 30.0
    clock_tree_w_per_ghz_v2: float = 22.3  # clocks running, nothing computing
    compute_w_per_ghz_v2: float = 350.0  # SMs fully busy
    memory_full_bandwidth_w: float = 65.0  # HBM streaming at full bandwidth
    memory_activity_in_compute_phase: float = 0.3  # HBM traffic while compute-bound

    # Roofline of the simulated part, used to split a step by arithmetic intensity.
    peak_flops: float = 989e12  # dense BF16 tensor-core FLOP/s
    peak_memory_bandwidth_bytes_per_s: float = 4.8e12

    # Thermal model.
    ambient_c: float = 25.0  # inlet air / coolant; settable at run time
    thermal_resistance_c_per_w: float = 0.065
    thermal_time_constant_s: float = 30.0
    memory_temp_offset_c: float = 12.0
    memory_thermal_resistance_c_per_w: float = 0.058
    memory_thermal_time_constant_s: float = 45.0

    # Firmware thermal policy.
    max_operating_temp_c: float = 87.0  # software thermal slowdown begins (SwThermal)
    slowdown_temp_c: float = 89.0  # hardware slowdown (HwThermal + HwSlowdown)
    shutdown_temp_c: float = 92.0  # reported only
    sw_thermal_gain_mhz_per_c: float = 500.0
    hw_slowdown_clock_fraction: float = 0.5
    hw_slowdown_release_c: float = 1.0  # hysteresis below slowdown_temp_c

    # Sensors.
    telemetry_period_s: float = 0.1  # energy counter and power reading update period
    power_avg_window_s: float = 1.0
    power_noise_fraction: float = 0.01  # 1-sigma, on the instantaneous reading
    power_avg_noise_fraction: float = 0.002
    temperature_resolution_c: float = 1.0  # 0 = unrounded
    energy_resolution_j: float = 0.001  # NVML counts millijoules

    # Integration.
    max_integration_step_s: float = 0.1

    def __post_init__(self) -> None:
        positive = (
            "power_limit_default_w",
            "power_limit_min_w",
            "power_limit_max_w",
            "sm_clock_min_mhz",
            "sm_clock_max_mhz",
            "sm_clock_step_mhz",
            "sm_clock_idle_mhz",
            "mem_clock_mhz",
            "voltage_floor_v",
            "voltage_max_v",
            "peak_flops",
            "peak_memory_bandwidth_bytes_per_s",
            "thermal_resistance_c_per_w",
            "thermal_time_constant_s",
            "memory_thermal_resistance_c_per_w",
            "memory_thermal_time_constant_s",
            "telemetry_period_s",
            "power_avg_window_s",
            "max_integration_step_s",
            "hw_slowdown_clock_fraction",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"VirtualGpuParams.{name} must be > 0, got {getattr(self, name)!r}"
                )
        non_negative = (
            "board_static_w",
            "leakage_w_per_c",
            "clock_tree_w_per_ghz_v2",
            "compute_w_per_ghz_v2",
            "memory_full_bandwidth_w",
            "memory_activity_in_compute_phase",
            "power_noise_fraction",
            "power_avg_noise_fraction",
            "temperature_resolution_c",
            "energy_resolution_j",
            "sw_thermal_gain_mhz_per_c",
            "hw_slowdown_release_c",
            "seed",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(
                    f"VirtualGpuParams.{name} must be >= 0, got {getattr(self, name)!r}"
                )
        if not self.power_limit_min_w <= self.power_limit_default_w <= self.power_limit_max_w:
            raise ValueError("VirtualGpuParams: need power_limit_min_w <= default <= max")
        if (self.sm_clock_max_mhz - self.sm_clock_min_mhz) % self.sm_clock_step_mhz:
            raise ValueError("VirtualGpuParams: SM clock range must be a whole number of steps")
        if not self.sm_clock_min_mhz <= self.voltage_knee_mhz <= self.sm_clock_max_mhz:
            raise ValueError(
                "VirtualGpuParams: voltage_knee_mhz must lie within the SM clock range"
            )
        if self.voltage_max_v < self.voltage_floor_v:
            raise ValueError("VirtualGpuParams: voltage_max_v must be >= voltage_floor_v")
        if not self.max_operating_temp_c <= self.slowdown_temp_c <= self.shutdown_temp_c:
            raise ValueError(
                "VirtualGpuParams: need max_operating <= slowdown <= shutdown temperature"
            )
        if self.hw_slowdown_clock_fraction > 1 or self.memory_activity_in_compute_phase > 1:
            raise ValueError("VirtualGpuParams: fractions must be <= 1")

    def sm_clock_ladder_mhz(self) -> tuple[int, ...]:
        return tuple(
            range(self.sm_clock_min_mhz, self.sm_clock_max_mhz + 1, self.sm_clock_step_mhz)
        )


# -- the physical model, as pure functions (the simulator and the tests share them) -----------


def voltage_v(p: VirtualGpuParams, sm_clock_mhz: float) -> float:
    if sm_clock_mhz <= p.voltage_knee_mhz:
        return p.voltage_floor_v
    span = p.sm_clock_max_mhz - p.voltage_knee_mhz
    rise = (sm_clock_mhz - p.voltage_knee_mhz) / span if span else 1.0
    return p.voltage_floor_v + (p.voltage_max_v - p.voltage_floor_v) * rise


def compute_fraction(p: VirtualGpuParams, activity: EngineActivity) -> float:
    """Share of the step that is compute-bound at f_max, from its arithmetic intensity.

    Compute time at peak FLOP/s against memory time at peak bandwidth: a step of
    intensity I (FLOP/byte) on a part with ridge point R = peak_flops / bandwidth is
    I / (I + R) compute-bound.
    """
    compute_s = activity.flops / p.peak_flops
    memory_s = activity.bytes_read / p.peak_memory_bandwidth_bytes_per_s
    total = compute_s + memory_s
    return compute_s / total if total > 0 else 0.0


def stretch_factor(p: VirtualGpuParams, fraction_compute: float, sm_clock_mhz: float) -> float:
    """Step time at sm_clock_mhz over step time at f_max.

    The compute-bound part scales with f_max / f; the memory-bound part does not.
    """
    return fraction_compute * (p.sm_clock_max_mhz / sm_clock_mhz) + (1.0 - fraction_compute)


def phase_shares(
    p: VirtualGpuParams, fraction_compute: float, sm_clock_mhz: float
) -> tuple[float, float]:
    """Shares of the (stretched) step spent compute-bound and memory-bound at this clock."""
    compute = fraction_compute * (p.sm_clock_max_mhz / sm_clock_mhz)
    memory = 1.0 - fraction_compute
    total = compute + memory
    return compute / total, memory / total


def power_w(
    p: VirtualGpuParams, sm_clock_mhz: float, gpu_temp_c: float, fraction_compute: float | None
) -> float:
    """Board power at a clock and die temperature; fraction_compute None = no kernel running."""
    f_ghz = sm_clock_mhz / 1000.0
    v = voltage_v(p, sm_clock_mhz)
    fv2 = f_ghz * v * v
    watts = p.board_static_w + p.leakage_w_per_c * (gpu_temp_c - p.leakage_ref_temp_c)
    watts += p.clock_tree_w_per_ghz_v2 * fv2
    if fraction_compute is not None:
        c_share, m_share = phase_shares(p, fraction_compute, sm_clock_mhz)
        watts += p.compute_w_per_ghz_v2 * c_share * fv2
        watts += p.memory_full_bandwidth_w * (
            m_share + c_share * p.memory_activity_in_compute_phase
        )
    return max(watts, 0.0)


def memory_activity(p: VirtualGpuParams, fraction_compute: float, sm_clock_mhz: float) -> float:
    c_share, m_share = phase_shares(p, fraction_compute, sm_clock_mhz)
    return m_share + c_share * p.memory_activity_in_compute_phase


class StepRates(NamedTuple):
    """What a running step does per second at the top clock (its measured duration)."""

    fraction_compute: float
    bytes_per_s: float
    flops_per_s: float


def step_rates(p: VirtualGpuParams, activity: EngineActivity) -> StepRates:
    duration_s = activity.step_duration_s
    return StepRates(
        compute_fraction(p, activity),
        activity.bytes_read / duration_s if duration_s > 0 else 0.0,
        activity.flops / duration_s if duration_s > 0 else 0.0,
    )


def fv_squared(p: VirtualGpuParams, sm_clock_mhz: float) -> float:
    """f (GHz) x V(f)^2: what the clock-dependent power terms scale with."""
    v = voltage_v(p, sm_clock_mhz)
    return sm_clock_mhz / 1000.0 * v * v


def calibrated_power_w(
    p: VirtualGpuParams,
    cal: PowerCalibration,
    sm_clock_mhz: float,
    gpu_temp_c: float,
    step: StepRates | None,
) -> float:
    """Board power from a measured calibration (power_calibration.py); step None = no kernel.

    At the calibrated clock and temperature this is the calibration's own formula, a step's
    memory and compute utilisation being its rates over the peaks, its time stretched at a
    lower clock. Off that clock the clock-tree, active and compute terms scale with
    f * V(f)^2 on this profile's voltage curve (measured only at the clock of the run:
    observe mode cannot set one), and leakage follows the die temperature as in power_w.
    """
    fv2, fv2_cal = fv_squared(p, sm_clock_mhz), fv_squared(p, cal.sm_clock_mhz)
    watts = cal.idle_w + p.clock_tree_w_per_ghz_v2 * (fv2 - fv2_cal)
    if cal.idle_temp_c is not None:
        watts += p.leakage_w_per_c * (gpu_temp_c - cal.idle_temp_c)
    if step is not None:
        scale = fv2 / fv2_cal
        stretch = stretch_factor(p, step.fraction_compute, sm_clock_mhz)
        memory_util = step.bytes_per_s / stretch / p.peak_memory_bandwidth_bytes_per_s
        compute_util = step.flops_per_s / stretch / p.peak_flops
        watts += cal.active_w * scale + cal.memory_w * memory_util
        watts += cal.compute_w * compute_util * scale
    return max(watts, 0.0)


# -- clocks -------------------------------------------------------------------------------


class SimClock:
    """A manual monotonic clock for simulated time: call it for now, advance() to move on."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self._now_s = float(start_s)

    def __call__(self) -> float:
        return self._now_s

    def advance(self, dt_s: float) -> None:
        if dt_s < 0 or not math.isfinite(dt_s):
            raise ValueError(f"SimClock.advance needs a finite dt_s >= 0, got {dt_s!r}")
        self._now_s += dt_s


class _Tick(NamedTuple):
    """Cumulative counters at a telemetry update boundary."""

    t_s: float
    energy_j: float
    busy_s: float
    mem_busy_s: float


def _unit_gauss(seed: int, stream: int, index: int) -> float:
    # Keyed by tick index, so a reading depends on simulated time only, not on how often
    # anyone polled: the same seed and trace give the same telemetry.
    return random.Random(f"{seed}/{stream}/{index}").gauss(0.0, 1.0)


def _quantize(value: float, resolution: float) -> float:
    return round(value / resolution) * resolution if resolution > 0 else value


class VirtualGpu:
    """The simulated GPU. Thread-safe: the sampler reads while the engine records steps."""

    def __init__(
        self,
        params: VirtualGpuParams | None = None,
        clock: Callable[[], float] = time.monotonic,
        calibration: PowerCalibration | None = None,
    ) -> None:
        """calibration: price power from a measured calibration instead of the profile's
        physical constants (clocks, thermals and firmware stay the profile's)."""
        self._p = params or VirtualGpuParams()
        self._calibration = calibration
        self._step = StepRates(0.0, 0.0, 0.0)
        self._clock = clock
        self._lock = threading.RLock()
        self._ladder = self._p.sm_clock_ladder_mhz()
        p = self._p
        now = clock()
        self._t_s = now
        self._ambient_c = p.ambient_c
        self._power_limit_w = p.power_limit_default_w
        self._lock_mhz: tuple[int, int] | None = None
        self._context_open = False
        self._power_brake = False
        self._hw_slowdown = False
        self._busy_until_s = -math.inf
        self._fraction_compute = 0.0
        self._energy_j = 0.0
        self._busy_s = 0.0
        self._mem_busy_s = 0.0
        # Start at the bare-idle thermal equilibrium (fixed point through leakage).
        self._temp_c = self._ambient_c
        for _ in range(50):
            idle_w = self._power_w(p.sm_clock_idle_mhz, self._temp_c, busy=False)
            self._temp_c = self._ambient_c + p.thermal_resistance_c_per_w * idle_w
        self._mem_temp_c = self._mem_equilibrium_c(idle_w)
        self._sm_clock_mhz, self._reasons = self._firmware(busy=False)
        self._power_now_w = self._power_w(self._sm_clock_mhz, self._temp_c, busy=False)
        self._next_tick = math.floor(now / p.telemetry_period_s) + 1
        window_ticks = max(1, round(p.power_avg_window_s / p.telemetry_period_s))
        self._ticks: deque[_Tick] = deque(maxlen=window_ticks + 1)
        self._ticks.append(_Tick(now, 0.0, 0.0, 0.0))
        self._readable = provided_measurements(self.read())

    # -- DeviceBackend ------------------------------------------------------------------

    @property
    def params(self) -> VirtualGpuParams:
        return self._p

    @property
    def identity(self) -> DeviceIdentity:
        return DeviceIdentity(
            backend="virtual",
            name=self._p.name,
            uuid=f"GPU-virtual-{self._p.seed}",
            pci_bus_id=f"virtual:{self._p.seed}",
        )

    @property
    def update_period_s(self) -> float:
        return self._p.telemetry_period_s

    def now_s(self) -> float:
        return self._clock()

    def limits(self) -> DeviceLimits:
        p = self._p
        return DeviceLimits(
            power_limit_min_w=p.power_limit_min_w,
            power_limit_max_w=p.power_limit_max_w,
            power_limit_default_w=p.power_limit_default_w,
            sm_clock_ladder_mhz=self._ladder,
            sm_clock_max_mhz=p.sm_clock_max_mhz,
        )

    def readable_fields(self) -> tuple[str, ...]:
        return self._readable

    def unsupported_knobs(self) -> dict[Knob, str]:
        return {}

    def is_lost(self) -> bool:
        return False

    def current_power_limit_w(self) -> float:
        with self._lock:
            return self._power_limit_w

    def current_sm_clock_lock_mhz(self) -> tuple[int, int] | None:
        with self._lock:
            return self._lock_mhz

    def write_power_limit_w(self, power_limit_w: float) -> None:
        p = self._p
        if not p.power_limit_min_w <= power_limit_w <= p.power_limit_max_w:
            raise DeviceError(
                f"power limit {power_limit_w} W is outside "
                f"{p.power_limit_min_w}-{p.power_limit_max_w} W"
            )
        with self._lock:
            self._advance(self._clock())
            self._power_limit_w = float(power_limit_w)

    def write_sm_clock_lock_mhz(self, min_mhz: int, max_mhz: int) -> None:
        if min_mhz > max_mhz or min_mhz not in self._ladder or max_mhz not in self._ladder:
            raise DeviceError(
                f"SM clock lock {min_mhz}-{max_mhz} MHz is not on the supported ladder"
            )
        with self._lock:
            self._advance(self._clock())
            self._lock_mhz = (int(min_mhz), int(max_mhz))

    def write_sm_clock_unlock(self) -> None:
        with self._lock:
            self._advance(self._clock())
            self._lock_mhz = None

    def record_engine_step(self, activity: EngineActivity) -> float:
        """Book one engine step from now on; return the extra seconds the engine must wait.

        The booking starts at the call, so a step loop that waits the returned time and then
        runs its next step lays bookings end to end.
        """
        with self._lock:
            now = self._clock()
            self._advance(now)
            if activity.step_duration_s <= 0:
                return 0.0
            self._context_open = True  # the engine has a CUDA context from its first step
            self._fraction_compute = compute_fraction(self._p, activity)
            self._step = step_rates(self._p, activity)
            sm_clock_mhz, _ = self._firmware(busy=True)
            stretched_s = activity.step_duration_s * stretch_factor(
                self._p, self._fraction_compute, sm_clock_mhz
            )
            self._busy_until_s = now + stretched_s
            return max(0.0, stretched_s - activity.step_duration_s)

    def read(self) -> Telemetry:
        p = self._p
        with self._lock:
            now = self._clock()
            self._advance(now)
            last = self._ticks[-1]
            tick_index = self._next_tick - 1
            if len(self._ticks) >= 2:
                prev = self._ticks[-2]
                inst_w = (last.energy_j - prev.energy_j) / (last.t_s - prev.t_s)
            else:
                inst_w = self._power_now_w
            inst_w *= 1.0 + p.power_noise_fraction * _unit_gauss(p.seed, 0, tick_index)
            first = self._ticks[0]
            span_s = last.t_s - first.t_s
            if span_s > 0:
                avg_w = (last.energy_j - first.energy_j) / span_s
                gpu_util = 100.0 * (last.busy_s - first.busy_s) / span_s
                mem_util = 100.0 * (last.mem_busy_s - first.mem_busy_s) / span_s
            else:
                avg_w, gpu_util, mem_util = self._power_now_w, 0.0, 0.0
            avg_w *= 1.0 + p.power_avg_noise_fraction * _unit_gauss(p.seed, 1, tick_index)
            temp_c = _quantize(self._temp_c, p.temperature_resolution_c)
            return Telemetry(
                timestamp_s=now,
                power_w=inst_w,
                power_w_is_instant=True,
                power_avg_w=avg_w,
                power_avg_window_s=p.power_avg_window_s,
                energy_j=_quantize(last.energy_j, p.energy_resolution_j),
                gpu_temp_c=temp_c,
                memory_temp_c=_quantize(self._mem_temp_c, p.temperature_resolution_c),
                sm_clock_mhz=self._sm_clock_mhz,
                mem_clock_mhz=p.mem_clock_mhz,
                gpu_util_pct=min(100.0, gpu_util),
                mem_util_pct=min(100.0, mem_util),
                clock_event_reasons_mask=self._reasons,
                clock_event_reasons=decode_clock_event_reasons(self._reasons),
                power_limit_w=self._power_limit_w,
                power_limit_default_w=p.power_limit_default_w,
                power_limit_min_w=p.power_limit_min_w,
                power_limit_max_w=p.power_limit_max_w,
                sm_clock_ladder_mhz=self._ladder,
                sm_clock_lock_mhz=self._lock_mhz,
                max_operating_temp_c=p.max_operating_temp_c,
                slowdown_temp_c=p.slowdown_temp_c,
                thermal_margin_c=p.max_operating_temp_c - temp_c,
            )

    def close(self) -> None:
        """Nothing to release: the simulation lives in this object."""

    # -- simulation controls ------------------------------------------------------------

    def set_ambient_c(self, ambient_c: float) -> None:
        """Change the inlet temperature from now on (a cooling fault, a hot aisle)."""
        with self._lock:
            self._advance(self._clock())
            self._ambient_c = float(ambient_c)

    def set_power_brake(self, active: bool) -> None:
        """Assert or release the external power-brake signal (HwPowerBrake)."""
        with self._lock:
            self._advance(self._clock())
            self._power_brake = bool(active)

    def set_context_open(self, open_: bool) -> None:
        """Open or drop the CUDA context (a context keeps the GPU out of its idle P-state)."""
        with self._lock:
            self._advance(self._clock())
            self._context_open = bool(open_)

    # -- internals ----------------------------------------------------------------------

    def _mem_equilibrium_c(self, watts: float) -> float:
        p = self._p
        return (
            self._ambient_c + p.memory_temp_offset_c + p.memory_thermal_resistance_c_per_w * watts
        )

    def _snap_down_mhz(self, mhz: float) -> int:
        p = self._p
        mhz = min(max(mhz, p.sm_clock_min_mhz), p.sm_clock_max_mhz)
        steps = math.floor((mhz - p.sm_clock_min_mhz) / p.sm_clock_step_mhz + 1e-9)
        return p.sm_clock_min_mhz + steps * p.sm_clock_step_mhz

    def _firmware(self, busy: bool) -> tuple[int, int]:
        """The clock the simulated firmware runs at now, and the clock-event reason mask."""
        p = self._p
        reasons = 0 if busy else REASON_GPU_IDLE
        if not busy and not self._context_open:
            return p.sm_clock_idle_mhz, reasons
        target = float(self._lock_mhz[1] if self._lock_mhz else p.sm_clock_max_mhz)
        temp_c = self._temp_c
        if self._hw_slowdown:
            self._hw_slowdown = temp_c >= p.slowdown_temp_c - p.hw_slowdown_release_c
        else:
            self._hw_slowdown = temp_c >= p.slowdown_temp_c
        if self._hw_slowdown:
            reasons |= REASON_HW_THERMAL | REASON_HW_SLOWDOWN
            target = min(target, p.sm_clock_max_mhz * p.hw_slowdown_clock_fraction)
        if self._power_brake:
            reasons |= REASON_HW_POWER_BRAKE | REASON_HW_SLOWDOWN
            target = p.sm_clock_min_mhz
        if temp_c > p.max_operating_temp_c:
            sw_cap = p.sm_clock_max_mhz - p.sw_thermal_gain_mhz_per_c * (
                temp_c - p.max_operating_temp_c
            )
            if sw_cap < target:
                reasons |= REASON_SW_THERMAL
                target = sw_cap
        clock_mhz = self._snap_down_mhz(target)
        if self._power_w(clock_mhz, temp_c, busy) > self._power_limit_w:
            reasons |= REASON_SW_POWER_CAP
            clock_mhz = self._highest_clock_within_limit(clock_mhz, temp_c, busy)
        return clock_mhz, reasons

    def _power_w(self, clock_mhz: float, temp_c: float, busy: bool) -> float:
        """Board power now: the profile's physical model, or the measured calibration."""
        if self._calibration is None:
            return power_w(self._p, clock_mhz, temp_c, self._fraction_compute if busy else None)
        return calibrated_power_w(
            self._p, self._calibration, clock_mhz, temp_c, self._step if busy else None
        )

    def _highest_clock_within_limit(self, ceiling_mhz: int, temp_c: float, busy: bool) -> int:
        # Power rises monotonically with the clock, so bisect the ladder below the ceiling.
        p = self._p
        lo, hi = 0, (ceiling_mhz - p.sm_clock_min_mhz) // p.sm_clock_step_mhz
        if self._power_w(self._ladder[0], temp_c, busy) > self._power_limit_w:
            return self._ladder[0]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._power_w(self._ladder[mid], temp_c, busy) <= self._power_limit_w:
                lo = mid
            else:
                hi = mid - 1
        return self._ladder[lo]

    def _advance(self, now: float) -> None:
        """Integrate power, energy and temperature from the last update up to now."""
        p = self._p
        period = p.telemetry_period_s
        # Far from now and idle, nobody will see individual ticks: take coarse steps.
        coarse_step_s = max(
            p.max_integration_step_s,
            min(p.thermal_time_constant_s, p.memory_thermal_time_constant_s) / 20,
        )
        quiet_horizon_s = now - p.power_avg_window_s - 2 * period
        while self._t_s < now:
            t = self._t_s
            busy = t < self._busy_until_s
            coarse = not busy and t < quiet_horizon_s
            if coarse:
                t_next = min(t + coarse_step_s, quiet_horizon_s)
            else:
                t_next = min(now, self._next_tick * period, t + p.max_integration_step_s)
                if busy:
                    t_next = min(t_next, self._busy_until_s)
            dt = t_next - t
            clock_mhz, reasons = self._firmware(busy)
            watts = self._power_w(clock_mhz, self._temp_c, busy)
            self._energy_j += watts * dt
            if busy:
                self._busy_s += dt
                self._mem_busy_s += dt * memory_activity(p, self._fraction_compute, clock_mhz)
            decay = 1.0 - math.exp(-dt / p.thermal_time_constant_s)
            self._temp_c += (
                self._ambient_c + p.thermal_resistance_c_per_w * watts - self._temp_c
            ) * decay
            decay_mem = 1.0 - math.exp(-dt / p.memory_thermal_time_constant_s)
            self._mem_temp_c += (self._mem_equilibrium_c(watts) - self._mem_temp_c) * decay_mem
            self._t_s = t_next
            self._sm_clock_mhz, self._reasons, self._power_now_w = clock_mhz, reasons, watts
            if coarse:
                self._next_tick = math.floor(t_next / period) + 1
            elif t_next == self._next_tick * period:
                self._ticks.append(_Tick(t_next, self._energy_j, self._busy_s, self._mem_busy_s))
                self._next_tick += 1


def run_activity(
    gpu: VirtualGpu, clock: SimClock, activity: EngineActivity | None, duration_s: float
) -> int:
    """Drive a virtual GPU on a SimClock for duration_s: back-to-back steps of `activity`
    (each stretched by the current clock), or idle when activity is None. Returns the
    number of steps run. For controller tests and traces; no engine needed."""
    end_s = clock() + duration_s
    steps = 0
    if activity is None or activity.step_duration_s <= 0:
        clock.advance(max(0.0, end_s - clock()))
        return steps
    while clock() < end_s:
        extra_s = gpu.record_engine_step(activity)
        clock.advance(activity.step_duration_s + extra_s)
        steps += 1
    return steps
