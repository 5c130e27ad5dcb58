"""What the controller learns from each observation: a step-latency model per quantization
level, one power model, the measured-over-predicted latency and peak-power ratios, the
workload, and the queue and batch sizes of late. It learns and answers questions about
what it has seen; it decides nothing. It must not import torch or the daemon, read a
clock, or touch a device or an engine.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from wattserve.controller.models import (
    Ewma,
    PowerModel,
    PowerSegment,
    Prediction,
    QuantileRatio,
    StepTimeModel,
    WorkloadEstimator,
)
from wattserve.controller.params import ControllerParams
from wattserve.controller.signals import EngineStats, StepRecord, Telemetry

# The percentile of measured-over-modelled prefill power the peak prediction uses (a few
# 100 ms readings per second: p90 of the last hundred, not their maximum).
PEAK_PERCENTILE = 90.0

# A measured latency is set against the percentile prediction in force only if that was
# noted this recently.
PREDICTION_FRESH_S = 1.0

# A power reading counts towards the peak ratio once the clock has been in force this long
# (before, the reading may be of the clock before).
CLOCK_SETTLED_S = 0.5


class Learner:
    """The learned models and the recent facts they rest on (public: read by the guards and
    the timescales, written only here and through the named methods below)."""

    def __init__(self, params: ControllerParams, sm_clock_max_mhz: int, reference_w: float):
        self.params = params
        self._sm_clock_max_mhz = sm_clock_max_mhz
        self.step_models: dict[str, StepTimeModel] = {}
        # One power model for every level: it is learned all the time, so comparisons
        # between levels never rest on a stale one (levels differ mostly in how long their
        # steps keep the GPU busy, which the step models capture).
        self.power = PowerModel(sm_clock_max_mhz, reference_w)
        self.ttft_ratio = QuantileRatio(default=1.5)
        self.tpot_ratio = QuantileRatio(default=1.3)
        self.peak_ratio = QuantileRatio(default=1.1, window=100)
        # Measured over the model's percentile prediction in force, keyed by (level,
        # clock): how far the model under-predicts what users see there (the adaptive
        # margin). Kept across level switches (each key is one level's) and longer than the
        # ratios above, so that a clock found wanting stays so for a while.
        self.ttft_error = QuantileRatio(default=1.0, window=400, max_age_s=300.0)
        self.tpot_error = QuantileRatio(default=1.0, window=400, max_age_s=300.0)
        self.workload = WorkloadEstimator(
            params.workload.workload_tau_s,
            surge_window_s=params.workload.surge_window_s,
            surge_alpha=params.workload.surge_alpha,
            surge_min_ratio=params.workload.surge_min_ratio,
        )
        self.recent_steps: deque[StepRecord] = deque(maxlen=512)
        # The model's mean predictions in force, smoothed over about a request's life.
        self.pred_ttft_ms = Ewma(5.0)
        self.pred_tpot_ms = Ewma(5.0)
        self.pred_step_ms = Ewma(5.0)  # the unpaced mean step, which sets TPOT's spread
        # The percentile predictions in force (what the SLO checks compared), smoothed alike,
        # and the configuration they were for.
        self.pred_ttft_pct_ms = Ewma(5.0)
        self.pred_tpot_pct_ms = Ewma(5.0)
        self.pred_key: tuple[str, int] | None = None  # (level, clock)
        # The whole configuration predicted (key, caps, decode interval), and since when.
        self.pred_config: tuple | None = None
        self.pred_since_s = math.inf
        self.pred_at_s: float | None = None
        self.waiting_now = 0  # requests queued at the latest observation
        self.running_now = 0  # and running
        # (time, running) with running decreasing: the most running over the last
        # quant_peak_window_s is the first entry (a monotonic queue).
        self.running_peaks: deque[tuple[float, int]] = deque()
        self.slowdown_active = False

    # ---- questions ----------------------------------------

    def step_model(self, level: str) -> StepTimeModel:
        """The level's step model; a new one starts from the most practised other level
        (by the time a new level's first step arrives, the knobs in force already name it)."""
        model = self.step_models.get(level)
        if model is None:
            others = [m for lv, m in self.step_models.items() if lv != level and m.samples > 0]
            if not others:
                model = StepTimeModel(self._sm_clock_max_mhz)
            else:
                model = max(others, key=lambda m: m.samples).as_prior()
            self.step_models[level] = model
        return model

    def trained(self, level: str) -> bool:
        """The level has a model with learning_min_steps steps."""
        model = self.step_models.get(level)
        return model is not None and model.samples >= self.params.learning.learning_min_steps

    @property
    def running_peak(self) -> int:
        """The most requests running at once over the last quant_peak_window_s."""
        return self.running_peaks[0][1] if self.running_peaks else self.running_now

    def peak_ratio_at(self, now_s: float) -> float:
        """Measured 100 ms power over the model's prefill phase, at PEAK_PERCENTILE."""
        return self.peak_ratio.ratio(now_s, PEAK_PERCENTILE)

    def error_factor(self, kind: str, level: str, clock_mhz: int, now_s: float) -> float:
        """The adaptive margin for `kind` ("ttft" or "tpot") at (level, clock): the factor
        a percentile prediction is multiplied by before it is compared with the SLO: the
        split-conformal (1 - margin_alpha) quantile of measured over predicted there
        (pooled where that clock has too few), within [1, margin_max]; 1 (the fixed
        slo_margin alone) while too few have been measured anywhere."""
        window = self.ttft_error if kind == "ttft" else self.tpot_error
        q = window.conformal(now_s, self.params.adaptive_margin.margin_alpha, (level, clock_mhz))
        if q is None:
            return 1.0
        return min(self.params.adaptive_margin.margin_max, max(1.0, q))

    def prefill_lately(self, steps: int) -> bool:
        """Whether any of the last `steps` steps had prefill."""
        return any(s.has_prefill for s in list(self.recent_steps)[-steps:])

    # ---- learning ----------------------------------------

    def learn(
        self,
        telemetry: Telemetry | None,
        stats: EngineStats,
        now_s: float,
        clock_now: int | None,
        *,
        paced: bool,
        tracking: bool,
        since_clock_change_s: float,
        before_step: Callable[[StepRecord, int], None],
    ) -> None:
        """Learn from one observation. clock_now: the clock in force (steps that name none
        ran at it); paced: decode pacing in force; tracking: the controller is tracking
        at one level (only then do measured latencies calibrate the ratios);
        before_step(step, clock) sees each step before its model learns it."""
        usable = telemetry is not None and telemetry.usable
        for step in stats.steps:
            clock = step.sm_clock_mhz or clock_now
            if step.duration_s > 0 and clock:
                before_step(step, clock)
                self.step_model(step.quant_level).learn(step, clock)
            self.recent_steps.append(step)
        self.workload.update(
            now_s,
            stats.requests_total,
            stats.prompt_tokens_total,
            stats.generation_tokens_total,
            stats.steps,
            paced=paced,
        )
        self._learn_latencies(stats, now_s, tracking)
        self.waiting_now = stats.num_waiting
        self.running_now = stats.num_running
        peaks = self.running_peaks
        while peaks and peaks[-1][1] <= stats.num_running:
            peaks.pop()
        peaks.append((now_s, stats.num_running))
        while peaks and now_s - peaks[0][0] > self.params.quant.quant_peak_window_s:
            peaks.popleft()
        if usable:
            assert telemetry is not None
            self._learn_telemetry(telemetry, stats, now_s, clock_now, since_clock_change_s)

    def _learn_latencies(self, stats: EngineStats, now_s: float, tracking: bool) -> None:
        """The measured TTFTs and TPOTs: the percentile ratios and the adaptive margin."""
        # A request's latency spans seconds of operation, so it is compared with the model's
        # recent mean prediction (smoothed over about a request's life), and only while the
        # controller is tracking at one quantization level (not through learning or trials).
        if self.pred_ttft_ms.value is not None and tracking:
            for x in stats.ttft_s:
                self.ttft_ratio.add(now_s, x * 1000.0, self.pred_ttft_ms.value)
            for x in stats.tpot_s:
                # As an excess over the mean in units of the unpaced step (the same ratio
                # when nothing is paced): a paced request's tokens come an interval apart,
                # and only the steps in between (prefill) spread them.
                step_ms = self.pred_step_ms.value or self.pred_tpot_ms.value or 0.0
                excess_ms = x * 1000.0 - (self.pred_tpot_ms.value or 0.0)
                self.tpot_ratio.add(now_s, step_ms + excess_ms, step_ms)
        # Each measured latency over the percentile prediction in force where it was
        # measured, while that prediction is fresh (the clock timescale noted it lately: a
        # guard's clock has no prediction of its own) and no queue is served (a queue's
        # waits are the guards' to answer, not an error of the steady-state model).
        fresh = self.pred_at_s is not None and now_s - self.pred_at_s <= PREDICTION_FRESH_S
        calm = self.waiting_now == 0 and stats.num_waiting == 0
        # A TTFT counts if its request arrived under the configuration predicted; a TPOT
        # (a request's whole life) once that configuration has held margin_settle_s.
        # Only once the level's model has descend_evidence_steps steps: a young model's
        # errors are its youth's, which the clock step's young-model rules cover.
        practised = (
            self.pred_key is not None
            and self.step_model(self.pred_key[0]).samples
            >= self.params.clock.descend_evidence_steps
        )
        if practised and fresh and calm:
            for x in stats.ttft_s:
                if now_s - x >= self.pred_since_s:
                    self.ttft_error.add(
                        now_s, x * 1000.0, self.pred_ttft_pct_ms.value or 0.0, self.pred_key
                    )
            if now_s - self.pred_since_s >= self.params.adaptive_margin.margin_settle_s:
                for x in stats.tpot_s:
                    self.tpot_error.add(
                        now_s, x * 1000.0, self.pred_tpot_pct_ms.value or 0.0, self.pred_key
                    )

    def _learn_telemetry(
        self,
        telemetry: Telemetry,
        stats: EngineStats,
        now_s: float,
        clock_now: int | None,
        since_clock_change_s: float,
    ) -> None:
        """A usable power reading: the hardware slowdown, the power model, the peak ratio."""
        slowdown = telemetry.hw_slowdown or telemetry.thermal_throttle
        if slowdown and not self.slowdown_active:
            # The latency seen under a hardware slowdown says little about the clock
            # commanded: trust the models less so they re-learn quickly, and forget
            # the percentile ratios measured before.
            for m in self.step_models.values():
                m.rls.inflate(10.0)
            self.ttft_ratio.clear()
            self.tpot_ratio.clear()
            self.ttft_error.clear()
            self.tpot_error.clear()
        self.slowdown_active = slowdown
        self._learn_power(telemetry, clock_now)
        # How far short-window readings with prefill run above the model's prefill
        # phase (prefill chunks differ in intensity): calibrates the peak prediction.
        recent = [s for s in stats.steps if s.has_prefill]
        settled = since_clock_change_s >= CLOCK_SETTLED_S
        if recent and settled and telemetry.power_w is not None and clock_now:
            model_peak = self.power.predict_w(clock_now, 0.0, 1.0, telemetry.gpu_temp_c)
            self.peak_ratio.add(now_s, telemetry.power_w, model_peak)

    def _learn_power(self, telemetry: Telemetry, idle_clock: int | None) -> None:
        if telemetry.power_avg_w is None or idle_clock is None:
            return
        window = telemetry.power_avg_window_s
        end = telemetry.timestamp_s
        start = end - window
        segments: list[PowerSegment] = []
        busy = 0.0
        for step in self.recent_steps:
            s0 = max(step.started_at_s, start)
            s1 = min(step.started_at_s + step.duration_s, end)
            if s1 <= s0:
                continue
            overlap = (s1 - s0) / window
            busy += overlap
            clock = step.sm_clock_mhz or idle_clock
            if step.has_prefill:
                segments.append(PowerSegment(overlap, clock, 0.0, 1.0, step.prefill_tokens))
            else:
                segments.append(PowerSegment(overlap, clock, 1.0, 0.0))
        if busy > 1.05:
            return  # overlapping records: not learnable
        idle = max(0.0, 1.0 - busy)
        if idle > 0:
            segments.append(PowerSegment(idle, idle_clock, 0.0, 0.0))
        self.power.learn(segments, telemetry.gpu_temp_c, telemetry.power_avg_w)

    def note_prediction(self, pred: Prediction, now_s: float, interval_ms: float = 0.0) -> None:
        """The prediction for the configuration in force at this observation (at the decode
        interval `interval_ms`): its mean latencies become the reference measured ones are
        compared with, and its percentiles the reference of the adaptive margin."""
        dt = now_s - self.pred_at_s if self.pred_at_s is not None else 0.0
        self.pred_at_s = now_s
        if math.isfinite(pred.mean_ttft_ms) and math.isfinite(pred.mean_tpot_ms):
            self.pred_ttft_ms.add(pred.mean_ttft_ms, dt)
            self.pred_tpot_ms.add(pred.mean_tpot_ms, dt)
            self.pred_step_ms.add(1000.0 * pred.step_s, dt)
        if math.isfinite(pred.ttft_ms) and math.isfinite(pred.tpot_ms):
            key = (pred.quant_level, pred.sm_clock_mhz)
            config = (key, pred.max_num_seqs, pred.max_num_batched_tokens, interval_ms)
            if config != self.pred_config:
                # Another configuration: its prediction, not a blend with the last one's.
                self.pred_ttft_pct_ms.value = self.pred_tpot_pct_ms.value = None
                self.pred_key, self.pred_config, self.pred_since_s = key, config, now_s
            self.pred_ttft_pct_ms.add(pred.ttft_ms, dt)
            self.pred_tpot_pct_ms.add(pred.tpot_ms, dt)

    def forget_latency_calibration(self) -> None:
        """Another level runs: its latencies are not the last one's; calibrate afresh."""
        self.ttft_ratio.clear()
        self.tpot_ratio.clear()
        self.pred_ttft_ms.value = self.pred_tpot_ms.value = None
        self.pred_step_ms.value = None
        self.pred_ttft_pct_ms.value = self.pred_tpot_pct_ms.value = None
        self.pred_key = self.pred_config = None
        self.pred_since_s = math.inf
