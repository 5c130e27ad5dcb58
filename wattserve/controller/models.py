"""Online models: step latency and board power per (quantization level, SM clock), the
offered workload, and the learned ratio between measured latency percentiles and the
model's mean; together they predict TTFT, TPOT, power and J/token of a configuration.

Step time and power are linear in parameters learned by recursive least squares (RLS)
with exponential forgetting from the engine's real steps and the device's power readings.
The clock enters through fixed basis functions, so one model per quantization level
covers every clock and is exact in form for the usual roofline split (a compute-bound
part that scales with f_max / f and a memory-bound part that does not). Which clocks each
level has actually been seen at is kept as well: the controller only trusts predictions
near seen clocks. This module must not import torch, read a clock or perform I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from wattserve.controller.signals import StepRecord


class RecursiveLeastSquares:
    """y ~ theta . x, learned one sample at a time with forgetting factor `forgetting`.

    The covariance's trace is bounded (max_trace), so directions the data does not excite
    cannot wind up while old samples are forgotten.
    """

    def __init__(
        self,
        theta0: Sequence[float],
        p0: float = 1.0,
        forgetting: float = 0.995,
        max_trace: float = 1e4,
    ) -> None:
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        n = len(theta0)
        self.theta = [float(v) for v in theta0]
        self.p = [[p0 if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.forgetting = forgetting
        self.max_trace = max_trace
        self.updates = 0

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def update(self, x: Sequence[float], y: float, weight: float = 1.0) -> float:
        """Learn from one sample; returns the prediction error before the update."""
        n = len(self.theta)
        px = [sum(self.p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = self.forgetting / max(weight, 1e-9) + sum(x[i] * px[i] for i in range(n))
        err = y - self.predict(x)
        if denom <= 1e-12 or not math.isfinite(err):
            return err
        gain = [v / denom for v in px]
        for i in range(n):
            self.theta[i] += gain[i] * err
        lam = self.forgetting
        for i in range(n):
            gi = gain[i]
            row = self.p[i]
            for j in range(n):
                row[j] = (row[j] - gi * px[j]) / lam
        trace = sum(self.p[i][i] for i in range(n))
        if trace > self.max_trace:
            scale = self.max_trace / trace
            for row in self.p:
                for j in range(n):
                    row[j] *= scale
        self.updates += 1
        return err

    def inflate(self, factor: float) -> None:
        """Trust the current estimate less (a hardware slowdown made it stale)."""
        for row in self.p:
            for j in range(len(row)):
                row[j] *= factor


# ---- step latency -----------------------------------------------------------------------

# Feature scales keep the RLS well conditioned: tokens per hundred, context per thousand.
_PREFILL_SCALE = 100.0
_DECODE_SCALE = 10.0
_CONTEXT_SCALE = 1000.0
_STEP_FEATURES = 10
# How many of a model's latest steps its surprise (measured over predicted) is the median of:
# one long step (a stall) does not count, two in three do.
SURPRISE_STEPS = 3


def _step_features(
    clock_ratio: float, prefill: float, decode: float, context: float
) -> list[float]:
    base = [1.0, prefill / _PREFILL_SCALE, decode / _DECODE_SCALE, context / _CONTEXT_SCALE]
    # The slowdown terms vanish at f_max: steps there pin down the top-clock costs alone.
    stretch = clock_ratio - 1.0
    # Last, the prefill tokens squared (top clock, stretch): a step's compute-bound share
    # grows with the tokens it computes, so its time stretches more than in proportion
    # at a lower clock. Prefill tokens per step spread with the prompts' sizes, which is
    # what fits it.
    square = (prefill / _PREFILL_SCALE) ** 2
    return base + [v * stretch for v in base] + [square, square * stretch]


@dataclass(frozen=True)
class StepCoefficients:
    """Step time at one (level, clock) as t = base_s + per-token costs (seconds)."""

    base_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float
    per_prefill_token_sq_s: float = 0.0  # x prefill tokens squared

    def step_s(self, prefill: float, decode: float, context: float) -> float:
        t = (
            self.base_s
            + self.per_prefill_token_s * prefill
            + self.per_prefill_token_sq_s * prefill * prefill
            + self.per_decode_token_s * decode
            + self.per_context_token_s * context
        )
        return max(t, 1e-6)

    def scaled(self, factor: float) -> StepCoefficients:
        """Every cost `factor` times longer (a level's steps that much slower)."""
        if factor == 1.0:
            return self
        return StepCoefficients(
            self.base_s * factor,
            self.per_prefill_token_s * factor,
            self.per_decode_token_s * factor,
            self.per_context_token_s * factor,
            self.per_prefill_token_sq_s * factor,
        )

    def prompt_s(self, chunking: Chunking, decode: float, context: float) -> float:
        """The steps a mean prompt's chunks take (each beside `decode` tokens reading
        `context`): a step's fixed and decode costs per chunk, the linear prefill cost on
        the mean prompt, the squared one on the mean sum of its chunks' squares."""
        per_step = self.step_s(0.0, decode, context)
        return (
            chunking.chunks * per_step
            + self.per_prefill_token_s * chunking.tokens
            + self.per_prefill_token_sq_s * chunking.tokens_sq
        )


class StepTimeModel:
    """Step duration of one quantization level as a function of the batch and the clock:

        t = sum_k (a_k + b_k * (f_max / f - 1)) * x_k,  x = (1, prefill, decode, context,
                                                           prefill^2)

    a_k: the costs at the top clock; b_k: how much of them stretches as the clock drops
    (b_k = a_k for fully compute-bound work, 0 for memory-bound). Steps at the top clock
    teach a_k alone; b_k starts at 0 (optimistic: the controller steps down, guarded, and
    learns it from the steps it sees there). The prefill^2 term is the part of a step's
    time that grows faster than its tokens (the compute-bound share grows with them, and
    that share stretches): with it a big chunk at a low clock costs more per prompt token
    than a small one. A negative b_k is the fit trading one cost's stretch against
    another's (a step's whole time stretches with its own arithmetic intensity, which no
    one feature carries exactly, and a steady load moves the features together): that
    cost is then taken as flat, at its fitted value at the mean stretch of the steps
    learned from, so no cost falls as the clock drops.
    """

    def __init__(self, sm_clock_max_mhz: int, forgetting: float = 0.998) -> None:
        self.f_max = float(sm_clock_max_mhz)
        self.rls = RecursiveLeastSquares([0.0] * _STEP_FEATURES, p0=1.0, forgetting=forgetting)
        self.samples_by_clock: dict[int, int] = {}
        # The mean stretch (f_max / f - 1) of the steps learned from, forgotten as they are.
        self.stretch_mean = 0.0
        # Steps seen by decode batch, in power-of-two buckets (1, 2-3, 4-7, ...): a model
        # fitted on small batches says little about large ones.
        self.samples_by_batch: dict[int, int] = {}
        # Each latest step's duration over what the model predicted for it just before
        # learning it (the costs as the controller reads them, clipped at 0).
        self.surprises: deque[float] = deque(maxlen=SURPRISE_STEPS)

    def as_prior(self, stretch_p0: float = 0.01) -> StepTimeModel:
        """A fresh model for another level that starts from this one's estimate but has
        seen nothing (so the controller learns before it trusts it). The top-clock costs
        start loose; the clock sensitivity starts firm (variance stretch_p0): a trial runs
        at a few neighbouring clocks, which pins the costs there but says little about how
        they stretch lower down, so that stays the other level's until steps at clocks
        well apart teach it."""
        other = StepTimeModel(int(self.f_max))
        other.rls.theta = list(self.rls.theta)
        other.stretch_mean = self.stretch_mean
        for k in (*range(4, 8), 9):
            other.rls.p[k][k] = stretch_p0
        return other

    def predict_step_s(self, step: StepRecord, clock_mhz: int) -> float:
        """What the model predicts `step` takes at this clock, with the step's own context
        per decode token folded in, as every prediction has it: the fit trades the decode
        cost against the context cost (the two counts move together), and clipping each on
        its own predicted fp32 a 30 ms step where its steps took 95 ms."""
        per_decode = step.context_tokens / step.decode_tokens if step.decode_tokens else None
        return self.coefficients(clock_mhz, per_decode).step_s(
            step.prefill_tokens, step.decode_tokens, step.context_tokens
        )

    def learn(self, step: StepRecord, clock_mhz: int) -> None:
        if self.rls.updates > 0:
            self.surprises.append(step.duration_s / self.predict_step_s(step, clock_mhz))
        ratio = self.f_max / max(clock_mhz, 1)
        x = _step_features(ratio, step.prefill_tokens, step.decode_tokens, step.context_tokens)
        self.rls.update(x, step.duration_s)
        self.samples_by_clock[clock_mhz] = self.samples_by_clock.get(clock_mhz, 0) + 1
        weight = max(1.0 / max(self.rls.updates, 1), 1.0 - self.rls.forgetting)
        self.stretch_mean += weight * (max(ratio - 1.0, 0.0) - self.stretch_mean)
        if step.decode_tokens >= 1:
            bucket = 1 << (int(step.decode_tokens).bit_length() - 1)
            self.samples_by_batch[bucket] = self.samples_by_batch.get(bucket, 0) + 1

    @property
    def samples(self) -> int:
        return self.rls.updates

    @property
    def surprise(self) -> float:
        """The median (nearest rank) of the latest steps' measured over predicted
        durations (1 before there are any): far from 1, the model no longer describes the
        engine (a sudden slowdown, another workload), and its fit swings while it
        re-learns."""
        return percentile_of(self.surprises, 50.0) if self.surprises else 1.0

    def batch_seen(self, min_samples: int) -> int:
        """The largest decode batch the model has been fitted around: the top of the
        highest power-of-two bucket with at least min_samples steps at or above it (0
        when it has seen fewer decode steps than that)."""
        total = 0
        for bucket in sorted(self.samples_by_batch, reverse=True):
            total += self.samples_by_batch[bucket]
            if total >= min_samples:
                return 2 * bucket - 1
        return 0

    def coefficients(
        self, clock_mhz: float, context_per_decode: float | None = None
    ) -> StepCoefficients:
        """The per-token costs at this clock. With context_per_decode (the context each
        decode token reads, as the workload has it), the context cost is folded into the
        decode cost before costs are kept >= 0: a batch's decode and context counts are
        nearly collinear, so the estimate may trade one against the other (a negative
        decode cost beside a positive context cost), and clipping each on its own would
        predict far too long a step. Callers then pass context = decode x that value."""
        stretch = max(self.f_max / max(clock_mhz, 1.0) - 1.0, 0.0)
        th = list(self.rls.theta)
        if context_per_decode is not None:
            fold = max(context_per_decode, 0.0) * _DECODE_SCALE / _CONTEXT_SCALE
            for k in (2, 6):  # top-clock and clock-stretch parts
                th[k] = th[k] + th[k + 1] * fold
                th[k + 1] = 0.0
        # A cost the fit has falling as the clock drops (b < 0) is flat at its value where
        # the steps were. (Clipping a and b each at 0 instead kept an inflated top-clock
        # decode cost and dropped its negative stretch: bf16's decode token came out at
        # 3.5 ms at 945 MHz where the steps there took 1.9.)
        per = []
        for k, kb in ((0, 4), (1, 5), (2, 6), (3, 7), (8, 9)):  # (top clock, stretch)
            b = th[kb]
            s = stretch if b >= 0 else self.stretch_mean
            per.append(max(th[k] + b * s, 0.0))
        return StepCoefficients(
            base_s=max(per[0], 0.0),
            per_prefill_token_s=max(per[1], 0.0) / _PREFILL_SCALE,
            per_decode_token_s=max(per[2], 0.0) / _DECODE_SCALE,
            per_context_token_s=max(per[3], 0.0) / _CONTEXT_SCALE,
            per_prefill_token_sq_s=per[4] / _PREFILL_SCALE**2,
        )

    def seen_clocks(self, min_samples: int) -> list[int]:
        return sorted(f for f, n in self.samples_by_clock.items() if n >= min_samples)


# ---- power ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PowerSegment:
    """A stretch of a power-averaging window at one clock: its share of the window and the
    shares of that stretch the GPU spent on decode-only steps and on steps with prefill."""

    weight: float
    clock_mhz: int
    decode_busy: float
    prefill_busy: float
    prefill_tokens: float = 0.0  # the prefill tokens of its steps with prefill (each)


def _power_features(
    g: float, decode_busy: float, prefill_busy: float, temp_term: float, prefill_tokens: float
) -> list[float]:
    g3 = g * g * g
    # Last, the prefill busy share weighted by its steps' tokens: a step that computes
    # more tokens is more compute-bound and draws more power at the same clock.
    intense = prefill_busy * prefill_tokens / _PREFILL_SCALE
    return [
        1.0,
        temp_term,
        decode_busy,
        prefill_busy,
        g,
        g * decode_busy,
        g * prefill_busy,
        g3,
        g3 * decode_busy,
        g3 * prefill_busy,
        g * intense,
        g3 * intense,
    ]


class PowerModel:
    """Board power of one quantization level in a window, linear in its parameters:

        P / P_ref = c0 + cT (T - 50)/10 + (c_d, c_p) . busy + sum_{g in f/f_max, (f/f_max)^3}
                    g * (e0 + e_d busy_decode + e_p busy_prefill + e_n busy_prefill n)

    busy_decode / busy_prefill: shares of the window spent in decode-only steps and in
    steps with prefill; n: the prefill tokens of each of those steps (hundreds), so a big
    chunk's step draws more than a small one's (the prior's e_n is 0). A prediction that
    names no chunk is for steps like the ones learned from. The prior (before any data)
    is a generic accelerator: idle about 16 % of P_ref at the top clock, decode about a
    third, prefill at P_ref.
    """

    def __init__(self, sm_clock_max_mhz: int, reference_w: float, forgetting: float = 0.99):
        self.f_max = float(sm_clock_max_mhz)
        self.reference_w = float(reference_w)
        prior = [0.1, 0.0, 0.1, 0.1, 0.06, 0.0, 0.0, 0.0, 0.1, 0.7, 0.0, 0.0]
        self.rls = RecursiveLeastSquares(prior, p0=0.05, forgetting=forgetting, max_trace=5.0)
        self.samples_by_clock: dict[int, int] = {}
        # The prefill tokens of the steps with prefill learned from (time-weighted, EWMA):
        # a prediction that names no chunk is for steps like those.
        self.prefill_tokens_mean: float | None = None

    def _features(self, segments: Sequence[PowerSegment], temp_c: float | None) -> list[float]:
        temp_term = 0.0 if temp_c is None else (temp_c - 50.0) / 10.0
        total = [0.0] * len(self.rls.theta)
        for seg in segments:
            x = _power_features(
                seg.clock_mhz / self.f_max,
                seg.decode_busy,
                seg.prefill_busy,
                temp_term,
                seg.prefill_tokens,
            )
            for i, v in enumerate(x):
                total[i] += seg.weight * v
        return total

    def learn(
        self, segments: Sequence[PowerSegment], temp_c: float | None, measured_w: float
    ) -> None:
        if not segments:
            return
        self.rls.update(self._features(segments, temp_c), measured_w / self.reference_w)
        for seg in segments:
            if seg.prefill_busy > 0 and seg.weight > 0:
                mean = self.prefill_tokens_mean
                a = min(1.0, 0.05 * seg.weight * seg.prefill_busy)
                self.prefill_tokens_mean = (
                    seg.prefill_tokens if mean is None else mean + a * (seg.prefill_tokens - mean)
                )
            if seg.weight >= 0.5:
                self.samples_by_clock[seg.clock_mhz] = (
                    self.samples_by_clock.get(seg.clock_mhz, 0) + 1
                )

    @property
    def samples(self) -> int:
        return self.rls.updates

    def predict_w(
        self,
        clock_mhz: float,
        decode_busy: float,
        prefill_busy: float,
        temp_c: float | None,
        prefill_tokens: float | None = None,
    ) -> float:
        """prefill_tokens: of each step with prefill (None: the mean learned from)."""
        if prefill_tokens is None:
            prefill_tokens = self.prefill_tokens_mean or 0.0
        seg = PowerSegment(1.0, int(clock_mhz), decode_busy, prefill_busy, prefill_tokens)
        return max(0.0, self.rls.predict(self._features([seg], temp_c)) * self.reference_w)


# ---- workload -----------------------------------------------------------------------------


class Ewma:
    """Exponentially weighted mean over time with time constant tau_s."""

    def __init__(self, tau_s: float, initial: float | None = None) -> None:
        self.tau_s = tau_s
        self.value = initial

    def add(self, value: float, dt_s: float) -> float:
        if self.value is None:
            self.value = value
        else:
            a = 1.0 - math.exp(-max(dt_s, 0.0) / self.tau_s)
            self.value += a * (value - self.value)
        return self.value


@dataclass(frozen=True)
class Chunking:
    """How prompts split into prefill chunks of at most some room, per prompt on average:
    chunks, tokens, and the sum of the chunks' squared sizes (what a step cost growing
    with its tokens is paid on)."""

    chunks: float
    tokens: float
    tokens_sq: float

    @property
    def weighted_chunk(self) -> float:
        """The mean chunk a prompt token is computed in (token-weighted)."""
        return self.tokens_sq / self.tokens if self.tokens > 0 else 0.0


@dataclass(frozen=True)
class Workload:
    """The offered load, as rates (per second) and means, and the recent prompts' sizes."""

    request_rate_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    mean_prompt_tokens: float
    mean_context_tokens: float  # context each decode token reads
    prefill_time_share: float | None = None  # share of busy time in steps with prefill
    prompt_sizes: tuple[float, ...] = ()  # the last PROMPT_SIZES_KEPT prompts (tokens)
    # The relative standard error of the request rate: arrivals at random, counted over
    # the estimator's time constant, leave the rates this uncertain (0: not estimated).
    rate_rel_error: float = 0.0

    def upper(self, z: float) -> Workload:
        """The load z standard errors above the estimate (rates scaled together)."""
        factor = 1.0 + z * self.rate_rel_error
        if factor <= 1.0:
            return self
        return replace(
            self,
            request_rate_per_s=self.request_rate_per_s * factor,
            prompt_tokens_per_s=self.prompt_tokens_per_s * factor,
            output_tokens_per_s=self.output_tokens_per_s * factor,
        )

    @property
    def is_idle(self) -> bool:
        return self.output_tokens_per_s <= 0 and self.prompt_tokens_per_s <= 0

    def chunking(self, room: float) -> Chunking:
        """The recent prompts (the mean prompt without them) in chunks of `room`, scaled
        to the mean prompt: the spread of sizes is what sets the squares' sum."""
        room = max(room, 1.0)
        sizes = self.prompt_sizes or (self.mean_prompt_tokens,)
        total = sum(sizes)
        scale = self.mean_prompt_tokens * len(sizes) / total if total > 0 else 1.0
        chunks = tokens_sq = 0.0
        for size in sizes:
            full, rest = divmod(max(size * scale, 0.0), room)
            chunks += full + (1.0 if rest > 0 else 0.0)
            tokens_sq += full * room * room + rest * rest
        n = len(sizes)
        return Chunking(max(chunks / n, 1.0), self.mean_prompt_tokens, tokens_sq / n)


# The mean prompt is the plain mean of the requests seen until there are this many, then a
# mean that forgets over about as many. (Weighted by seconds x requests, as it once was, the
# first request's prompt held 3/4 of the weight a minute into steady load, and the model
# took a 96-token mix for 200-300 tokens.)
MEAN_PROMPT_REQUESTS = 30.0
# How many recent prompts' sizes the workload keeps (for how they split into chunks).
PROMPT_SIZES_KEPT = 64


@dataclass(frozen=True)
class Surge:
    """Arrivals over a short window far above what the smoothed rate before it gives."""

    requests: int
    window_s: float
    expected: float  # requests the rate estimated before the window gives for it
    tail: float  # Poisson probability of at least that many at that rate

    def describe(self) -> str:
        return (
            f"arrivals surging: {self.requests} in {self.window_s:.1f} s "
            f"against {self.expected:.1f} expected"
        )


def poisson_tail(n: int, mean: float) -> float:
    """P(N >= n) for N Poisson with this mean."""
    if n <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    term = math.exp(-mean)
    below = term
    for k in range(1, n):
        term *= mean / k
        below += term
    return max(0.0, 1.0 - below)


# No surge is called before the rate has been estimated for this many time constants:
# the estimate starts at 0 and climbs, so the first seconds of any load look like a surge
# against it (on steady loads every early call came before 8 s).
SURGE_WARMUP_TAUS = 2.0


class WorkloadEstimator:
    """Rates from the engine's cumulative counters, smoothed over tau_s; and whether the
    latest surge_window_s of arrivals are a surge (Surge) against the rate estimated before
    them: at least surge_min_ratio x what it gives, with Poisson probability under
    surge_alpha (a steady load's bunching passes that rarely; a burst at twice the load
    passes it within a few seconds)."""

    def __init__(
        self,
        tau_s: float,
        surge_window_s: float = 2.0,
        surge_alpha: float = 1e-5,
        surge_min_ratio: float = 2.0,
    ) -> None:
        self._rate = Ewma(tau_s, 0.0)
        self._prompt = Ewma(tau_s, 0.0)
        self._output = Ewma(tau_s, 0.0)
        # Over requests, not seconds: each tick's arrivals weigh by their count.
        self._mean_prompt: float | None = None
        self._prompt_requests = 0
        # A tick's new prompts each as their mean (one a tick, mostly, at these periods).
        self._prompt_sizes: deque[float] = deque(maxlen=PROMPT_SIZES_KEPT)
        self._context = Ewma(tau_s)
        self._prefill_share = Ewma(tau_s)
        self._last: tuple[float, int, int, int] | None = None
        # When a request last arrived, and the request rate estimated then.
        self.last_arrival_s: float | None = None
        self.rate_at_last_arrival_per_s = 0.0
        self.surge_window_s = surge_window_s
        self.surge_alpha = surge_alpha
        self.surge_min_ratio = surge_min_ratio
        # (time, requests so far, the rate estimated then), the window's span and one more.
        self._arrivals: deque[tuple[float, int, float]] = deque()
        self.surge: Surge | None = None  # as of the latest update
        self._first_update_s: float | None = None

    def lull(self, now_s: float, gaps: float, min_s: float) -> bool:
        """No request has arrived for `gaps` mean gaps at the rate estimated when the last
        one came (at least min_s): by chance once in e^gaps gaps of a steady load."""
        if self.last_arrival_s is None or self.rate_at_last_arrival_per_s <= 0:
            return False
        quiet_s = max(min_s, gaps / self.rate_at_last_arrival_per_s)
        return now_s - self.last_arrival_s >= quiet_s

    def update(
        self,
        now_s: float,
        requests_total: int,
        prompt_tokens_total: int,
        output_tokens_total: int,
        steps: Sequence[StepRecord],
        paced: bool = False,
    ) -> None:
        """paced: decode pacing was in force over these steps; the prefill share is then
        left as it was (pacing shrinks the decode time, not the prefill work, and the share
        scales the unpaced busy time predictions start from)."""
        if self._last is not None:
            t0, r0, p0, o0 = self._last
            dt = now_s - t0
            if dt > 0:
                dr = max(requests_total - r0, 0)
                dp = max(prompt_tokens_total - p0, 0)
                do = max(output_tokens_total - o0, 0)
                self._rate.add(dr / dt, dt)
                self._prompt.add(dp / dt, dt)
                self._output.add(do / dt, dt)
                if dr > 0:
                    self._prompt_requests += dr
                    a = max(dr / self._prompt_requests, 1.0 - math.exp(-dr / MEAN_PROMPT_REQUESTS))
                    prev = self._mean_prompt if self._mean_prompt is not None else dp / dr
                    self._mean_prompt = prev + a * (dp / dr - prev)
                    self._prompt_sizes.extend([dp / dr] * min(dr, PROMPT_SIZES_KEPT))
                    self.last_arrival_s = now_s
                    self.rate_at_last_arrival_per_s = self._rate.value or 0.0
        self._last = (now_s, requests_total, prompt_tokens_total, output_tokens_total)
        self.surge = self._surge(now_s, requests_total)
        decode = sum(s.decode_tokens for s in steps)
        if decode > 0:
            ctx = sum(s.context_tokens for s in steps) / decode
            self._context.add(ctx, 1.0)
        busy = sum(s.duration_s for s in steps)
        if busy > 0 and not paced:
            share = sum(s.duration_s for s in steps if s.has_prefill) / busy
            self._prefill_share.add(share, busy)

    def _surge(self, now_s: float, requests_total: int) -> Surge | None:
        """The arrivals since the newest update at least surge_window_s old, set against
        the rate estimated at that update (before them)."""
        hist = self._arrivals
        hist.append((now_s, requests_total, self._rate.value or 0.0))
        while len(hist) > 1 and now_s - hist[1][0] >= self.surge_window_s:
            hist.popleft()
        if self._first_update_s is None:
            self._first_update_s = now_s
        if now_s - self._first_update_s < SURGE_WARMUP_TAUS * self._rate.tau_s:
            return None
        t0, total0, rate0 = hist[0]
        span_s = now_s - t0
        if span_s < self.surge_window_s or rate0 <= 0:
            return None
        n = requests_total - total0
        expected = rate0 * span_s
        if n < max(3.0, self.surge_min_ratio * expected):
            return None
        tail = poisson_tail(n, expected)
        if tail >= self.surge_alpha:
            return None
        return Surge(n, span_s, expected, tail)

    def current(self) -> Workload:
        return Workload(
            request_rate_per_s=self._rate.value or 0.0,
            prompt_tokens_per_s=self._prompt.value or 0.0,
            output_tokens_per_s=self._output.value or 0.0,
            mean_prompt_tokens=self._mean_prompt or 128.0,
            mean_context_tokens=self._context.value or 256.0,
            prefill_time_share=self._prefill_share.value,
            prompt_sizes=tuple(self._prompt_sizes),
            rate_rel_error=self.rate_rel_error(),
        )

    def rate_rel_error(self) -> float:
        """Poisson arrivals at rate r averaged with time constant tau: the estimate's
        variance is r / (2 tau), so its relative standard error 1 / sqrt(2 tau r)."""
        r = self._rate.value or 0.0
        if r <= 0:
            return 0.0
        return 1.0 / math.sqrt(2.0 * self._rate.tau_s * r)


# ---- from model means to percentiles -----------------------------------------------------


class QuantileRatio:
    """Ratio of measured latencies to a prediction the model made at the time, kept for
    the last `max_age_s` (and at most `window` samples). Two uses: over the predicted mean,
    its percentile turns a predicted mean into a predicted percentile; over the predicted
    percentile itself, its split-conformal quantile (`conformal`) is the factor by which
    the model under-predicts what users saw, per key (a level and clock) where that key has
    the samples, else pooled. The age limit lets a transient (a trial, a guard) stop
    counting."""

    def __init__(
        self, default: float, window: int = 200, min_samples: int = 10, max_age_s: float = 120.0
    ) -> None:
        self.default = default
        self.min_samples = min_samples
        self.max_age_s = max_age_s
        # (time, ratio, key), oldest first; key None: not attributed to a configuration.
        self._ratios: deque[tuple[float, float, object]] = deque(maxlen=window)
        # conformal() answers by (alpha, key) until the ratios change (asked for every
        # candidate configuration at each observation).
        self._conformal_memo: dict[tuple[float, object], float | None] = {}

    def add(self, now_s: float, measured: float, predicted: float, key: object = None) -> None:
        if predicted > 0 and math.isfinite(measured) and measured >= 0:
            self._ratios.append((now_s, measured / predicted, key))
            self._conformal_memo.clear()

    def clear(self) -> None:
        self._ratios.clear()
        self._conformal_memo.clear()

    def __len__(self) -> int:
        return len(self._ratios)

    def _expire(self, now_s: float) -> None:
        while self._ratios and now_s - self._ratios[0][0] > self.max_age_s:
            self._ratios.popleft()
            self._conformal_memo.clear()

    def ratio(self, now_s: float, percentile: float, lo: float = 1.0, hi: float = 4.0) -> float:
        self._expire(now_s)
        if len(self._ratios) < self.min_samples:
            return self.default
        return min(hi, max(lo, percentile_of([r for _, r, _ in self._ratios], percentile)))

    def conformal(self, now_s: float, alpha: float, key: object = None) -> float | None:
        """The split-conformal (1 - alpha) quantile of the ratios: the ceil((n + 1)(1 -
        alpha))-th smallest of the n kept for `key` when they are enough for that rank
        (n >= 1/alpha - 1), else of all n kept (pooled); None when neither is enough. A
        measured latency exceeds its prediction times this factor with probability at
        most alpha, for ratios exchangeable with the next one."""
        self._expire(now_s)
        memo_key = (alpha, key)
        if memo_key not in self._conformal_memo:
            own = None
            if key is not None:
                own = conformal_quantile([r for _, r, k in self._ratios if k == key], alpha)
            if own is None:
                own = conformal_quantile([r for _, r, _ in self._ratios], alpha)
            self._conformal_memo[memo_key] = own
        return self._conformal_memo[memo_key]


def conformal_quantile(values: Sequence[float], alpha: float) -> float | None:
    """The ceil((n + 1)(1 - alpha))-th smallest of n values (0 < alpha < 1), or None when
    that rank is beyond n (too few values for a (1 - alpha) bound)."""
    n = len(values)
    rank = math.ceil((n + 1) * (1.0 - alpha) - 1e-9)
    if n == 0 or rank > n:
        return None
    return sorted(values)[max(rank, 1) - 1]


def percentile_of(values: Sequence[float], percentile: float) -> float:
    """The nearest-rank percentile (0 < percentile <= 100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(percentile / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


# ---- predictions --------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """Predicted steady state of one configuration under the current workload."""

    quant_level: str
    sm_clock_mhz: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step_s: float  # mean step time while busy
    decode_batch: float
    busy_fraction: float
    ttft_ms: float  # at the policy percentile
    tpot_ms: float  # at the policy percentile
    mean_ttft_ms: float
    mean_tpot_ms: float
    power_w: float  # mean over a second
    peak_power_w: float  # the hungriest phase (prefill, or decode when no prefill comes)
    j_per_token: float
    stable: bool  # the engine keeps up with the load

    def describe(self) -> str:
        return (
            f"{self.quant_level} @ {self.sm_clock_mhz} MHz, caps {self.max_num_seqs}/"
            f"{self.max_num_batched_tokens}: J/token {self.j_per_token:.3g}, "
            f"TTFT {self.ttft_ms:.0f} ms, TPOT {self.tpot_ms:.0f} ms, "
            f"power {self.power_w:.0f} W (peak {self.peak_power_w:.0f} W)"
        )


def predict(
    *,
    level: str,
    clock_mhz: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    workload: Workload,
    step_model: StepTimeModel,
    power_model: PowerModel,
    temp_c: float | None,
    ttft_ratio: float,
    tpot_ratio: float,
    decode_interval_s: float = 0.0,
    step_scale: float = 1.0,
) -> Prediction:
    """Steady-state prediction for continuous batching under `workload`.

    Each step serves every running request one token and feeds prefill tokens, so at a
    mean step time t the decode batch is output_rate * t and the prefill per step is
    prompt_rate * t: t = c0 + t * (c_p * prompt_rate + (c_d + c_ctx * ctx) * out_rate),
    i.e. t = c0 / (1 - u). u >= 1 means the engine cannot keep up. TTFT: half a step of
    waiting plus the prompt's chunks, stretched by 1 / (1 - rho) for queueing behind other
    prompts, rho the share of time their chunks take (decode work only lengthens a chunk's
    step, which the chunk's step time carries); TPOT: the step time. Percentiles come from
    the learned ratios. Power from the power model at the predicted busy shares.

    Decode pacing (decode_interval_s longer than the unpaced step t): a decode-only step
    starts no sooner than the interval after the one before while nothing waits. Steps
    with prefill come with the prompts; decode-only steps fill the time left, one per
    interval; TPOT is the mean gap between them, and the decode batch (output rate x that
    gap) sets each step's length. The engine idles between steps: fewer, larger steps,
    each of which reads the weights once.
    """
    w = workload
    co = step_model.coefficients(clock_mhz, w.mean_context_tokens).scaled(step_scale)
    t, stable = _unpaced_step_s(co, w, max_num_batched_tokens)
    paced = decode_interval_s > t and not w.is_idle
    period = t  # the mean time between a request's tokens
    if paced:
        period, free = _paced_period_s(co, w, max_num_batched_tokens, decode_interval_s)
        if free <= 0.05:
            stable = False
    decode_batch = max(w.output_tokens_per_s * period, 1.0 if not w.is_idle else 0.0)
    if decode_batch > max_num_seqs * 0.9:
        stable = False
    chunking, t_step, prefill_share, mean_ttft_s = _first_token_s(
        co, w, max_num_batched_tokens, decode_batch, t if not paced else None
    )
    mean_tpot_s = period
    out_per_req = w.output_tokens_per_s / w.request_rate_per_s if w.request_rate_per_s > 0 else 0
    concurrency = w.request_rate_per_s * (mean_ttft_s + out_per_req * period)
    busy, prefill_busy = _busy_shares(
        w, concurrency, prefill_share, t_step, decode_interval_s, paced and stable
    )
    power, peak = _power_w(
        power_model, clock_mhz, busy, prefill_busy, temp_c, chunking.weighted_chunk, w
    )
    j_per_token = power / w.output_tokens_per_s if w.output_tokens_per_s > 0 else math.inf
    if not stable:
        j_per_token = math.inf
    return Prediction(
        quant_level=level,
        sm_clock_mhz=clock_mhz,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        step_s=t,
        decode_batch=decode_batch,
        busy_fraction=busy,
        ttft_ms=1000.0 * mean_ttft_s * ttft_ratio if stable else math.inf,
        # The percentile spread is the unpaced step's (tpot_ratio: measured excess over the
        # mean in units of it): pacing moves the mean, not what spreads it.
        tpot_ms=1000.0 * (mean_tpot_s + (tpot_ratio - 1.0) * t) if stable else math.inf,
        mean_ttft_ms=1000.0 * mean_ttft_s,
        mean_tpot_ms=1000.0 * mean_tpot_s,
        power_w=power,
        peak_power_w=peak,
        j_per_token=j_per_token,
        stable=stable,
    )


def _first_token_s(
    co: StepCoefficients,
    w: Workload,
    max_num_batched_tokens: int,
    decode_batch: float,
    unpaced_step_s: float | None,
) -> tuple[Chunking, float, float, float]:
    """The prompts' chunking, the step in progress when a request arrives, the share of
    time on prompts' chunks (rho), and the mean TTFT (s). unpaced_step_s: the unpaced mean
    step (None: paced, the decode batch's step)."""
    ctx = w.mean_context_tokens
    # The prompts in chunks of what the token cap leaves beside the decode batch: the
    # steps a mean prompt takes (their fixed and decode costs once per chunk, the squared
    # prefill cost on the chunks' sizes, so a smaller cap costs steps and saves squares).
    chunking = w.chunking(max(max_num_batched_tokens - decode_batch, 1.0))
    t_prompt = co.prompt_s(chunking, decode_batch, decode_batch * ctx)
    # A step in progress when a request arrives: the unpaced mean step, or a paced batch's.
    t_step = (
        co.step_s(0, decode_batch, decode_batch * ctx) if unpaced_step_s is None else unpaced_step_s
    )
    # The share of time spent on prompts' chunks (rho). Arrivals queue behind each other's
    # prefill: waiting grows like 1 / (1 - rho).
    prefill_share = w.request_rate_per_s * t_prompt
    mean_ttft_s = (0.5 * t_step + t_prompt) / max(1.0 - prefill_share, 0.05)
    return chunking, t_step, prefill_share, mean_ttft_s


def _unpaced_step_s(
    co: StepCoefficients, w: Workload, max_num_batched_tokens: int
) -> tuple[float, bool]:
    """The mean unpaced step time under load, and whether the engine keeps up (u < 0.95)."""
    per_decode = co.per_decode_token_s + co.per_context_token_s * w.mean_context_tokens
    # The squared prefill cost, on the prompts' chunks at the full token cap.
    square_s = co.per_prefill_token_sq_s * w.request_rate_per_s
    square_s *= w.chunking(max_num_batched_tokens).tokens_sq
    u = co.per_prefill_token_s * w.prompt_tokens_per_s + per_decode * w.output_tokens_per_s
    u += square_s
    stable = u < 0.95
    t_loaded = co.base_s / max(1.0 - u, 0.05)
    # With less than one request decoding per step, a step still decodes one token.
    t_single = (co.base_s + per_decode) / max(
        1.0 - co.per_prefill_token_s * w.prompt_tokens_per_s - square_s, 0.05
    )
    t = (
        t_loaded
        if w.output_tokens_per_s * t_loaded >= 1.0
        else max(t_loaded, min(t_single, t_loaded * 2))
    )
    return t, stable


def _paced_period_s(
    co: StepCoefficients, w: Workload, max_num_batched_tokens: int, decode_interval_s: float
) -> tuple[float, float]:
    """The mean gap between a paced request's tokens, and the share of time the prompts'
    chunks leave free for decode-only steps.

    Steps with prefill (each arriving prompt's chunks) run as they come; decode-only
    steps fill the rest of the time, one per interval (or per step, if longer). A
    running request gets a token from each, so the mean gap between its tokens is
    1 / (steps per second), and the decode batch that gap holds (output rate x gap)
    sets every step's length: a fixed point, found in a few rounds.
    Where the prompts' chunks leave no time free (a small token cap: every step
    carries prefill), the decode batch rides on them alone; the engine keeps up if
    they fit the time at the batch their own gap holds.
    """
    ctx = w.mean_context_tokens
    period = decode_interval_s
    free = 1.0
    for _ in range(4):
        batch = max(w.output_tokens_per_s * period, 1.0)
        room_chunks = w.chunking(max(max_num_batched_tokens - batch, 1.0))
        t_prompt = co.prompt_s(room_chunks, batch, batch * ctx)
        t_decode_step = co.step_s(0, batch, batch * ctx)
        prefill_steps_per_s = w.request_rate_per_s * room_chunks.chunks
        free = 1.0 - w.request_rate_per_s * t_prompt
        decode_steps_per_s = max(free, 0.0) / max(decode_interval_s, t_decode_step)
        period = 1.0 / (prefill_steps_per_s + decode_steps_per_s)
    return period, free


def _busy_shares(
    w: Workload,
    concurrency: float,
    prefill_share: float,
    t_step: float,
    decode_interval_s: float,
    paced_and_stable: bool,
) -> tuple[float, float]:
    """The share of time the engine is busy, and the share busy with prefill."""
    busy = 1.0 - math.exp(-concurrency) if not w.is_idle else 0.0
    if w.prefill_time_share is not None:
        prefill_busy = busy * w.prefill_time_share  # measured: prefill is chunked unevenly
    else:
        prefill_busy = min(busy, prefill_share)
    if paced_and_stable:
        # Busy for the steps counted above, idle in between.
        step_busy = prefill_share + (1.0 - prefill_share) * min(1.0, t_step / decode_interval_s)
        busy = min(busy, step_busy)
        prefill_busy = min(busy, prefill_share)
    return busy, prefill_busy


def _power_w(
    power_model: PowerModel,
    clock_mhz: int,
    busy: float,
    prefill_busy: float,
    temp_c: float | None,
    chunk: float,
    w: Workload,
) -> tuple[float, float]:
    """The mean power at these busy shares, and the hungriest phase's (prefill, or decode
    when no prefill comes)."""
    decode_busy = max(busy - prefill_busy, 0.0)
    power = power_model.predict_w(clock_mhz, decode_busy, prefill_busy, temp_c, chunk)
    decode_phase = power_model.predict_w(clock_mhz, 1.0, 0.0, temp_c)
    prefill_phase = power_model.predict_w(clock_mhz, 0.0, 1.0, temp_c, chunk)
    peak = max(decode_phase, prefill_phase) if w.prompt_tokens_per_s > 0 else decode_phase
    return power, peak


def idle_ttft_ms(
    step_model: StepTimeModel, clock_mhz: int, prompt_tokens: float, max_num_batched_tokens: int
) -> float:
    """Mean TTFT of one request arriving at an idle engine at this clock."""
    co = step_model.coefficients(clock_mhz)
    chunks = max(1.0, math.ceil(prompt_tokens / max_num_batched_tokens))
    per_chunk = min(prompt_tokens, max_num_batched_tokens)
    return 1000.0 * chunks * co.step_s(per_chunk, 0.0, 0.0)
