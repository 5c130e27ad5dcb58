"""The attach loop: scrape the server, window what changed, feed the control loop, tick it.

Each period it reads the server's /metrics, turns the change since the last scrape into a
window (wattserve.attach.window), hands the engine adapter its queues and counters, gives
the control loop synthetic steps covering the window's busy time (the server's steps are
not visible: their mean duration is the mean inter-token latency, times the modelled
GPU's stretch where the runner books the work on one) and, without a front, the window's
latency samples; then it ticks the control loop, which decides and applies
as in the daemon. Faults never raise: a server that does not answer, metrics missing or
renamed, or an exposition that does not parse put the GPUs back to their recorded
settings (what exit restores), lift the admission cap, say so once in the log and in the
status, and wait for the server to be whole again. A counter that went down (a restart)
rebases the window. Traffic that bypasses the front (the server running more sequences
than the front has in flight) marks the admission knob unreliable. It decides nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from wattserve.attach.admission import Admission
from wattserve.attach.engine import QUANT_NOT_OFFERED, AttachedEngine
from wattserve.attach.gpus import GpuGroup
from wattserve.attach.names import MetricNames
from wattserve.attach.scrape import ExpositionError, ServerSample, read_sample
from wattserve.attach.window import CounterReset, WindowStats, window
from wattserve.daemon.control_loop import ControlLoop
from wattserve.daemon.device.protocol import EngineActivity

log = logging.getLogger(__name__)

# Health values the status shows.
OK = "ok"
SERVER_DOWN = "server_down"
METRICS_MISSING = "metrics_missing"
METRICS_UNREADABLE = "metrics_unreadable"
# The synthetic steps of one window: enough for the models' regression, few enough to be cheap.
MAX_STEPS_PER_WINDOW = 32


def http_fetcher(base_url: str, timeout_s: float = 2.0) -> Callable[[], str]:
    """GET <base_url>/metrics; raises httpx.HTTPError or OSError when it cannot."""
    client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)

    def fetch() -> str:
        response = client.get("/metrics")
        response.raise_for_status()
        return response.text

    return fetch


@dataclass(frozen=True)
class SyntheticStep:
    """The StepStats fields ControlLoop.on_step reads."""

    started_at_s: float
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    kv_bytes_read: int = 0
    quant_level: str | None = None


def synthetic_steps(w: WindowStats, now_s: float, stretch: float = 1.0) -> list[SyntheticStep]:
    """Steps laid end to end before now_s covering the window's busy time, sharing its tokens.

    stretch: the modelled GPU's slow-down of this window's steps at the clock in force
    (1 where the server's own GPU ran them: its measured times already carry the clock).
    """
    tokens = w.prompt_tokens + w.generation_tokens
    if tokens <= 0 or w.itl_mean_s is None or w.itl_mean_s <= 0:
        return []
    count = int(min(MAX_STEPS_PER_WINDOW, max(1, w.duration_s / w.itl_mean_s)))
    busy_s = min(w.duration_s, w.itl_mean_s * max(1.0, w.itl_count / max(1.0, w.running)))
    step_s = busy_s * stretch / count
    prefill = int(round(w.prompt_tokens / count))
    decode = max(1, int(round(w.generation_tokens / count)))
    start = now_s - step_s * count
    return [SyntheticStep(start + i * step_s, step_s, prefill, decode) for i in range(count)]


class AttachRunner:
    """One attached server: scraper, window, bypass watch and the control loop's tick."""

    def __init__(
        self,
        names: MetricNames,
        fetch: Callable[[], str],
        engine: AttachedEngine,
        control: ControlLoop,
        device: GpuGroup,
        *,
        admission: Admission | None = None,
        server_url: str = "",
        period_s: float = 1.0,
        bypass_scrapes: int = 3,
        flops_per_token: float = 0.0,
        weight_bytes_per_step: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if period_s <= 0:
            raise ValueError("attach period_s must be > 0")
        self.names = names
        self._fetch = fetch
        self.engine = engine
        self.control = control
        self.device = device
        self.admission = admission
        self.server_url = server_url
        self.period_s = period_s
        self.bypass_scrapes = max(1, bypass_scrapes)
        self._flops_per_token = flops_per_token
        self._weight_bytes_per_step = weight_bytes_per_step
        self._clock = clock
        self.health = OK
        self.detail = ""
        self.missing: tuple[str, ...] = ()
        self.counter_resets = 0
        self.fault_count = 0
        self.last_window: WindowStats | None = None
        self.last_decision: Any = None
        self._prev: ServerSample | None = None
        self._prev_s = 0.0
        # Totals carried over server restarts, so that the controller sees counters that
        # only go up.
        self._base_prompt = 0.0
        self._base_generation = 0.0
        self._bypass_run = 0
        self._clean_run = 0
        # The modelled GPU's stretch of the last window booked, at the clock decided after
        # it: the clock the next window runs under (1 with NVML, which books nothing).
        self._stretch = 1.0
        self.bypass_detected = False
        self.bypass_excess_seqs = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0

    # ---- one period ------------------------------------------------------------------------

    def step(self) -> Any:
        """Scrape, window, feed and tick once; returns the control decision, or None when
        there was nothing to decide on (first scrape, a restart, a fault)."""
        now = self._clock()
        try:
            text = self._fetch()
        except (httpx.HTTPError, OSError) as e:
            return self._fault(SERVER_DOWN, f"{self.server_url}/metrics: {e}")
        try:
            sample = read_sample(text, self.names)
        except ExpositionError as e:
            return self._fault(METRICS_UNREADABLE, str(e))
        if not sample.complete:
            self.missing = sample.missing
            return self._fault(
                METRICS_MISSING,
                f"{self.names.kind} metrics not found: {', '.join(sample.missing)} "
                "(another server version, or metrics disabled?)",
            )
        self._recovered()
        prev, prev_s = self._prev, self._prev_s
        self._prev, self._prev_s = sample, now
        if prev is None or now <= prev_s:
            return None
        try:
            w = window(prev, sample, now - prev_s)
        except CounterReset as e:
            self.counter_resets += 1
            self._base_prompt += prev.prompt_tokens_total or 0.0
            self._base_generation += prev.generation_tokens_total or 0.0
            log.warning(
                "attach: %s at %s: the server restarted; windows start again", e, self.server_url
            )
            return None
        self.last_window = w
        steps = self._feed(w, now)
        self._watch_bypass(w)
        decision = self.control.tick()
        self.last_decision = decision
        # After the decision: the virtual GPU prices the window's work at the clock now in
        # force (booked before, the first window ran at the GPU's default clock, over the
        # budget, before the controller had decided anything).
        self._book(w, steps)
        return decision

    def _feed(self, w: WindowStats, now: float) -> list[SyntheticStep]:
        self.engine.observe(
            w.running,
            w.waiting,
            self._base_prompt + (self._prev.prompt_tokens_total or 0.0),  # type: ignore[union-attr]
            self._base_generation + (self._prev.generation_tokens_total or 0.0),  # type: ignore[union-attr]
        )
        steps = synthetic_steps(w, now, self._stretch)
        for s in steps:
            self.control.on_step(s)
        if self.admission is None:
            # No front: the server's own histograms are the only latencies there are.
            for ttft in w.ttft_samples_s:
                self.control.record_ttft_s(ttft)
            for itl in w.itl_samples_s:
                self.control.record_tpot_s(itl)
        return steps

    def _book(self, w: WindowStats, steps: list[SyntheticStep]) -> None:
        """The virtual GPU prices the server's measured work (NVML ignores the booking)."""
        if self._flops_per_token <= 0 or not steps:
            return
        tokens = w.prompt_tokens + w.generation_tokens
        busy_s = sum(s.duration_s for s in steps) / self._stretch  # as the server measured it
        server_steps = busy_s / w.itl_mean_s  # type: ignore[operator]
        extra_s = self.device.record_engine_step(
            EngineActivity(
                step_duration_s=busy_s,
                prefill_tokens=int(w.prompt_tokens),
                decode_tokens=int(w.generation_tokens),
                weight_bytes_read=int(self._weight_bytes_per_step * server_steps),
                flops=self._flops_per_token * tokens,
            )
        )
        # The controller's step model then sees what a slower clock costs, as it would on
        # a GPU the server runs on (this server is not slowed: the GPU is modelled).
        self._stretch = (busy_s + extra_s) / busy_s if busy_s > 0 else 1.0

    def _watch_bypass(self, w: WindowStats) -> None:
        if self.admission is None:
            return
        excess = w.running + w.waiting - self.admission.in_flight_seqs
        self.bypass_excess_seqs = max(0.0, excess)
        if excess > 0:
            self._bypass_run += 1
            self._clean_run = 0
            if self._bypass_run >= self.bypass_scrapes and not self.bypass_detected:
                self.bypass_detected = True
                log.warning(
                    "attach: traffic bypasses the front: the server runs %d more sequences than "
                    "the front has in flight; the admission cap is unreliable",
                    int(excess),
                )
        else:
            self._clean_run += 1
            self._bypass_run = 0
            if self.bypass_detected and self._clean_run >= self.bypass_scrapes:
                self.bypass_detected = False
                log.warning("attach: no more traffic bypasses the front")

    def _fault(self, health: str, detail: str) -> None:
        if health != self.health:
            self.fault_count += 1
            log.error("attach: %s: %s; GPUs back to their recorded settings", health, detail)
            self._hold_safe()
        self.health, self.detail = health, detail
        self._prev = None  # the next good scrape starts a new window
        return None

    def _hold_safe(self) -> None:
        """What exit restores, now: the GPUs' recorded settings and no admission cap."""
        try:
            self.device.restore_original_settings()
        except Exception:  # restoring must not kill the loop; the next fault tries again
            log.exception("attach: restoring the GPUs' settings failed")
        self.engine.set_limits(max_num_seqs=self.control.controller.engine.max_num_seqs_max)

    def _recovered(self) -> None:
        if self.health != OK:
            log.warning("attach: %s metrics readable again; control resumes", self.names.kind)
            # The cap lifted at the fault, back to the last decision's (the control loop
            # writes limits only when they change). The GPUs' settings come back by the
            # loop's drift check: it reads them back and re-applies.
            last = self.last_decision
            if last is not None and last.apply:
                self.engine.set_limits(max_num_seqs=last.knobs.max_num_seqs)
        self.health, self.detail, self.missing = OK, "", ()

    # ---- the thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="wattserve-attach", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # keep going; the next period starts afresh
                log.exception("attach: period failed")
            self.ticks += 1
            self._stop.wait(self.period_s)

    # ---- status ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        w = self.last_window
        adm = self.admission
        out: dict[str, Any] = {
            "attached": {
                "server_url": self.server_url,
                "server_kind": self.names.kind,
                "health": self.health,
                "detail": self.detail,
                "missing_metrics": list(self.missing),
                "counter_resets": self.counter_resets,
                "gpus": len(self.device.devices),
            },
            "window": None
            if w is None
            else {
                "running": w.running,
                "waiting": w.waiting,
                "prompt_tok_s": w.prompt_tok_s,
                "generation_tok_s": w.generation_tok_s,
                "kv_usage": w.kv_usage,
                "ttft_p50_s": w.ttft_p50_s,
                "ttft_p99_s": w.ttft_p99_s,
                "itl_mean_s": w.itl_mean_s,
                "itl_p99_s": w.itl_p99_s,
            },
            "knobs": {
                "sm_clock": "per GPU, the same on every GPU of the server",
                "power_limit": "per GPU, the budget split evenly",
                "admission": None
                if adm is None
                else {
                    "max_num_seqs": adm.max_num_seqs,
                    "in_flight_seqs": adm.in_flight_seqs,
                    "waiting_requests": adm.waiting_requests,
                    "reliable": not self.bypass_detected,
                },
                "quantization": QUANT_NOT_OFFERED,
            },
            "bypass": {"detected": self.bypass_detected, "excess_seqs": self.bypass_excess_seqs},
            "controller": self.control.status(),
        }
        return out
