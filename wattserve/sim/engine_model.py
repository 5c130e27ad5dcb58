"""The engine model: continuous batching in simulated time. The real Scheduler and KV
cache decide each step; its duration comes from the calibration (with seeded noise) and
is booked on the virtual device, whose clock stretch advances the SimClock.

It offers the knobs the real engine offers (batch caps, decode pacing, quantization
level) and nothing the controller could not have; it must not import torch or bench.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wattserve.sim.calibration import Calibration

# The engine model's batch caps at the start of a run: the most the controller (and any
# static setting) may use, since neither raises a cap above the engine's.
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


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
        from wattserve.daemon.engine.engine import EngineCounters
        from wattserve.daemon.engine.kv_cache import KVCacheManager
        from wattserve.daemon.engine.model import ModelShape
        from wattserve.daemon.engine.scheduler import EngineLimits, Scheduler

        self.cal = cal
        self._clock = clock
        self._device = device
        self._rng = random.Random(seed)
        self.shape = ModelShape(**cal.shape, rms_norm_eps=1e-5, max_position_embeddings=8192)
        self.kv = KVCacheManager(4096, cal.block_size_tokens)
        self.scheduler = Scheduler(self.kv)
        self._limits = EngineLimits(DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS)
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
        # A mechanism the real engine does not have, for wattserve/bench/control_ceiling.py's
        # hindsight study only (off here): per-phase clocks (steps with prefill at one
        # locked clock, decode-only steps at another). Decode pacing is the engines' own
        # knob (EngineLimits.decode_interval_ms), as in wattserve.daemon.engine.Engine.
        self.phase_clocks_mhz: tuple[int, int] | None = None  # (prefill, decode-only)
        self._last_step_s = -math.inf
        self._last_decode_only = False

    # the knobs, as the real engine offers them
    @property
    def limits(self):
        return self._limits

    def set_limits(self, max_num_seqs=None, max_num_batched_tokens=None, decode_interval_ms=None):
        from wattserve.daemon.engine.scheduler import EngineLimits

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
        from wattserve.daemon.engine.scheduler import Sequence

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
        from wattserve.daemon.coupling import step_flops
        from wattserve.daemon.device.protocol import EngineActivity
        from wattserve.daemon.engine.engine import StepStats

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
