"""Seeded workloads: the request mix, Poisson arrivals thinned to a load curve, and the
named scenarios (load, budget and inlet temperature over time) of `bench control`.

Pure functions of their seeds; no device, no engine, no clock.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass


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
        prompt = prompt_tokens(rng, mix)
        output = rng.randint(mix.output_min_tokens, mix.output_max_tokens)
        if keep:
            out.append((t, prompt, output))
    return out


def prompt_tokens(rng: random.Random, mix: RequestMix) -> int:
    """One prompt length: log-normal around the median, clipped to the mix's range."""
    drawn = rng.lognormvariate(math.log(mix.prompt_median_tokens), mix.prompt_sigma)
    return int(min(max(drawn, mix.prompt_min_tokens), mix.prompt_max_tokens))


def _grid(duration_s: float) -> list[float]:
    return [duration_s * i / 1000 for i in range(1001)]
