"""The figures of one run: SLO attainment, p99 TTFT and TPOT, J per output token, time
over budget, peak temperature, knob changes, and the settling time and overshoot after a
budget step. Pure functions of a RunResult; no plotting, no printing.
"""

from __future__ import annotations

import bisect
import math

from wattserve.controller.models import percentile_of
from wattserve.controller.policy import Policy
from wattserve.sim.run import RunResult
from wattserve.sim.scenarios import Scenario


def _met(ttft_s: float | None, tpot_s: float | None, policy: Policy) -> bool:
    """Whether one request met both SLOs (an unfinished one misses)."""
    return (
        ttft_s is not None
        and tpot_s is not None
        and ttft_s <= policy.ttft_slo_ms / 1000
        and tpot_s <= policy.tpot_slo_ms / 1000
    )


def slo_met(res: RunResult, policy: Policy) -> int:
    """How many of the run's requests met both SLOs (an unfinished one misses)."""
    return sum(_met(ttft, tpot, policy) for _, ttft, tpot, _ in res.requests)


def summarize(res: RunResult, policy: Policy, scenario: Scenario) -> dict:
    met = slo_met(res, policy)
    ttfts, tpots = [], []
    for _, ttft, tpot, _ in res.requests:
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
    out["misses"] = missed_requests(res, policy)
    return out


def missed_requests(res: RunResult, policy: Policy, limit: int = 20) -> list[dict]:
    """The first `limit` requests that missed an SLO, each with what the run was doing when
    it arrived (the last sample at or before its arrival): where a run's misses came from."""
    sample_times_s = [s.t_s for s in res.samples]  # in time order
    misses = []
    for arrival_s, ttft, tpot, out_tokens in sorted(res.requests, key=lambda r: r[0]):
        if _met(ttft, tpot, policy):
            continue
        i = bisect.bisect_right(sample_times_s, arrival_s)
        at = res.samples[i - 1] if i > 0 else None
        misses.append(
            {
                "arrival_s": round(arrival_s, 2),
                "ttft_ms": _ms(ttft) if ttft is not None else None,
                "tpot_ms": _ms(tpot) if tpot is not None else None,
                "output_tokens": out_tokens,
                "at_arrival": None
                if at is None
                else {
                    "sm_clock_mhz": at.sm_clock_mhz,
                    "running": at.running,
                    "waiting": at.waiting,
                    **at.knobs,
                },
            }
        )
        if len(misses) == limit:
            break
    return misses


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
