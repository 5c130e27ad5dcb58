"""The thin loop between the controller and the parts it steers.

Every period it gathers what happened since the last tick (engine steps from the step
hook, request latencies from the API, the engine's counters and queues, one telemetry
snapshot), hands them to controller.observe(), applies the decision's knobs to the engine
and the device (never in observe mode, and the device's own gate refuses setters in
device observe mode anyway), and hands each decision to write-only sinks (events, MQTT,
metrics). Device knobs are verified, not assumed: what the device took is compared with
what it reads back each tick (for an NVIDIA clock lock, which NVML cannot read back:
whether the clocks the GPU enforces while busy still agree with it), and a knob changed
behind the loop's back (someone ran nvidia-smi) or lost to a device re-initialisation is
counted as drift and re-applied.
Its clock, its sleep and the way blocking calls run are injected, so the same loop runs
on a thread in the daemon and step by step in simulated time in a benchmark.
It must not decide anything itself: every choice is the controller's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from wattserve.controller.controller import Controller, ControllerParams, Decision
from wattserve.controller.policy import Knobs, Policy, QuantOption
from wattserve.controller.schema import to_policy
from wattserve.controller.signals import (
    DeviceConstraints,
    EngineConstraints,
    EngineStats,
    StepRecord,
)
from wattserve.controller.signals import Telemetry as ControllerTelemetry
from wattserve.daemon.config import ControllerConfig
from wattserve.daemon.device.protocol import (
    IN_FORCE,
    REASON_HW_POWER_BRAKE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
    Knob,
    SetOutcome,
    Telemetry,
)
from wattserve.daemon.request_events import FirstToken, RequestFinished

log = logging.getLogger(__name__)

DecisionSink = Callable[[Decision], None]
# (kind, message, data): the live feed's publish_event, for the loop's own `knob_drift` events.
EventSink = Callable[[str, str, dict], None]
# A power limit read back within this of the one set is that one (NVML takes milliwatts).
_POWER_EQUAL_W = 0.5


class QuantLevelRefused(ValueError):
    """The engine refused a quantization level (unknown, or not allowed)."""


class SteerableEngine(Protocol):
    """What the loop needs from an engine (wattserve.daemon.engine.Engine, or a simulated one)."""

    @property
    def limits(self) -> Any: ...  # .max_num_seqs, .max_num_batched_tokens, .decode_interval_ms

    def set_limits(
        self,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        decode_interval_ms: float | None = None,
    ) -> Any: ...

    @property
    def quant_level(self) -> str: ...

    def set_quant_level(self, level: str) -> str: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def counters(self) -> Any: ...  # .prompt_tokens, .generation_tokens, .requests_finished


class SteerableDevice(Protocol):
    """What the loop needs from a device (wattserve.daemon.device.ManagedDevice)."""

    def read(self) -> Telemetry: ...

    def capabilities(self) -> Any: ...

    def set_power_limit_w(self, power_limit_w: float) -> Any: ...

    def lock_sm_clocks_mhz(self, min_mhz: int, max_mhz: int) -> Any: ...


def params_from_config(cfg: ControllerConfig) -> ControllerParams:
    """The controller's tuning from [controller]."""
    return ControllerParams.of(
        batch_period_s=cfg.batch_period_s,
        quant_dwell_s=cfg.quant_dwell_s,
        quant_gain_min_pct=cfg.quant_gain_min_pct,
        quant_start_by_table=cfg.quant_start_by_table,
        slo_margin=cfg.slo_margin,
        power_margin=cfg.power_margin,
        stale_hold_s=cfg.stale_hold_s,
        fallback_sm_clock_mhz=cfg.fallback_sm_clock_mhz,
        fallback_max_num_seqs=cfg.fallback_max_num_seqs,
        thermal_derate_start_c=cfg.thermal_derate_start_c,
    )


def controller_telemetry(t: Telemetry) -> ControllerTelemetry:
    """The device snapshot reduced to the controller's view."""
    mask = t.clock_event_reasons_mask or 0
    return ControllerTelemetry(
        timestamp_s=t.timestamp_s,
        power_w=t.power_w,
        power_avg_w=t.power_avg_w if t.power_avg_w is not None else t.power_w,
        power_avg_window_s=t.power_avg_window_s or 1.0,
        gpu_temp_c=t.gpu_temp_c,
        thermal_margin_c=t.thermal_margin_c,
        sm_clock_mhz=t.sm_clock_mhz,
        sw_power_cap=bool(mask & REASON_SW_POWER_CAP),
        thermal_throttle=bool(mask & (REASON_SW_THERMAL | REASON_HW_THERMAL)),
        # NVML reports the brake's cause bits with or without HwSlowdown itself.
        hw_slowdown=bool(mask & (REASON_HW_SLOWDOWN | REASON_HW_THERMAL | REASON_HW_POWER_BRAKE)),
        stale=t.stale,
        device_lost=t.device_lost,
    )


def device_constraints(device: SteerableDevice, telemetry: Telemetry) -> DeviceConstraints:
    """What the device lets the controller command (knobs the gate refuses are read-only)."""
    caps = device.capabilities()
    writable = {k.knob: k.writable for k in caps.knobs}
    ladder = telemetry.sm_clock_ladder_mhz or (
        (telemetry.sm_clock_mhz,) if telemetry.sm_clock_mhz else (1,)
    )
    return DeviceConstraints(
        sm_clock_ladder_mhz=tuple(ladder),
        can_lock_clocks=writable.get(Knob.SM_CLOCKS, False) and bool(telemetry.sm_clock_ladder_mhz),
        power_limit_min_w=telemetry.power_limit_min_w,
        power_limit_max_w=telemetry.power_limit_max_w,
        can_set_power_limit=writable.get(Knob.POWER_LIMIT, False)
        and telemetry.power_limit_min_w is not None,
    )


def quant_options(
    levels: Sequence[str], quality: dict | None, weight_bytes: dict[str, int] | None = None
) -> tuple[QuantOption, ...]:
    """QuantOptions from the engine's allowed levels and bench quant's quality table
    (wattserve.daemon.quant_table.load_quality_table; None when there is none yet)."""
    rows = (quality or {}).get("levels", {})
    out = []
    for level in levels:
        row = rows.get(level, {})
        pct = row.get("ppl_increase_pct")
        out.append(
            QuantOption(
                level,
                float(pct) if isinstance(pct, (int, float)) else None,
                (weight_bytes or {}).get(level, 0),
                _speed(row.get("decode_tok_s_bs16")),
                _speed(row.get("prefill_tok_s")),
            )
        )
    return tuple(out)


def _speed(value: object) -> float | None:
    """A table's tok/s figure, or None where it is missing or not a positive number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value) if math.isfinite(value) else None
    return None


def _start_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="wattserve-quant-switch", daemon=True).start()


class ControlLoop:
    """Feeds one Controller and applies its decisions.

    Wire: engine.add_step_hook(loop.on_step) *after* the device coupling hook (so a step's
    duration includes the virtual GPU's stretch); it subscribes to the API's request
    events (TTFT at each first token, TPOT at each finished request); HTTP/MQTT policy updates
    call set_policy(); PUT knobs calls put_manual_knobs(); /v1/status shows status().
    """

    def __init__(
        self,
        controller: Controller,
        engine: SteerableEngine,
        device: SteerableDevice,
        *,
        kv_bytes_per_token: int,
        period_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        telemetry_source: Callable[[], Telemetry | None] | None = None,
        step_clock_mhz: Callable[[], int | None] | None = None,
        run_blocking: Callable[[Callable[[], None]], None] = _start_thread,
        sinks: Sequence[DecisionSink] = (),
        oldest_waiting_s: Callable[[], float | None] | None = None,
        event_sink: EventSink | None = None,
    ) -> None:
        if period_s <= 0:
            raise ValueError("control loop period_s must be > 0")
        self.controller = controller
        self._engine = engine
        self._device = device
        self._kv_bytes_per_token = max(1, kv_bytes_per_token)
        self.period_s = period_s
        self._clock = clock
        self._sleep = sleep  # None: wait on the stop event (stop() wakes it at once)
        self._telemetry_source = telemetry_source or device.read
        self._step_clock = step_clock_mhz
        self._run_blocking = run_blocking
        self._sinks = tuple(sinks)
        self._event_sink = event_sink
        self._oldest_waiting = oldest_waiting_s
        self._lock = threading.Lock()
        self._steps: list[StepRecord] = []
        self._ttft: list[float] = []
        self._tpot: list[float] = []
        self._last_clock_mhz: int | None = None
        self._applied: Knobs | None = None
        # What the device took for each knob this loop set (clamped and snapped), to be
        # read back; and whether the device was lost at the last reading.
        self._in_force: dict[Knob, Any] = {}
        self._device_lost = False
        # Device writes (this loop's thread, PUT knobs' worker thread) one at a time.
        self._actuate = threading.Lock()
        self.knob_drift: dict[str, int] = {}
        self._quant_requested: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Set by set_policy() and stop(): the thread's wait ends and it ticks (or stops) now.
        self._wake = threading.Event()
        self.apply_failures: dict[str, int] = {}
        # Iterations of the loop thread, failed ticks included: the systemd watchdog's
        # progress counter (it watches for a hung thread; failures are logged).
        self.ticks = 0

    @classmethod
    def build(
        cls,
        cfg: ControllerConfig,
        engine: Any,
        device: SteerableDevice,
        *,
        quality: dict | None = None,
        **kwargs: Any,
    ) -> ControlLoop:
        """A loop over the daemon's real Engine and ManagedDevice, from [controller].

        quality: bench quant's table for this model
            (wattserve.daemon.quant_table.load_quality_table), or None.
        """
        telemetry = device.read()
        status = engine.quant_status()
        levels = tuple(status["levels"])
        weights = {lvl: row["weight_bytes"] for lvl, row in status["levels"].items()}
        limits = engine.limits
        constraints = EngineConstraints(
            max_num_seqs_max=limits.max_num_seqs,
            max_num_batched_tokens_max=limits.max_num_batched_tokens,
            max_num_batched_tokens_min=min(
                engine.kv_spec.block_size_tokens, limits.max_num_batched_tokens
            ),
            quant_options=quant_options(levels, quality, weights),
            full_precision_level=status["full_precision"],
            decode_interval_max_ms=cfg.decode_interval_max_ms,
        )
        initial = Knobs(
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            quant_level=engine.quant_level,
            decode_interval_ms=min(limits.decode_interval_ms, cfg.decode_interval_max_ms),
        )
        controller = Controller(
            to_policy(cfg),
            device_constraints(device, telemetry),
            constraints,
            initial,
            params_from_config(cfg),
        )
        kv_per_token = engine.kv_spec.bytes_per_block // engine.kv_spec.block_size_tokens
        kwargs.setdefault("period_s", cfg.period_s)
        kwargs.setdefault("oldest_waiting_s", engine.oldest_waiting_s)
        return cls(controller, engine, device, kv_bytes_per_token=kv_per_token, **kwargs)

    # ---- inputs (any thread) ------------------------------------------------------------------

    def on_step(self, stats: Any) -> None:
        """Engine step hook: remember the step (its duration up to now, so that a device
        hook registered before this one is included)."""
        wall_s = max(stats.duration_s, self._clock() - stats.started_at_s)
        clock = self._step_clock() if self._step_clock is not None else self._last_clock_mhz
        record = StepRecord(
            started_at_s=stats.started_at_s,
            duration_s=wall_s,
            prefill_tokens=stats.prefill_tokens,
            decode_tokens=stats.decode_tokens,
            context_tokens=stats.kv_bytes_read // self._kv_bytes_per_token,
            quant_level=getattr(stats, "quant_level", None) or self._engine.quant_level,
            sm_clock_mhz=clock,
        )
        with self._lock:
            self._steps.append(record)

    def record_ttft_s(self, ttft_s: float) -> None:
        """A request's time to first token, as the API measured it."""
        with self._lock:
            self._ttft.append(ttft_s)

    def record_tpot_s(self, tpot_s: float) -> None:
        """A finished request's time per output token, as the API measured it."""
        with self._lock:
            self._tpot.append(tpot_s)

    def on_first_token(self, event: FirstToken) -> None:
        """Request-event subscriber: TTFT as the API measured it, at the first token."""
        self.record_ttft_s(event.ttft_s)

    def on_request_finished(self, event: RequestFinished) -> None:
        """Request-event subscriber: the finished request's TPOT, where it has one."""
        if event.tpot_s is not None:
            self.record_tpot_s(event.tpot_s)

    def set_policy(self, policy: Policy) -> None:
        """The one path for policy changes (config, HTTP, MQTT). It wakes the loop's thread,
        which decides on it at once rather than at the next period: a budget cut waiting a
        period runs the GPU at a clock chosen for the old budget meanwhile. A caller driving
        tick() itself (a benchmark in simulated time) ticks after a policy change likewise.
        """
        with self._lock:
            self.controller.set_policy(policy)
        self._wake.set()

    def set_manual_knobs(self, knobs: Knobs) -> Knobs:
        with self._lock:
            return self.controller.set_manual_knobs(knobs)

    def put_manual_knobs(
        self,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        quant_level: str | None = None,
        clock_mhz: int | None = None,
        decode_interval_ms: float | None = None,
    ) -> Any:
        """PUT knobs, the operator's input: written now through this loop, the one actuator,
        and held as manual knobs (kept in manual mode; auto mode steers on from them).
        None leaves a knob as it is. Blocking (a level never used takes seconds to build):
        call it off the event loop. Raises QuantLevelRefused for a level the engine does
        not have, before anything changed. Returns the clock lock's ClockLockResult (None
        without clock_mhz); a lock not in force stops there, before the limits change."""
        engine = self._engine
        if quant_level is not None:
            try:
                engine.set_quant_level(quant_level)  # lands at the engine's next step
            except ValueError as e:
                raise QuantLevelRefused(str(e)) from None
        result = None
        if clock_mhz is not None:
            result = self.lock_sm_clock_mhz(clock_mhz)
            if result.outcome not in IN_FORCE:
                return result
        engine.set_limits(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            decode_interval_ms=decode_interval_ms,
        )
        limits = engine.limits
        # The daemon's Engine (PUT knobs exists only there) says which level it will run.
        requested = quant_level or engine.quant_status()["requested"]  # type: ignore[attr-defined]
        self.set_manual_knobs(
            Knobs(
                max_num_seqs=limits.max_num_seqs,
                max_num_batched_tokens=limits.max_num_batched_tokens,
                quant_level=requested,
                sm_clock_mhz=clock_mhz,
                decode_interval_ms=limits.decode_interval_ms,
            )
        )
        return result

    # ---- one tick ----------------------------------------

    def tick(self) -> Decision:
        """Observe, decide, apply (unless observe mode), publish."""
        try:
            raw = self._telemetry_source()
        except Exception as e:  # a failing read is stale telemetry, never a dead loop
            log.warning("control loop: telemetry read failed: %s", e)
            raw = None
        telemetry = controller_telemetry(raw) if raw is not None else None
        if telemetry is not None and telemetry.sm_clock_mhz:
            self._last_clock_mhz = telemetry.sm_clock_mhz
        now = self._clock()
        engine = self._engine
        counters = engine.counters
        with self._lock:
            steps, self._steps = self._steps, []
            ttft, self._ttft = self._ttft, []
            tpot, self._tpot = self._tpot, []
            running, waiting = engine.num_running, engine.num_waiting
            stats = EngineStats(
                timestamp_s=now,
                num_running=running,
                num_waiting=waiting,
                steps=tuple(steps),
                prompt_tokens_total=counters.prompt_tokens,
                generation_tokens_total=counters.generation_tokens,
                requests_total=sum(counters.requests_finished.values()) + running + waiting,
                ttft_s=tuple(ttft),
                tpot_s=tuple(tpot),
                oldest_waiting_s=self._oldest_waiting() if self._oldest_waiting else None,
                quant_level=engine.quant_level,
            )
            decision = self.controller.observe(telemetry, stats, now)
        with self._actuate:
            self._verify_device_knobs(raw, decision.apply)
            if decision.apply:
                self._apply(decision.knobs)
        for sink in self._sinks:
            try:
                sink(decision)
            except Exception:  # a broken sink must not stop control
                log.exception("control loop: decision sink %r failed", sink)
        return decision

    def _apply(self, knobs: Knobs) -> None:
        prev = self._applied
        engine = self._engine
        if prev is None or (
            knobs.max_num_seqs,
            knobs.max_num_batched_tokens,
            knobs.decode_interval_ms,
        ) != (prev.max_num_seqs, prev.max_num_batched_tokens, prev.decode_interval_ms):
            engine.set_limits(
                max_num_seqs=knobs.max_num_seqs,
                max_num_batched_tokens=knobs.max_num_batched_tokens,
                decode_interval_ms=knobs.decode_interval_ms,
            )
        level = knobs.quant_level
        if level is not None and level != self._quant_requested:
            # Requested once; the engine switches at its next step (after building the
            # level if it was never used: seconds, hence run_blocking).
            self._quant_requested = level
            if level != engine.quant_level:
                self._run_blocking(lambda: self._switch_quant(level))
        if knobs.sm_clock_mhz is not None and (
            prev is None or knobs.sm_clock_mhz != prev.sm_clock_mhz
        ):
            # Lock the whole range at the target: the decision is a clock, not a ceiling.
            self._check(
                Knob.SM_CLOCKS,
                self._device.lock_sm_clocks_mhz(knobs.sm_clock_mhz, knobs.sm_clock_mhz),
            )
        if knobs.power_limit_w is not None and (
            prev is None or knobs.power_limit_w != prev.power_limit_w
        ):
            self._check(Knob.POWER_LIMIT, self._device.set_power_limit_w(knobs.power_limit_w))
        self._applied = knobs

    def lock_sm_clock_mhz(self, mhz: int) -> Any:
        """PUT knobs' clock lock, written through the loop so that it is known in force
        (not mistaken for drift); returns the device's ClockLockResult."""
        with self._actuate:
            result = self._device.lock_sm_clocks_mhz(mhz, mhz)
            self._note_in_force(Knob.SM_CLOCKS, result)
            if self._applied is not None and Knob.SM_CLOCKS in self._in_force:
                self._applied = self._applied.with_changes(sm_clock_mhz=mhz)
        return result

    def _verify_device_knobs(self, raw: Telemetry | None, applying: bool) -> None:
        """Compare what the device reads back with what it took; a difference, or a device
        that was lost and is back (a re-initialisation drops its settings), is drift: count
        it, say so, and forget the knob so that the next _apply writes it again. Not while
        the decisions are advice (observe mode): the settings are not this loop's then."""
        if raw is None or raw.device_lost or raw.stale:
            self._device_lost = self._device_lost or (raw is not None and raw.device_lost)
            return
        if not applying:
            return
        if self._device_lost:
            self._device_lost = False
            read_back = {Knob.POWER_LIMIT: raw.power_limit_w, Knob.SM_CLOCKS: raw.sm_clock_lock_mhz}
            for knob, actual in read_back.items():
                # Also what could not be written while it was lost: retried now.
                self._drifted(knob, self._in_force.get(knob), actual, "the device re-initialised")
            return
        for knob, target in list(self._in_force.items()):
            if knob is Knob.POWER_LIMIT:
                actual: Any = raw.power_limit_w
                if actual is None or abs(actual - target) < _POWER_EQUAL_W:
                    continue
                why = "the device reads back another value"
            else:
                # On NVML this is the lock the GPU's own clocks still agree with (NVML
                # cannot read a lock back): the clock it runs at says why not.
                actual = raw.sm_clock_lock_mhz
                if actual == target:
                    continue
                why = f"the device reads back another value; SM clock {raw.sm_clock_mhz} MHz"
            self._drifted(knob, target, actual, why)

    def _drifted(self, knob: Knob, target: Any, actual: Any, why: str) -> None:
        self._in_force.pop(knob, None)
        field = "power_limit_w" if knob is Knob.POWER_LIMIT else "sm_clock_mhz"
        if self._applied is None or getattr(self._applied, field) is None:
            return  # this loop never set it: nothing to re-apply
        self._applied = self._applied.with_changes(**{field: None})
        self.knob_drift[knob.value] = self.knob_drift.get(knob.value, 0) + 1
        message = f"{knob.value} drifted ({why}): set {target}, read back {actual}; re-applying"
        log.warning("control loop: %s", message)
        if self._event_sink is not None:
            data = {"knob": knob.value, "set": target, "read_back": actual, "why": why}
            try:
                self._event_sink("knob_drift", message, data)
            except Exception:  # a broken sink must not stop control
                log.exception("control loop: event sink failed")

    def _note_in_force(self, knob: Knob, result: Any) -> None:
        """Remember what the device took (the clamped target), to verify it later."""
        if knob is Knob.POWER_LIMIT:
            target = getattr(result, "target_w", None)
        else:
            lo = getattr(result, "target_min_mhz", None)
            hi = getattr(result, "target_max_mhz", None)
            target = None if lo is None or hi is None else (lo, hi)
        if getattr(result, "outcome", None) in IN_FORCE and target is not None:
            self._in_force[knob] = target
        else:
            self._in_force.pop(knob, None)

    def _switch_quant(self, level: str) -> None:
        try:
            self._engine.set_quant_level(level)
        except Exception as e:  # an unavailable level must not kill the loop
            log.error("control loop: quantization switch to %s failed: %s", level, e)
            self.apply_failures["quant_level"] = self.apply_failures.get("quant_level", 0) + 1

    def _check(self, knob: Knob, result: Any) -> None:
        outcome = getattr(result, "outcome", None)
        self._note_in_force(knob, result)
        if outcome in (SetOutcome.APPLIED, SetOutcome.UNCHANGED, SetOutcome.OBSERVE_ONLY):
            return
        self.apply_failures[knob.value] = self.apply_failures.get(knob.value, 0) + 1
        log.warning(
            "control loop: %s not applied: %s %s",
            knob.value,
            outcome,
            getattr(result, "detail", ""),
        )

    # ---- the thread ----------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("control loop already started")
        self._stop.clear()
        self._wake.clear()
        self._thread = threading.Thread(target=self._run, name="wattserve-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        next_s = self._clock()
        woken = False
        while True:
            # Cleared before the stop check and the tick: a stop or a policy set after this
            # ends the wait below at once.
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.tick()
            except Exception:  # keep controlling; the next tick starts afresh
                log.exception("control loop: tick failed")
            self.ticks += 1
            now = self._clock()
            # A tick a policy change woke before its time leaves the period's schedule as
            # it was.
            if not woken or now >= next_s:
                next_s += self.period_s
                if next_s < now:
                    next_s = now
            wait_s = max(0.0, next_s - now)
            if self._sleep is None:
                # Ends early on a policy change (or stop): the next tick is now.
                woken = self._wake.wait(wait_s)
            else:
                self._sleep(wait_s)

    def status(self) -> dict:
        """For /v1/status: the controller's state plus what the loop could not apply."""
        with self._lock:
            out = self.controller.status()
        out["apply_failures"] = dict(self.apply_failures)
        out["knob_drift"] = dict(self.knob_drift)
        out["period_s"] = self.period_s
        out["ticks"] = self.ticks
        return out
