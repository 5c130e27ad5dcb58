"""The controller's inputs as plain frozen values: telemetry, engine statistics, constraints.

The daemon's control loop (wattserve/daemon/control_loop.py) converts what the device and the
engine report into these; a test builds them by hand or from a recorded trace. Times are
seconds on one monotonic clock chosen by the caller (simulated or real). This module must
not import the daemon, torch or pydantic, and must not read any clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wattserve.controller.policy import QuantOption


@dataclass(frozen=True)
class Telemetry:
    """One device snapshot, reduced to what the controller uses.

    power_w: power over the device's shortest window (about 100 ms); power_avg_w: over
    power_avg_window_s (about 1 s). sm_clock_mhz: the clock the GPU runs at now (after
    any firmware cap). thermal_margin_c: distance to the nearest thermal slowdown.
    sw_power_cap / thermal_throttle / hw_slowdown: the device's clock-event reasons;
    hw_slowdown is the hardware's own brake (HwSlowdown, HwThermal or HwPowerBrake), under
    which the controller raises no clock.
    stale: older than two sampling periods, or the GPU is lost: not to be acted on.
    """

    timestamp_s: float
    power_w: float | None = None
    power_avg_w: float | None = None
    power_avg_window_s: float = 1.0
    gpu_temp_c: float | None = None
    thermal_margin_c: float | None = None
    sm_clock_mhz: int | None = None
    sw_power_cap: bool = False
    thermal_throttle: bool = False
    hw_slowdown: bool = False
    stale: bool = False
    device_lost: bool = False

    @property
    def usable(self) -> bool:
        return not (self.stale or self.device_lost) and self.power_w is not None


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the controller learns from it.

    duration_s: wall time from the start of the step to the end of everything it cost
    (on the virtual GPU, including the clock stretch). context_tokens: KV tokens the
    step's attention read. sm_clock_mhz: the clock it ran at (None: unknown).
    """

    started_at_s: float
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    quant_level: str
    sm_clock_mhz: int | None = None

    @property
    def has_prefill(self) -> bool:
        return self.prefill_tokens > 0


@dataclass(frozen=True)
class EngineStats:
    """The engine since the previous observation.

    steps: the steps that ended since then. num_running / num_waiting: queues now.
    *_total: cumulative counters (the controller takes differences). ttft_s / tpot_s:
    per-request latencies measured since then (first tokens / finished requests).
    oldest_waiting_s: how long the oldest waiting request has waited (None: none waits).
    """

    timestamp_s: float
    num_running: int = 0
    num_waiting: int = 0
    steps: tuple[StepRecord, ...] = ()
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_total: int = 0
    ttft_s: tuple[float, ...] = ()
    tpot_s: tuple[float, ...] = ()
    oldest_waiting_s: float | None = None
    quant_level: str | None = None  # the level the engine runs at now


@dataclass(frozen=True)
class DeviceConstraints:
    """What the device lets the controller command; targets outside are never produced."""

    sm_clock_ladder_mhz: tuple[int, ...]
    can_lock_clocks: bool = True
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    can_set_power_limit: bool = True

    def __post_init__(self) -> None:
        ladder = tuple(sorted(set(int(f) for f in self.sm_clock_ladder_mhz)))
        if not ladder:
            raise ValueError("DeviceConstraints needs a non-empty SM clock ladder")
        object.__setattr__(self, "sm_clock_ladder_mhz", ladder)
        lo, hi = self.power_limit_min_w, self.power_limit_max_w
        if lo is not None and hi is not None and lo > hi:
            raise ValueError("DeviceConstraints: power_limit_min_w > power_limit_max_w")

    @property
    def sm_clock_min_mhz(self) -> int:
        return self.sm_clock_ladder_mhz[0]

    @property
    def sm_clock_max_mhz(self) -> int:
        return self.sm_clock_ladder_mhz[-1]


@dataclass(frozen=True)
class EngineConstraints:
    """What the engine lets the controller command.

    max_num_seqs_max / max_num_batched_tokens_max: the configured caps, never exceeded.
    max_num_batched_tokens_min: at least one KV block of tokens.
    quant_options: the levels the engine can run (engine.quantization_levels, usable
    here), with their measured quality; full_precision_level: the level they compare to.
    decode_interval_max_ms: the longest decode pacing interval the engine takes (0: the
    engine does not pace decode steps).
    """

    max_num_seqs_max: int
    max_num_batched_tokens_max: int
    max_num_batched_tokens_min: int = 16
    quant_options: tuple[QuantOption, ...] = field(default_factory=tuple)
    full_precision_level: str = "fp32"
    decode_interval_max_ms: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.decode_interval_max_ms < float("inf"):
            raise ValueError("EngineConstraints.decode_interval_max_ms must be >= 0")
        if self.max_num_seqs_max < 1:
            raise ValueError("EngineConstraints.max_num_seqs_max must be >= 1")
        if not 1 <= self.max_num_batched_tokens_min <= self.max_num_batched_tokens_max:
            raise ValueError("EngineConstraints: need 1 <= max_num_batched_tokens_min <= _max")
        if not self.quant_options:
            object.__setattr__(self, "quant_options", (QuantOption(self.full_precision_level),))
