"""`wattserve bench control`: the feedback controller against three baselines, closed loop
on the virtual GPU, over seeded scenarios; per scenario and system: SLO attainment, p99
TTFT and TPOT, J per output token, seconds over budget, peak temperature, knob changes.

Two engines. `--engine model` (default): an engine model in simulated time: the real
scheduler and KV-cache manager (plain Python), step times from a linear fit per
quantization level calibrated on the real engine's measured steps on this CPU (kept in
the cache, `--recalibrate` to measure again), booked on the virtual GPU with a SimClock,
so minutes of load take seconds. `--engine real`: the real engine on this CPU in wall
time with the virtual GPU stretching its steps (short scenarios only), the controller's
speed table measured on the spot as the daemon's comes from bench quant run where it
serves (the engine model's comes from its calibration). Both drive the
daemon's own ControlLoop. Baselines, same arrivals: max clock with fixed batch caps (the
uncontrolled engine), a static power cap at the budget, and a PI(D) loop on power only.
Writes docs/control-<scenario>.png and docs/control-summary.png; the last line printed
is one JSON object. Prompts are token counts (the engine model needs no text; the real
engine reads windows of the Python licence text, as bench engine does).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from controller.models import percentile_of
from controller.policy import ControlMode, Policy

CALIBRATION_VERSION = 1
PERIOD_S = 0.25  # the control loop period (and every baseline's)
DEFAULT_LEVELS = ("fp32", "bf16", "int8")

# ---- calibration: the real engine's step times, per quantization level ------------------


@dataclass(frozen=True)
class LevelFit:
    """Step time of one level on this CPU: t = base + per-token costs, plus noise."""

    base_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float
    noise_cv: float
    weight_bytes: int
    prepare_s: float
    samples: int
    ppl_increase_pct: float | None = None
    steps: tuple = ()  # the measured (prefill, decode, context, seconds) rows, for refits

    def step_s(self, prefill: int, decode: int, context: int) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill
            + self.per_decode_token_s * decode
            + self.per_context_token_s * context
        )


@dataclass(frozen=True)
class Calibration:
    model: str
    dtype: str
    threads: int
    full_precision: str
    shape: dict
    kv_bytes_per_token: int
    block_size_tokens: int
    levels: dict[str, LevelFit]
    measured_at: str

    def to_json(self) -> str:
        d = asdict(self)
        d["version"] = CALIBRATION_VERSION
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration | None:
        d = json.loads(text)
        if d.pop("version", None) != CALIBRATION_VERSION:
            return None
        d["levels"] = {k: LevelFit(**v) for k, v in d["levels"].items()}
        return cls(**d)


def calibration_path(cache_dir: Path, model: str, dtype: str, threads: int) -> Path:
    return Path(cache_dir) / "control" / f"engine-{model}-{dtype}-t{threads}.json"


def _fit(rows: list[list[float]]) -> tuple[list[float], float, int]:
    """t = base + a * prefill + b * decode tokens, least squares on *relative* error (a 10 ms
    step counts as much as a 1 s one) with non-negative coefficients, refitted without the
    steps that ran over 1.5x the fit (a neighbour on the shared CPU, not the engine). The
    attention's context cost is folded into the per-decode-token cost: on this model it is
    small, and its column is too collinear with the decode count to separate from noisy
    timings. Returns (base, per prefill, per decode, per context = 0), cv, steps kept."""
    import numpy as np

    x = np.array([[1.0, p, d] for p, d, _, _ in rows])
    y = np.array([t for *_, t in rows])
    keep = np.ones(len(rows), dtype=bool)
    scale = y.copy()
    coef = np.zeros(3)
    for _ in range(8):
        xs, ys = x[keep] / scale[keep, None], y[keep] / scale[keep]
        cols = list(range(3))
        while True:
            sol, *_ = np.linalg.lstsq(xs[:, cols], ys, rcond=None)
            neg = [cols[i] for i, v in enumerate(sol) if v < 0]
            if not neg:
                break
            cols = [c for c in cols if c not in neg]
        coef = np.zeros(3)
        coef[cols] = sol
        pred = np.maximum(x @ coef, 1e-6)
        new_keep = y <= pred * 1.5
        if (new_keep == keep).all() and np.allclose(scale, pred):
            break
        keep, scale = new_keep, pred
    pred = np.maximum(x[keep] @ coef, 1e-9)
    cv = float(np.std(y[keep] / pred - 1.0))
    return [float(v) for v in coef] + [0.0], cv, int(keep.sum())


def refit(cal: Calibration) -> Calibration:
    """The same measurements fitted again (after a change to _fit)."""
    import dataclasses

    levels = {}
    for name, lv in cal.levels.items():
        coef, cv, kept = _fit([list(r) for r in lv.steps])
        levels[name] = dataclasses.replace(
            lv,
            base_s=coef[0],
            per_prefill_token_s=coef[1],
            per_decode_token_s=coef[2],
            per_context_token_s=coef[3],
            noise_cv=cv,
            samples=kept,
        )
    return dataclasses.replace(cal, levels=levels)


def calibrate(model: str, levels: tuple[str, ...], dtype: str, threads: int | None) -> Calibration:
    """Measure the real engine's steps at each level over a spread of batch shapes."""
    import torch

    from bench.engine import corpus_token_ids, corpus_window
    from bench.quant import eval_text_file, perplexity
    from daemon.config import default_cache_dir
    from daemon.engine.engine import Engine, EngineOptions
    from daemon.engine.loader import load_model
    from daemon.engine.request import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model, default_cache_dir(), dtype)
    engine = Engine(
        loaded,
        EngineOptions(
            kv_cache_bytes=1 << 30,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            quantization_levels=levels,
        ),
    )
    kv_bpt = engine.kv_spec.bytes_per_block // engine.kv_spec.block_size_tokens
    ids = corpus_token_ids(engine.tokenizer, 8192)
    text_ids = engine.tokenize(eval_text_file().read_text(errors="replace"))[:1024]
    steps: list[Any] = []
    engine.add_step_hook(steps.append)
    rng = random.Random(0)
    # (requests, prompt tokens, new tokens): decode batches 1..64, contexts short to long,
    # prefill chunks alone and mixed with decodes.
    shapes = [(1, 24, 24), (4, 64, 16), (8, 300, 10), (16, 96, 12), (32, 48, 8), (64, 24, 6)]
    shapes += [(2, 500, 3), (12, 200, 8), (2, 32, 16), (24, 64, 8)]
    fits: dict[str, LevelFit] = {}
    base_ppl = None
    for level in levels:
        t0 = time.perf_counter()
        engine.set_quant_level(level)
        prepare_s = time.perf_counter() - t0
        engine.generate([ids[:8]], SamplingParams(max_tokens=4, temperature=0.0))  # applies it
        ppl = perplexity(engine.model, text_ids)
        base_ppl = base_ppl or ppl
        steps.clear()
        for n, prompt, new in shapes:
            prompts = [corpus_window(ids, prompt, rng) for _ in range(n)]
            params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
            engine.generate(prompts, params)
        rows = [
            [s.prefill_tokens, s.decode_tokens, s.kv_bytes_read // kv_bpt, round(s.duration_s, 6)]
            for s in steps
        ]
        coef, cv, kept = _fit(rows)
        fits[level] = LevelFit(
            base_s=coef[0],
            per_prefill_token_s=coef[1],
            per_decode_token_s=coef[2],
            per_context_token_s=coef[3],
            noise_cv=cv,
            weight_bytes=engine.model.level_bytes(level),
            prepare_s=prepare_s,
            samples=kept,
            ppl_increase_pct=round(100.0 * (ppl / base_ppl - 1.0), 3),
            steps=tuple(tuple(r) for r in rows),
        )
        print(
            f"calibration {level}: t = {coef[0] * 1e3:.2f} ms + {coef[1] * 1e3:.3f} ms/prefill "
            f"+ {coef[2] * 1e3:.3f} ms/decode + {coef[3] * 1e6:.3f} us/context token "
            f"(cv {cv:.2f}, {kept}/{len(rows)} steps); ppl {ppl:.3f}; built in {prepare_s:.1f} s",
            flush=True,
        )
    s = engine.model.shape
    return Calibration(
        model=loaded.name,
        dtype=dtype,
        threads=torch.get_num_threads(),
        full_precision=engine.model.full_precision_level,
        shape={
            "num_layers": s.num_layers,
            "hidden_size": s.hidden_size,
            "num_heads": s.num_heads,
            "num_kv_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "intermediate_size": s.intermediate_size,
            "vocab_size": s.vocab_size,
        },
        kv_bytes_per_token=kv_bpt,
        block_size_tokens=engine.kv_spec.block_size_tokens,
        levels=fits,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


# ---- the engine model ----------------------------------------------------------------


@dataclass
class SimRequest:
    rid: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    generated: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None:
            return None
        if self.generated <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.generated - 1)


class SimulatedEngine:
    """Continuous batching in simulated time: the real Scheduler and KV cache decide each
    step; its duration comes from the calibration (with seeded noise), and it is booked on
    the device, whose clock stretch advances the SimClock too."""

    def __init__(self, cal: Calibration, level: str, clock, device, seed: int) -> None:
        from daemon.engine.engine import EngineCounters
        from daemon.engine.kv_cache import KVCacheManager
        from daemon.engine.model import ModelShape
        from daemon.engine.scheduler import EngineLimits, Scheduler

        self.cal = cal
        self._clock = clock
        self._device = device
        self._rng = random.Random(seed)
        self.shape = ModelShape(**cal.shape, rms_norm_eps=1e-5, max_position_embeddings=8192)
        self.kv = KVCacheManager(4096, cal.block_size_tokens)
        self.scheduler = Scheduler(self.kv)
        self._limits = EngineLimits(64, 512)
        self._level = level
        self._quant_target = level
        self._prepared = {level}
        self._switch_at_s: float | None = None
        self.counters = EngineCounters()
        self._requests: dict[str, SimRequest] = {}
        self._hooks: list[Callable[[Any], None]] = []
        self.finished: list[SimRequest] = []
        self.first_tokens: list[SimRequest] = []
        self._step_ids = 0
        # A mechanism the real engine does not have, for bench/control_ceiling.py's
        # hindsight study only (off here): per-phase clocks (steps with prefill at one
        # locked clock, decode-only steps at another). Decode pacing is the engines' own
        # knob (EngineLimits.decode_interval_ms), as in daemon.engine.Engine.
        self.phase_clocks_mhz: tuple[int, int] | None = None  # (prefill, decode-only)
        self._last_step_s = -math.inf
        self._last_decode_only = False

    # the knobs, as the real engine offers them
    @property
    def limits(self):
        return self._limits

    def set_limits(self, max_num_seqs=None, max_num_batched_tokens=None, decode_interval_ms=None):
        from daemon.engine.scheduler import EngineLimits

        self._limits = EngineLimits(
            max_num_seqs or self._limits.max_num_seqs,
            max_num_batched_tokens or self._limits.max_num_batched_tokens,
            self._limits.decode_interval_ms if decode_interval_ms is None else decode_interval_ms,
        )
        return self._limits

    @property
    def quant_level(self) -> str:
        return self._level

    def set_quant_level(self, level: str) -> str:
        if level not in self.cal.levels:
            raise ValueError(f"level {level!r} not calibrated")
        if level == self._quant_target:
            return level
        self._quant_target = level
        # A level not built yet lands after its measured build time (the real engine
        # builds it on the caller's thread and keeps stepping at the old level meanwhile).
        build_s = 0.0 if level in self._prepared else self.cal.levels[level].prepare_s
        self._switch_at_s = self._clock() + build_s
        return level

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def oldest_waiting_s(self) -> float | None:
        if not self.scheduler.waiting:
            return None
        now = self._clock()
        return max(now - self._requests[s.seq_id].arrival_s for s in self.scheduler.waiting)

    def add_step_hook(self, hook: Callable[[Any], None]) -> None:
        self._hooks.append(hook)

    def add_request(self, req: SimRequest) -> None:
        from daemon.engine.scheduler import Sequence

        self._requests[req.rid] = req
        self.scheduler.add(Sequence(req.rid, [1] * req.prompt_tokens))
        self.counters.prompt_tokens += req.prompt_tokens

    def has_work(self) -> bool:
        return bool(self._requests)

    def resume_at_s(self) -> float | None:
        """When a paced engine may step again (None: not pacing now)."""
        interval_s = self._limits.decode_interval_ms / 1000.0
        if interval_s <= 0 or not self._last_decode_only or self.scheduler.waiting:
            return None
        at = self._last_step_s + interval_s
        return at if at > self._clock() else None

    def step(self):
        from daemon.coupling import step_flops
        from daemon.device.protocol import EngineActivity
        from daemon.engine.engine import StepStats

        now = self._clock()
        if self.resume_at_s() is not None:
            return None
        if self._switch_at_s is not None and now >= self._switch_at_s:
            self._level = self._quant_target
            self._prepared.add(self._level)
            self._switch_at_s = None
        plan = self.scheduler.schedule(self._limits)
        if plan.is_empty:
            return None
        decode = sum(1 for c in plan.chunks if c.num_tokens == 1)
        prefill = plan.num_tokens - decode
        self._last_step_s, self._last_decode_only = now, prefill == 0
        if self.phase_clocks_mhz is not None:
            mhz = self.phase_clocks_mhz[0 if prefill else 1]
            self._device.lock_sm_clocks_mhz(mhz, mhz)
        ctx = sum(c.start + c.num_tokens for c in plan.chunks)
        fit = self.cal.levels[self._level]
        noise = math.exp(self._rng.gauss(0.0, fit.noise_cv) - fit.noise_cv**2 / 2)
        cpu_s = max(fit.step_s(prefill, decode, ctx), 1e-4) * noise
        kv_read = ctx * self.cal.kv_bytes_per_token
        stats = StepStats(
            step=self._step_ids,
            started_at_s=now,
            duration_s=cpu_s,
            prefill_tokens=prefill,
            decode_tokens=decode,
            num_running=0,
            num_waiting=0,
            kv_blocks_used=0,
            kv_blocks_total=self.kv.num_blocks,
            num_preempted=len(plan.preempted),
            num_finished=0,
            weight_bytes=fit.weight_bytes,
            kv_bytes_read=kv_read,
            quant_level=self._level,
        )
        self._step_ids += 1
        activity = EngineActivity(
            step_duration_s=cpu_s,
            prefill_tokens=prefill,
            decode_tokens=decode,
            weight_bytes_read=fit.weight_bytes,
            kv_bytes_read=kv_read,
            flops=step_flops(self.shape, stats, self.cal.kv_bytes_per_token),
        )
        extra_s = self._device.record_engine_step(activity)
        self._clock.advance(cpu_s + extra_s)
        end = self._clock()
        sampled = {c.seq.seq_id: 1 for c in plan.chunks if c.samples}
        self.scheduler.commit(plan, sampled)
        self.counters.steps += 1
        self.counters.preemptions += len(plan.preempted)
        finished = 0
        for rid in sampled:
            req = self._requests[rid]
            self.counters.generation_tokens += 1
            req.generated += 1
            if req.first_token_s is None:
                req.first_token_s = end
                self.first_tokens.append(req)
            if req.generated >= req.output_tokens:
                req.finish_s = end
                self.scheduler.finish(rid)
                del self._requests[rid]
                self.counters.requests_finished["length"] += 1
                self.finished.append(req)
                finished += 1
        for hook in self._hooks:
            hook(stats)
        return stats


# ---- workloads and scenarios ---------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """Load over time (fraction of capacity), the budget and inlet temperature over time."""

    name: str
    duration_s: float
    load: Callable[[float], float]
    budget_w: Callable[[float], float]
    ambient_c: Callable[[float], float] = lambda t: 25.0
    seed: int = 0
    budget_steps_s: tuple[float, ...] = ()


def make_scenarios(
    duration_s: float, budget_w: float, step_budget_w: float, low_budget_w: float
) -> dict[str, Scenario]:
    d = duration_s

    def steady(x: float) -> Callable[[float], float]:
        return lambda t: x

    def burst(t: float) -> float:
        return 1.4 if (t % 60.0) >= 45.0 else 0.3  # 15 s bursts every minute

    def diurnal(t: float) -> float:
        return 0.1 + 0.7 * math.sin(math.pi * t / d) ** 2

    def stepped(low_w: float) -> Callable[[float], float]:
        return lambda t: low_w if d / 3 <= t < 2 * d / 3 else budget_w

    def ambient(t: float) -> float:
        return 25.0 + 45.0 * min(1.0, max(0.0, (t - 0.15 * d) / (0.5 * d)))

    flat = steady(0.6)
    return {
        "steady30": Scenario("steady30", d, steady(0.3), lambda t: budget_w, seed=1),
        "steady60": Scenario("steady60", d, flat, lambda t: budget_w, seed=2),
        "steady80": Scenario("steady80", d, steady(0.8), lambda t: budget_w, seed=3),
        "burst": Scenario("burst", d, burst, lambda t: budget_w, seed=4),
        "diurnal": Scenario("diurnal", d, diurnal, lambda t: budget_w, seed=5),
        "budget_step": Scenario(
            "budget_step",
            d,
            flat,
            stepped(step_budget_w),
            seed=6,
            budget_steps_s=(d / 3, 2 * d / 3),
        ),
        # Below the device's power-limit minimum: only the controller's clock can hold it.
        "budget_step_low": Scenario(
            "budget_step_low",
            d,
            flat,
            stepped(low_budget_w),
            seed=6,
            budget_steps_s=(d / 3, 2 * d / 3),
        ),
        "ambient": Scenario("ambient", d, flat, lambda t: budget_w, ambient, seed=7),
    }


@dataclass(frozen=True)
class RequestMix:
    prompt_median_tokens: float = 96.0
    prompt_sigma: float = 0.6
    prompt_min_tokens: int = 16
    prompt_max_tokens: int = 400
    output_min_tokens: int = 32
    output_max_tokens: int = 128

    @property
    def mean_output_tokens(self) -> float:
        return (self.output_min_tokens + self.output_max_tokens) / 2


def arrivals(
    scenario: Scenario, capacity_req_s: float, mix: RequestMix
) -> list[tuple[float, int, int]]:
    """(time, prompt tokens, output tokens) by thinning a Poisson process at the peak rate."""
    rng = random.Random(scenario.seed)
    peak = max(scenario.load(t) for t in _grid(scenario.duration_s)) * capacity_req_s
    out = []
    t = 0.0
    while peak > 0:
        t += rng.expovariate(peak)
        if t >= scenario.duration_s:
            break
        keep = rng.random() < scenario.load(t) * capacity_req_s / peak
        prompt = _prompt_tokens(rng, mix)
        output = rng.randint(mix.output_min_tokens, mix.output_max_tokens)
        if keep:
            out.append((t, prompt, output))
    return out


def _prompt_tokens(rng: random.Random, mix: RequestMix) -> int:
    """One prompt length: log-normal around the median, clipped to the mix's range."""
    drawn = rng.lognormvariate(math.log(mix.prompt_median_tokens), mix.prompt_sigma)
    return int(min(max(drawn, mix.prompt_min_tokens), mix.prompt_max_tokens))


def _grid(duration_s: float) -> list[float]:
    return [duration_s * i / 1000 for i in range(1001)]


# ---- the systems compared ------------------------------------------------------------


class System:
    """What every compared system offers the runner; baselines override what they use."""

    name = "system"

    def __init__(self, engine, device, clock) -> None:
        self.engine = engine
        self.device = device
        self.clock = clock
        self.knob_changes = 0

    def on_step(self, stats) -> None:
        pass

    def record_ttft_s(self, ttft_s: float) -> None:
        pass

    def record_tpot_s(self, tpot_s: float) -> None:
        pass

    def set_budget_w(self, budget_w: float) -> None:
        pass

    def tick(self) -> dict:
        """One control period; returns the knobs for the timeline."""
        return {}


class MaxClock(System):
    """The uncontrolled engine: default power limit, clocks unlocked (top), fixed caps."""

    name = "max_clock"


class StaticCap(System):
    """A board power limit at the budget (clamped to the device's range); nothing else."""

    name = "static_cap"

    def __init__(self, engine, device, clock, budget_w: float) -> None:
        super().__init__(engine, device, clock)
        self.set_budget_w(budget_w)

    def set_budget_w(self, budget_w: float) -> None:
        self.device.set_power_limit_w(budget_w)
        self.knob_changes += 1


class PidOnPower(System):
    """A PI loop on measured power only: the SM clock tracks power to 95 % of the budget
    (conditional-integration anti-windup). It knows nothing of latency or batches."""

    name = "pid_power"

    def __init__(self, engine, device, clock, budget_w: float, ladder: tuple[int, ...]) -> None:
        super().__init__(engine, device, clock)
        self.budget_w = budget_w
        self.ladder = ladder
        self.kp, self.ki = 0.8, 1.5  # per unit of budget error, in units of the clock range
        self.integral = 1.0  # start at the top clock
        self.clock_mhz = ladder[-1]
        self._last_s: float | None = None

    def set_budget_w(self, budget_w: float) -> None:
        self.budget_w = budget_w

    def tick(self) -> dict:
        t = self.device.read()
        now = self.clock()
        dt = PERIOD_S if self._last_s is None else max(now - self._last_s, 1e-3)
        self._last_s = now
        power = t.power_w or 0.0
        err = (0.95 * self.budget_w - power) / self.budget_w
        u = self.integral + self.kp * err
        if 0.0 < u < 1.0 or (u >= 1.0 and err < 0) or (u <= 0.0 and err > 0):
            self.integral = min(1.0, max(0.0, self.integral + self.ki * err * dt))
            u = self.integral + self.kp * err
        u = min(1.0, max(0.0, u))
        lo, hi = self.ladder[0], self.ladder[-1]
        target = lo + u * (hi - lo)
        i = bisect.bisect_right(self.ladder, target) - 1
        mhz = self.ladder[max(i, 0)]
        if mhz != self.clock_mhz:
            self.device.lock_sm_clocks_mhz(mhz, mhz)
            self.clock_mhz = mhz
            self.knob_changes += 1
        return {"sm_clock_mhz": mhz}


class FixedSetting(System):
    """One quantization level and one locked clock for the whole run, with the board limit
    at the budget: the points the hindsight reference searches over. For the ceiling
    study, optionally a second clock for decode-only steps and a decode pacing interval
    (mechanisms of the engine model only)."""

    name = "fixed"

    def __init__(
        self,
        engine,
        device,
        clock,
        budget_w: float,
        level: str,
        mhz: int,
        decode_mhz: int | None = None,
        decode_interval_ms: float = 0.0,
    ) -> None:
        super().__init__(engine, device, clock)
        engine.set_quant_level(level)
        device.lock_sm_clocks_mhz(mhz, mhz)
        if decode_mhz is not None and decode_mhz != mhz:
            engine.phase_clocks_mhz = (mhz, decode_mhz)
        engine.set_limits(decode_interval_ms=decode_interval_ms)
        self.set_budget_w(budget_w)

    def set_budget_w(self, budget_w: float) -> None:
        self.device.set_power_limit_w(budget_w)


def best_static(
    scenario: Scenario,
    cal: Calibration,
    capacity_req_s: float,
    mix: RequestMix,
    policy: Policy,
    levels: tuple[str, ...],
    start_level: str,
    clocks_mhz: tuple[int, ...] = (345, 495, 645, 795, 945, 1095, 1245, 1395, 1680, 1980),
) -> tuple[RunResult, str]:
    """Hindsight reference, not a controller: every (level, clock) pair run on the same
    arrivals; the one with the least J/token among those with >= 99 % attainment (else the
    best attainment) and within the budget's limit. It knows the whole trace in advance."""
    best: tuple[tuple, RunResult, str] | None = None
    for level in levels:
        for mhz in clocks_mhz:
            res = run_model(
                scenario,
                f"fixed:{level}:{mhz}",
                cal,
                capacity_req_s,
                mix,
                policy,
                levels,
                start_level,
            )
            r = summarize(res, policy, scenario)
            ok = (r["attainment_pct"] or 0) >= 99.0
            key = (not ok, r["j_per_token"] if ok else -(r["attainment_pct"] or 0))
            if best is None or key < best[0]:
                best = (key, res, f"{level} @ {mhz} MHz")
    assert best is not None
    _, res, label = best
    res.system = "best_static"
    return res, label


class Controlled(System):
    """The daemon's ControlLoop and Controller, in auto mode."""

    name = "controller"

    def __init__(
        self,
        engine,
        device,
        clock,
        policy: Policy,
        cal: Calibration,
        levels: tuple[str, ...],
        *,
        inline: bool,
        name: str = "controller",
        decode_interval_max_ms: float = 1000.0,
        speeds: dict[str, dict[str, float]] | None = None,
    ) -> None:
        from controller.controller import Controller
        from controller.policy import Knobs, QuantOption
        from controller.signals import EngineConstraints
        from daemon.control_loop import ControlLoop, device_constraints

        super().__init__(engine, device, clock)
        self.name = name
        telemetry = device.read()
        limits = engine.limits

        # What bench quant's table gives the daemon: quality, weight bytes, batch-16 decode
        # and prefill speed (`speeds`, measured on this machine, or the calibration's).
        def speed(lv: str) -> tuple[float, float]:
            if speeds:
                return speeds[lv]["decode_tok_s_bs16"], speeds[lv]["prefill_tok_s"]
            fit = cal.levels[lv]
            return 16 / fit.step_s(0, 16, 16 * 200), 256 / fit.step_s(256, 0, 256)

        options = tuple(
            QuantOption(
                lv,
                cal.levels[lv].ppl_increase_pct,
                cal.levels[lv].weight_bytes,
                *speed(lv),
            )
            for lv in levels
        )

        ctl = Controller(
            policy,
            device_constraints(device, telemetry),
            EngineConstraints(
                max_num_seqs_max=limits.max_num_seqs,
                max_num_batched_tokens_max=limits.max_num_batched_tokens,
                max_num_batched_tokens_min=cal.block_size_tokens,
                quant_options=options,
                full_precision_level=cal.full_precision,
                decode_interval_max_ms=decode_interval_max_ms,
            ),
            Knobs(limits.max_num_seqs, limits.max_num_batched_tokens, engine.quant_level),
        )
        extra: dict[str, Any] = {}
        if inline:
            extra["run_blocking"] = lambda fn: fn()
            extra["step_clock_mhz"] = lambda: device.read().sm_clock_mhz
            extra["oldest_waiting_s"] = engine.oldest_waiting_s
        self.loop = ControlLoop(
            ctl,
            engine,
            device,
            kv_bytes_per_token=cal.kv_bytes_per_token,
            period_s=PERIOD_S,
            clock=clock,
            **extra,
        )
        self._last_knobs = None

    def on_step(self, stats) -> None:
        self.loop.on_step(stats)

    def record_ttft_s(self, ttft_s: float) -> None:
        self.loop.record_ttft_s(ttft_s)

    def record_tpot_s(self, tpot_s: float) -> None:
        self.loop.record_tpot_s(tpot_s)

    def set_budget_w(self, budget_w: float) -> None:
        # The same path a PUT /v1/control/policy takes.
        self.loop.set_policy(self.loop.controller.policy.with_changes(power_budget_w=budget_w))

    def tick(self) -> dict:
        d = self.loop.tick()
        self.knob_changes += len(d.changed)
        return {
            "sm_clock_mhz": d.knobs.sm_clock_mhz,
            "max_num_seqs": d.knobs.max_num_seqs,
            "max_num_batched_tokens": d.knobs.max_num_batched_tokens,
            "decode_interval_ms": d.knobs.decode_interval_ms,
            "quant_level": self.engine.quant_level,
            "state": d.state.value,
            "reason_code": d.reason_code.value,
            "effective_budget_w": d.effective_budget_w,
        }


# ---- running one (scenario, system) ------------------------------------------------------------


@dataclass
class Sample:
    t_s: float
    power_w: float  # mean over the span since the previous sample (energy counter)
    budget_w: float
    temp_c: float
    sm_clock_mhz: int
    running: int
    waiting: int
    knobs: dict = field(default_factory=dict)


@dataclass
class RunResult:
    scenario: str
    system: str
    requests: list[tuple[float, float | None, float | None, int]]  # arrival, ttft, tpot, out
    samples: list[Sample]
    energy_j: float
    output_tokens: int
    duration_s: float
    knob_changes: int
    reasons: dict[str, int] = field(default_factory=dict)


def _energy_sample(device):
    """A snapshot and (the 100 ms boundary its energy counter stands at, the counter J)."""
    t = device.read()
    period = 0.1
    boundary = math.floor(t.timestamp_s / period + 1e-9) * period
    return t, (boundary, t.energy_j or 0.0)


def run_model(
    scenario: Scenario,
    system_name: str,
    cal: Calibration,
    capacity_req_s: float,
    mix: RequestMix,
    policy: Policy,
    levels: tuple[str, ...],
    start_level: str,
    drain_s: float = 60.0,
) -> RunResult:
    """One scenario with one system on the engine model, in simulated time."""
    from daemon.config import DeviceConfig
    from daemon.device import SimClock, open_device

    clock = SimClock(0.0)
    with tempfile.TemporaryDirectory() as state_dir:
        device = open_device(
            DeviceConfig(
                backend="virtual",
                mode="control",
                state_dir=Path(state_dir),
                virtual_seed=scenario.seed,
                virtual_ambient_c=scenario.ambient_c(0.0),
            ),
            clock=clock,
        )
        try:
            return _run_model(
                scenario,
                system_name,
                cal,
                capacity_req_s,
                mix,
                policy,
                levels,
                start_level,
                drain_s,
                clock,
                device,
            )
        finally:
            device.close(restore=False)


def _make_system(
    name: str,
    engine,
    device,
    clock,
    policy: Policy,
    cal,
    levels,
    inline: bool,
    speeds: dict[str, dict[str, float]] | None = None,
):
    """speeds: the controller's speed table, per level its decode_tok_s_bs16 and
    prefill_tok_s (None: the calibration's)."""
    budget = policy.power_budget_w
    if name == "max_clock":
        return MaxClock(engine, device, clock)
    if name == "static_cap":
        return StaticCap(engine, device, clock, budget)
    if name == "pid_power":
        return PidOnPower(engine, device, clock, budget, device.read().sm_clock_ladder_mhz)
    if name == "controller":
        return Controlled(engine, device, clock, policy, cal, levels, inline=inline, speeds=speeds)
    if name == "controller_fixed_quant":
        return Controlled(
            engine,
            device,
            clock,
            policy,
            cal,
            (engine.quant_level,),
            inline=inline,
            name=name,
            speeds=speeds,
        )
    if name == "controller_unpaced":
        return Controlled(
            engine,
            device,
            clock,
            policy,
            cal,
            levels,
            inline=inline,
            name=name,
            decode_interval_max_ms=0.0,
            speeds=speeds,
        )
    if name.startswith("fixed:"):
        # fixed:<level>:<MHz>[:<decode-only MHz>:<decode interval ms>]
        _, level, mhz, *study = name.split(":")
        if len(study) not in (0, 2):
            raise ValueError(
                f"system {name!r}: fixed:<level>:<MHz>[:<decode-only MHz>:<interval ms>]"
            )
        decode_mhz, interval_ms = (int(study[0]), float(study[1])) if study else (None, 0.0)
        return FixedSetting(engine, device, clock, budget, level, int(mhz), decode_mhz, interval_ms)
    raise ValueError(f"unknown system {name!r}")


def _run_model(
    scenario,
    system_name,
    cal,
    capacity_req_s,
    mix,
    policy,
    levels,
    start_level,
    drain_s,
    clock,
    device,
) -> RunResult:
    engine = SimulatedEngine(cal, start_level, clock, device, seed=scenario.seed)
    policy = policy.with_changes(power_budget_w=scenario.budget_w(0.0), mode=ControlMode.AUTO)
    system = _make_system(system_name, engine, device, clock, policy, cal, levels, inline=True)
    engine.add_step_hook(system.on_step)
    gpu = device.backend
    todo = arrivals(scenario, capacity_req_s, mix)
    reqs = [SimRequest(f"r{i}", t, p, o) for i, (t, p, o) in enumerate(todo)]
    samples: list[Sample] = []
    next_req = 0
    next_tick = 0.0
    budget = scenario.budget_w(0.0)
    ambient = scenario.ambient_c(0.0)
    t0_tel, last = _energy_sample(device)
    e_start = last[1]
    reported = first_seen = 0
    end_s = scenario.duration_s + drain_s
    knobs: dict = {}
    while True:
        now = clock()
        if now >= end_s or (now >= scenario.duration_s and not engine.has_work()):
            break
        b = scenario.budget_w(now)
        if b != budget:
            budget = b
            system.set_budget_w(b)
        a = scenario.ambient_c(now)
        if abs(a - ambient) >= 0.5:
            ambient = a
            gpu.set_ambient_c(a)
        while next_req < len(reqs) and reqs[next_req].arrival_s <= now:
            engine.add_request(reqs[next_req])
            next_req += 1
        # As the API does: TTFT at the first token, TPOT when the request finishes.
        while first_seen < len(engine.first_tokens):
            system.record_ttft_s(engine.first_tokens[first_seen].ttft_s)
            first_seen += 1
        while reported < len(engine.finished):
            r = engine.finished[reported]
            reported += 1
            if r.tpot_s is not None and r.generated > 1:
                system.record_tpot_s(r.tpot_s)
        if now >= next_tick:
            knobs = system.tick()
            next_tick += PERIOD_S
            if next_tick < now:
                next_tick = now + PERIOD_S
        stats = engine.step()
        if stats is None:
            upcoming = [next_tick, end_s]
            if next_req < len(reqs):
                upcoming.append(reqs[next_req].arrival_s)
            if (resume := engine.resume_at_s()) is not None:
                upcoming.append(resume)
            clock.advance(max(min(min(upcoming) - clock(), 0.1), 1e-6))
        tel, cur = _energy_sample(device)
        if cur[0] > last[0]:
            power = (cur[1] - last[1]) / (cur[0] - last[0])
            samples.append(
                Sample(
                    cur[0],
                    power,
                    budget,
                    tel.gpu_temp_c or 0.0,
                    tel.sm_clock_mhz or 0,
                    engine.num_running,
                    engine.num_waiting,
                    dict(knobs),
                )
            )
            last = cur
    requests = []
    for r in reqs:
        requests.append((r.arrival_s, r.ttft_s, r.tpot_s if r.finish_s else None, r.generated))
    reasons = {}
    if isinstance(system, Controlled):
        reasons = {k: v for k, v in system.loop.controller.counters.decisions.items() if v}
    return RunResult(
        scenario=scenario.name,
        system=system.name,
        requests=requests,
        samples=samples,
        energy_j=last[1] - e_start,
        output_tokens=engine.counters.generation_tokens,
        duration_s=last[0],
        knob_changes=system.knob_changes,
        reasons=reasons,
    )


def measure_capacity(
    cal: Calibration, level: str, mix: RequestMix, seconds: float = 120.0
) -> float:
    """Requests/s the uncontrolled engine (max clock, caps 64/512) sustains when saturated."""
    from daemon.config import DeviceConfig
    from daemon.device import SimClock, open_device

    clock = SimClock(0.0)
    rng = random.Random(99)
    with tempfile.TemporaryDirectory() as state_dir:
        device = open_device(
            DeviceConfig(backend="virtual", mode="control", state_dir=Path(state_dir)), clock=clock
        )
        engine = SimulatedEngine(cal, level, clock, device, seed=99)
        n = 0

        def add() -> None:
            nonlocal n
            p = _prompt_tokens(rng, mix)
            engine.add_request(
                SimRequest(
                    f"c{n}", clock(), p, rng.randint(mix.output_min_tokens, mix.output_max_tokens)
                )
            )
            n += 1

        for _ in range(128):
            add()
        warm = seconds / 4
        done0 = None
        while clock() < seconds:
            engine.step()
            while engine.num_running + engine.num_waiting < 128:
                add()
            if done0 is None and clock() >= warm:
                done0 = len(engine.finished)
        device.close(restore=False)
    return (len(engine.finished) - (done0 or 0)) / (seconds - warm)


def _real_engine(loaded: Any, level: str, levels: tuple[str, ...] = ()) -> Any:
    """A fresh real engine over the loaded weights, as every real-engine run here uses it:
    a 512 MiB KV pool, caps 64/512, starting at `level`, allowed `level` and `levels`."""
    from daemon.engine.engine import Engine, EngineOptions

    return Engine(
        loaded,
        EngineOptions(
            kv_cache_bytes=1 << 29,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            quantization_levels=tuple(dict.fromkeys((level, *levels))),
            quantization_level=level,
        ),
    )


def measure_level_speeds_real(loaded: Any, levels: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each level's speed on the real engine here and now, as bench quant's table gives it
    to the daemon on the machine it runs on: decode tok/s at batch 16
    (bench.quant.measure_speed: one interleaved round, 16 prompts of 64 tokens, 32 new
    tokens each) and prefill tok/s (one 256-token prompt per level, best of two
    interleaved rounds). The calibration's speeds may come from another machine: on a CPU
    without bf16 instructions bf16 decodes slower than fp32 and bf16 and int8 prefill
    several times slower, where a table from a machine with them ranks both ahead."""
    from bench.engine import corpus_token_ids
    from bench.quant import DecodeTimer, measure_speed
    from daemon.engine.request import SamplingParams

    engine = _real_engine(loaded, levels[0], levels)
    timer = DecodeTimer()
    engine.add_step_hook(timer)
    ids = corpus_token_ids(engine.tokenizer, 2048)
    prompts = [ids[i * 64 : (i + 1) * 64] for i in range(16)]
    decode = measure_speed(engine, timer, levels, prompts, 32, 1)
    prefill = dict.fromkeys(levels, 0.0)
    prompt = ids[1024:1280]
    for _ in range(2):
        for lv in levels:
            engine.set_quant_level(lv)
            engine.generate([prompt[:8]], SamplingParams(max_tokens=1, temperature=0.0))
            t0 = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
            prefill[lv] = max(prefill[lv], len(prompt) / (time.perf_counter() - t0))
    out = {}
    for lv in levels:
        row = {"decode_tok_s_bs16": decode[lv]["decode_tok_s_bs16"], "prefill_tok_s": prefill[lv]}
        if not all(math.isfinite(v) and v > 0 for v in row.values()):
            raise RuntimeError(f"no speed measured for {lv}: {row}")
        out[lv] = row
    return out


def measure_capacity_real(loaded: Any, level: str, mix: RequestMix, seconds: float) -> float:
    """Requests/s the real engine (max clock; caps 64/512) completes when kept saturated
    with the request mix: 64 in flight (a finished one is replaced at once), counted over
    `seconds` after the first 16 have finished (the first wave prefills together, so a
    fixed warm-up time would measure nothing on a slow CPU)."""
    from bench.engine import corpus_token_ids, corpus_window
    from daemon.engine.request import SamplingParams

    engine = _real_engine(loaded, level)
    ids = corpus_token_ids(engine.tokenizer, 8192)
    rng = random.Random(99)
    done: list[float] = []

    def add() -> None:
        prompt = corpus_window(ids, _prompt_tokens(rng, mix), rng)
        params = SamplingParams(
            max_tokens=rng.randint(mix.output_min_tokens, mix.output_max_tokens),
            temperature=0.0,
            ignore_eos=True,
        )
        engine.add_request(prompt, params, on_output)

    def on_output(out) -> None:  # engine thread
        if out.finished and out.finish_reason != "abort":
            done.append(time.monotonic())
            add()

    for _ in range(64):
        add()
    # On the engine's own thread, as in the runs (stepping from the main thread measured
    # several times slower on this shared machine).
    engine.start()
    try:
        give_up = time.monotonic() + 4 * seconds + 120.0
        while len(done) < 16 and time.monotonic() < give_up:
            time.sleep(0.2)
        if len(done) < 16:
            raise RuntimeError(f"capacity: only {len(done)} requests finished warming up")
        t0, n0 = time.monotonic(), len(done)
        time.sleep(seconds)
        t1, n1 = time.monotonic(), len(done)
    finally:
        engine.stop(abort_pending=True)
    if n1 - n0 < 8:
        raise RuntimeError(f"capacity: only {n1 - n0} requests finished in {seconds:g} s")
    return (n1 - n0) / (t1 - t0)


# ---- metrics -------------------------------------------------------------------------


def summarize(res: RunResult, policy: Policy, scenario: Scenario) -> dict:
    ttft_slo_s, tpot_slo_s = policy.ttft_slo_ms / 1000, policy.tpot_slo_ms / 1000
    met = 0
    ttfts, tpots = [], []
    for _, ttft, tpot, _ in res.requests:
        ok = ttft is not None and tpot is not None and ttft <= ttft_slo_s and tpot <= tpot_slo_s
        met += ok
        ttfts.append(ttft if ttft is not None else math.inf)
        tpots.append(tpot if tpot is not None else math.inf)
    over_s, longest, run, prev_t = 0.0, 0.0, 0.0, 0.0
    for s in res.samples:
        span = s.t_s - prev_t
        prev_t = s.t_s
        if s.power_w > s.budget_w * 1.001:
            over_s += span
            run += span
            longest = max(longest, run)
        else:
            run = 0.0
    n = len(res.requests)
    out = {
        "requests": n,
        "attainment_pct": round(100.0 * met / n, 2) if n else None,
        "p99_ttft_ms": _ms(percentile_of(ttfts, 99)) if n else None,
        "p99_tpot_ms": _ms(percentile_of(tpots, 99)) if n else None,
        "j_per_token": round(res.energy_j / res.output_tokens, 4) if res.output_tokens else None,
        "over_budget_s": round(over_s, 2),
        "over_budget_pct": round(100.0 * over_s / max(res.duration_s, 1e-9), 3),
        "longest_over_budget_s": round(longest, 2),
        "peak_temp_c": max((s.temp_c for s in res.samples), default=None),
        "knob_changes": res.knob_changes,
        "mean_power_w": round(res.energy_j / max(res.duration_s, 1e-9), 1),
    }
    if scenario.budget_steps_s:
        out.update(step_response(res, scenario))
    if res.reasons:
        out["decisions"] = res.reasons
    return out


def _ms(x: float) -> float | None:
    return round(1000.0 * x, 1) if math.isfinite(x) else None


def step_response(res: RunResult, scenario: Scenario) -> dict:
    """Settling time and overshoot after each budget step, from 100 ms energy-counter power.

    settle_s: from the step until power is at or below the new budget for good (until the
    next step). overshoot_pct: the largest excess over the new budget after power first
    came at or below it (for a step down) or after the step (for a step up), in percent
    of the budget. The worst over the steps is reported.
    """
    settles, overshoots = [], []
    edges = list(scenario.budget_steps_s) + [res.duration_s]
    for i, t_step in enumerate(edges[:-1]):
        window = [s for s in res.samples if t_step < s.t_s <= edges[i + 1]]
        if not window:
            continue
        budget = window[-1].budget_w
        last_over = None
        for s in window:
            if s.power_w > budget * 1.001:
                last_over = s.t_s
        settles.append(0.0 if last_over is None else last_over - t_step)
        below = next((k for k, s in enumerate(window) if s.power_w <= budget * 1.001), None)
        after = window[below:] if below is not None else []
        peak = max((s.power_w for s in after), default=budget)
        overshoots.append(max(0.0, 100.0 * (peak - budget) / budget))
    return {
        "settle_s": round(max(settles), 2) if settles else None,
        "overshoot_pct": round(max(overshoots), 2) if overshoots else None,
    }


# ---- plots ---------------------------------------------------------------------------


def plot_scenario(results: list[RunResult], policy: Policy, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    colors = {
        "controller": "tab:green",
        "controller_fixed_quant": "tab:olive",
        "controller_unpaced": "tab:cyan",
        "max_clock": "tab:red",
        "static_cap": "tab:orange",
        "pid_power": "tab:purple",
        "best_static": "tab:gray",
    }
    for res in results:
        c = colors.get(res.system, None)
        lw = 1.6 if res.system == "controller" else 0.9
        ts, ps = _smooth([s.t_s for s in res.samples], [s.power_w for s in res.samples], 1.0)
        axes[0].plot(ts, ps, color=c, lw=lw, label=res.system)
        win = 10.0
        grid = [res.duration_s * i / 200 for i in range(201)]
        ttft, tpot = [], []
        for g in grid:
            rows = [r for r in res.requests if g - win < r[0] <= g and r[1] is not None]
            ttft.append(1000 * percentile_of([r[1] for r in rows], 99) if rows else math.nan)
            tp = [r[2] for r in rows if r[2] is not None]
            tpot.append(1000 * percentile_of(tp, 99) if tp else math.nan)
        axes[1].plot(grid, ttft, color=c, lw=lw)
        axes[2].plot(grid, tpot, color=c, lw=lw)
    ctl = next((r for r in results if r.system == "controller"), results[0])
    axes[0].plot(
        [s.t_s for s in ctl.samples],
        [s.budget_w for s in ctl.samples],
        "k--",
        lw=1.2,
        label="budget",
    )
    axes[0].set_ylabel("power W (1 s mean)")
    axes[0].legend(loc="upper right", fontsize=8, ncol=3)
    axes[1].axhline(policy.ttft_slo_ms, color="k", ls="--", lw=1)
    axes[1].set_ylabel("p99 TTFT ms (10 s, by arrival)")
    axes[1].set_yscale("log")
    axes[2].axhline(policy.tpot_slo_ms, color="k", ls="--", lw=1)
    axes[2].set_ylabel("p99 TPOT ms (10 s, by arrival)")
    axes[2].set_yscale("log")
    ax = axes[3]
    clocks = [(s.t_s, s.knobs.get("sm_clock_mhz")) for s in ctl.samples if s.knobs]
    ax.plot(
        [t for t, _ in clocks],
        [f or math.nan for _, f in clocks],
        color="tab:green",
        lw=1.2,
        label="SM clock lock MHz (controller)",
    )
    ax.plot(
        [s.t_s for s in ctl.samples],
        [s.sm_clock_mhz for s in ctl.samples],
        color="tab:green",
        lw=0.5,
        alpha=0.4,
        label="SM clock actual MHz",
    )
    ax.set_ylabel("MHz")
    ax2 = ax.twinx()
    seqs = [(s.t_s, s.knobs.get("max_num_seqs")) for s in ctl.samples if s.knobs]
    ax2.step(
        [t for t, _ in seqs],
        [v or math.nan for _, v in seqs],
        color="tab:blue",
        lw=1,
        where="post",
        label="max_num_seqs",
    )
    paced = [(s.t_s, s.knobs.get("decode_interval_ms")) for s in ctl.samples if s.knobs]
    if any(v for _, v in paced):
        ax2.step(
            [t for t, _ in paced],
            [(v or 0.0) / 5.0 for _, v in paced],
            color="tab:pink",
            lw=1,
            where="post",
            label="decode interval ms / 5",
        )
    levels = sorted({s.knobs.get("quant_level") for s in ctl.samples if s.knobs.get("quant_level")})
    if len(levels) > 1 or levels:
        q = [(s.t_s, s.knobs.get("quant_level")) for s in ctl.samples if s.knobs.get("quant_level")]
        y = [8 * (1 + levels.index(lv)) for _, lv in q]
        ax2.step(
            [t for t, _ in q],
            y,
            color="tab:brown",
            lw=1,
            where="post",
            label="quant level: " + ", ".join(f"{8 * (1 + i)}={lv}" for i, lv in enumerate(levels)),
        )
    ax2.set_ylabel("max_num_seqs / quant level / interval")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    axes[3].set_xlabel("time s")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _smooth(ts: list[float], ys: list[float], window_s: float) -> tuple[list[float], list[float]]:
    out_t, out_y = [], []
    acc_t, acc_e, start = 0.0, 0.0, None
    prev = 0.0
    for t, y in zip(ts, ys, strict=True):
        span = t - prev
        prev = t
        if start is None:
            start = t - span
        acc_t += span
        acc_e += y * span
        if t - start >= window_s:
            out_t.append(t)
            out_y.append(acc_e / acc_t)
            acc_t, acc_e, start = 0.0, 0.0, None
    return out_t, out_y


def plot_summary(table: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(table)
    systems = list(next(iter(table.values())))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(systems)
    for k, sys_name in enumerate(systems):
        xs = [i + k * width for i in range(len(scenarios))]
        axes[0].bar(
            xs, [table[s][sys_name]["j_per_token"] or 0 for s in scenarios], width, label=sys_name
        )
        axes[1].bar(
            xs,
            [table[s][sys_name]["attainment_pct"] or 0 for s in scenarios],
            width,
            label=sys_name,
        )
    for ax, label in ((axes[0], "J per output token"), (axes[1], "SLO attainment %")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scenarios))], scenarios, rotation=20)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[1].set_ylim(0, 105)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- the real engine -----------------------------------------------------------------


def run_real(
    scenario: Scenario,
    system_name: str,
    capacity_req_s: float,
    mix: RequestMix,
    policy: Policy,
    levels: tuple[str, ...],
    start_level: str,
    cal: Calibration,
    loaded: Any,
    speeds: dict[str, dict[str, float]] | None = None,
) -> RunResult:
    """One scenario with one system on the real engine (a fresh one over the loaded
    weights), in wall time; speeds: the controller's speed table (measure_level_speeds_real)."""
    from bench.engine import corpus_token_ids
    from daemon.config import DeviceConfig
    from daemon.coupling import device_step_hook
    from daemon.device import open_device
    from daemon.engine.request import SamplingParams

    engine = _real_engine(loaded, start_level, levels)
    ids = corpus_token_ids(engine.tokenizer, 8192)
    policy = policy.with_changes(power_budget_w=scenario.budget_w(0.0), mode=ControlMode.AUTO)
    with tempfile.TemporaryDirectory() as state_dir:
        device = open_device(
            DeviceConfig(
                backend="virtual",
                mode="control",
                state_dir=Path(state_dir),
                virtual_seed=scenario.seed,
                virtual_ambient_c=scenario.ambient_c(0.0),
            )
        )
        system = _make_system(
            system_name,
            engine,
            device,
            time.monotonic,
            policy,
            cal,
            levels,
            inline=False,
            speeds=speeds,
        )
        engine.add_step_hook(device_step_hook(engine, device))
        engine.add_step_hook(system.on_step)
        engine.generate([ids[:16]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        todo = arrivals(scenario, capacity_req_s, mix)
        records: dict[str, list] = {}
        lock = threading.Lock()
        t_start = time.monotonic()

        def sink_for(rid: str, arrival: float):
            def sink(out) -> None:
                now = time.monotonic()
                rec = records[rid]
                if out.token_ids and rec[1] is None:
                    rec[1] = now - arrival
                    system.record_ttft_s(rec[1])
                rec[3] = out.completion_tokens
                if out.finished:
                    if rec[1] is not None and out.completion_tokens > 1:
                        rec[2] = (now - arrival - rec[1]) / (out.completion_tokens - 1)
                        system.record_tpot_s(rec[2])
                    elif rec[1] is not None:
                        rec[2] = 0.0

            return sink

        engine.start()
        samples: list[Sample] = []
        _, last = _energy_sample(device)
        e_start = last[1]
        i = 0
        next_tick = time.monotonic()
        budget = scenario.budget_w(0.0)
        knobs: dict = {}
        end = t_start + scenario.duration_s
        drain_end = end + 30.0
        try:
            while True:
                now = time.monotonic()
                rel = now - t_start
                if now >= drain_end or (now >= end and not engine.has_work()):
                    break
                b = scenario.budget_w(rel)
                if b != budget:
                    budget = b
                    system.set_budget_w(b)
                device.backend.set_ambient_c(scenario.ambient_c(rel))
                while i < len(todo) and todo[i][0] <= rel:
                    _, plen, olen = todo[i]
                    start = (i * 97) % (len(ids) - plen)
                    rid = f"r{i}"
                    arrival = t_start + todo[i][0]
                    with lock:
                        records[rid] = [arrival, None, None, 0]
                    engine.add_request(
                        ids[start : start + plen],
                        SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True),
                        sink_for(rid, arrival),
                        request_id=rid,
                    )
                    i += 1
                if now >= next_tick:
                    knobs = system.tick()
                    next_tick += PERIOD_S
                tel, cur = _energy_sample(device)
                if cur[0] > last[0]:
                    power = (cur[1] - last[1]) / (cur[0] - last[0])
                    samples.append(
                        Sample(
                            cur[0] - t_start,
                            power,
                            budget,
                            tel.gpu_temp_c or 0.0,
                            tel.sm_clock_mhz or 0,
                            engine.num_running,
                            engine.num_waiting,
                            dict(knobs),
                        )
                    )
                    last = cur
                time.sleep(0.02)
        finally:
            engine.stop(abort_pending=True)
            device.close(restore=False)
    requests = [(r[0] - t_start, r[1], r[2], r[3]) for r in records.values()]
    for j in range(i, len(todo)):
        requests.append((todo[j][0], None, None, 0))
    reasons = {}
    if isinstance(system, Controlled):
        reasons = {k: v for k, v in system.loop.controller.counters.decisions.items() if v}
    return RunResult(
        scenario=scenario.name,
        system=system.name,
        requests=requests,
        samples=samples,
        energy_j=last[1] - e_start,
        output_tokens=engine.counters.generation_tokens,
        duration_s=samples[-1].t_s if samples else 0.0,
        knob_changes=system.knob_changes,
        reasons=reasons,
    )


# ---- main ----------------------------------------------------------------------------


SYSTEMS = (
    "controller",
    "controller_fixed_quant",
    "controller_unpaced",
    "max_clock",
    "static_cap",
    "pid_power",
    "best_static",
)


def load_or_calibrate(args) -> Calibration:
    from daemon.config import default_cache_dir

    threads = args.threads or 2
    path = args.calibration or calibration_path(
        default_cache_dir(), args.model, args.dtype, threads
    )
    if path.is_file() and not args.recalibrate:
        cal = Calibration.from_json(path.read_text())
        if cal is not None and all(lv in cal.levels for lv in args.levels):
            print(f"calibration: {path} (measured {cal.measured_at})", flush=True)
            return cal
    print(f"calibrating the real engine ({', '.join(args.levels)}); saved to {path}", flush=True)
    cal = calibrate(args.model, tuple(args.levels), args.dtype, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cal.to_json() + "\n")
    return cal


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench control", description=__doc__)
    ap.add_argument("--engine", choices=["model", "real"], default="model")
    ap.add_argument(
        "--scenarios",
        default=None,
        help="comma list (default: all for model, steady60,budget_step for real)",
    )
    ap.add_argument(
        "--systems",
        default=None,
        help=f"comma list of {', '.join(SYSTEMS)} (real: all but the second)",
    )
    ap.add_argument(
        "--duration-s", type=float, default=None, help="per scenario (model 300, real 60)"
    )
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--levels", type=lambda s: s.split(","), default=list(DEFAULT_LEVELS))
    ap.add_argument(
        "--start-level", default=None, help="level the engine starts at (default: full precision)"
    )
    ap.add_argument("--budget-w", type=float, default=300.0)
    ap.add_argument("--step-budget-w", type=float, default=220.0, help="budget_step's lower budget")
    ap.add_argument(
        "--low-budget-w",
        type=float,
        default=180.0,
        help="budget_step_low's lower budget (below the device's 200 W minimum limit)",
    )
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    # CPU-scale SLOs: the uncontrolled engine meets them at 80 % of its saturated throughput.
    ap.add_argument("--tpot-slo-ms", type=float, default=400.0)
    ap.add_argument("--max-ppl-increase-pct", type=float, default=2.0)
    ap.add_argument(
        "--capacity-s", type=float, default=40.0, help="real engine: capacity measurement time"
    )
    ap.add_argument(
        "--capacity-req-s",
        type=float,
        default=None,
        help="real engine: take this capacity (req/s) instead of measuring it (to compare "
        "runs on a shared CPU whose speed varies)",
    )
    ap.add_argument("--calibration", type=Path, default=None)
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)

    cal = load_or_calibrate(args)
    start = args.start_level or cal.full_precision
    levels = tuple(lv for lv in args.levels if lv in cal.levels)
    mix = RequestMix()
    policy = Policy(
        power_budget_w=args.budget_w,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        mode=ControlMode.AUTO,
        max_ppl_increase_pct=args.max_ppl_increase_pct,
    )
    loaded = None
    speeds: dict[str, dict[str, float]] | None = None
    if args.engine == "real":
        import torch

        from daemon.config import default_cache_dir
        from daemon.engine.loader import load_model

        torch.set_num_threads(cal.threads)
        loaded = load_model(args.model, default_cache_dir(), args.dtype)
        # The real engine's own capacity now, on this (shared) CPU: the calibration's
        # would overload it whenever a neighbour slows the cores down.
        if args.capacity_req_s is not None:
            if not args.capacity_req_s > 0:
                raise SystemExit("--capacity-req-s must be > 0")
            capacity = args.capacity_req_s
        else:
            capacity = measure_capacity_real(loaded, start, mix, args.capacity_s)
        # The controller's speed table from this machine, as the daemon's comes from bench
        # quant run where it serves.
        speeds = measure_level_speeds_real(loaded, tuple(dict.fromkeys((start, *levels))))
        print(
            "speed table, measured here (tok/s; decode at batch 16 / prefill): "
            + ", ".join(
                f"{lv} {v['decode_tok_s_bs16']:.1f} / {v['prefill_tok_s']:.0f}"
                for lv, v in speeds.items()
            ),
            flush=True,
        )
    else:
        capacity = measure_capacity(cal, start, mix)
    duration = args.duration_s or (300.0 if args.engine == "model" else 60.0)
    scenarios = make_scenarios(duration, args.budget_w, args.step_budget_w, args.low_budget_w)
    names = (
        args.scenarios or ("steady60,budget_step" if args.engine == "real" else ",".join(scenarios))
    ).split(",")
    # The real engine runs in wall time: no hindsight search, no second controller.
    real_skip = ("controller_fixed_quant", "controller_unpaced", "best_static")
    default_systems = (
        SYSTEMS if args.engine == "model" else tuple(x for x in SYSTEMS if x not in real_skip)
    )

    systems = args.systems.split(",") if args.systems else list(default_systems)
    print(
        f"engine {args.engine}; capacity {capacity:.2f} req/s "
        f"({capacity * mix.mean_output_tokens:.0f} "
        f"output tok/s) at {start}, max clock, caps 64/512; SLO p{policy.slo_percentile:g} TTFT "
        f"{policy.ttft_slo_ms:g} ms, TPOT {policy.tpot_slo_ms:g} ms; budget {args.budget_w:g} W; "
        f"levels {', '.join(levels)} (quality limit {args.max_ppl_increase_pct}% ppl: "
        + ", ".join(f"{lv} {cal.levels[lv].ppl_increase_pct}%" for lv in levels)
        + f"); {duration:g} s per scenario",
        flush=True,
    )
    table: dict[str, dict[str, dict]] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        sc = scenarios[name]
        results = []
        for sys_name in systems:
            t0 = time.perf_counter()
            if sys_name == "best_static":
                res, label = best_static(sc, cal, capacity, mix, policy, levels, start)
                print(f"{name:>12} {'best_static':>22}: hindsight choice {label}", flush=True)
            elif args.engine == "model":
                res = run_model(sc, sys_name, cal, capacity, mix, policy, levels, start)
            else:
                res = run_real(
                    sc, sys_name, capacity, mix, policy, levels, start, cal, loaded, speeds
                )
            summary = summarize(res, policy, sc)
            table.setdefault(name, {})[sys_name] = summary
            results.append(res)
            print(
                f"{name:>12} {sys_name:>22}: attainment {summary['attainment_pct']}%, p99 TTFT "
                f"{summary['p99_ttft_ms']} ms, p99 TPOT {summary['p99_tpot_ms']} ms, "
                f"{summary['j_per_token']} J/token, {summary['mean_power_w']} W mean, over budget "
                f"{summary['over_budget_s']} s (longest {summary['longest_over_budget_s']} s), "
                "peak "
                f"{summary['peak_temp_c']} C, {summary['knob_changes']} knob changes"
                + (
                    f", settle {summary['settle_s']} s, overshoot {summary['overshoot_pct']}%"
                    if "settle_s" in summary
                    else ""
                )
                + f" [{time.perf_counter() - t0:.1f} s]",
                flush=True,
            )
        if not args.no_plots:
            path = args.out / f"control-{args.engine}-{name}.png"
            plot_scenario(
                results,
                policy,
                path,
                f"{name}: {args.engine} engine on the virtual H200, budget {args.budget_w:g} W",
            )
            print(f"wrote {path}", flush=True)
    if not args.no_plots and len(table) > 1:
        path = args.out / f"control-{args.engine}-summary.png"
        plot_summary(table, path, f"{args.engine} engine, virtual H200: J/token and SLO attainment")
        print(f"wrote {path}", flush=True)
    line = _headline(table, args, cal, capacity, duration, levels, speeds)
    print(json.dumps(line))
    return 0


def _headline(
    table: dict,
    args,
    cal: Calibration,
    capacity: float,
    duration: float,
    levels,
    speeds: dict[str, dict[str, float]] | None,
) -> dict:
    line: dict[str, Any] = {}
    s60 = table.get("steady60", {})
    ctl = s60.get("controller")
    base = s60.get("max_clock")
    if ctl and base:
        line["attainment_pct"] = ctl["attainment_pct"]
        line["energy_saving_vs_max_clock_pct"] = round(
            100.0 * (1 - ctl["j_per_token"] / base["j_per_token"]), 2
        )
        line["over_budget_pct"] = ctl["over_budget_pct"]
        oracle = s60.get("best_static")
        if oracle and oracle.get("j_per_token"):
            line["best_static_saving_vs_max_clock_pct"] = round(
                100.0 * (1 - oracle["j_per_token"] / base["j_per_token"]), 2
            )
        for system, key in (
            ("controller_fixed_quant", "energy_saving_vs_max_clock_fixed_quant_pct"),
            ("controller_unpaced", "energy_saving_vs_max_clock_unpaced_pct"),
        ):
            other = s60.get(system)
            if other and other.get("j_per_token"):
                line[key] = round(100.0 * (1 - other["j_per_token"] / base["j_per_token"]), 2)
    step = table.get("budget_step", {}).get("controller")
    if step:
        line["settle_s"] = step.get("settle_s")
        line["overshoot_pct"] = step.get("overshoot_pct")
    line.update(
        {
            "engine": args.engine,
            "duration_s": duration,
            "capacity_req_s": round(capacity, 3),
            "budget_w": args.budget_w,
            "ttft_slo_ms": args.ttft_slo_ms,
            "tpot_slo_ms": args.tpot_slo_ms,
            "levels": list(levels),
            "speed_table_tok_s": (
                {lv: {k: round(x, 1) for k, x in v.items()} for lv, v in speeds.items()}
                if speeds
                else "calibration"
            ),
            "dtype": cal.dtype,
            "threads": cal.threads,
            "model": cal.model,
            "per_scenario": table,
        }
    )
    return line


if __name__ == "__main__":
    sys.exit(main())
