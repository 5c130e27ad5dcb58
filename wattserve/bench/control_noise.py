"""`wattserve bench control-noise`: how finely energy measured during a run can rank two
settings. One static setting runs one `bench control` scenario on the engine model; its
energy per output token is then measured over consecutive windows of each given length
(after a warm-up), as a controller trying settings one after another would measure them.

Per window length it prints the windows' J/token spread (standard deviation over mean),
the spread left once each window's idle share is taken out (energy = P0 x seconds + e x
tokens, fitted over the windows; the residual's standard deviation with two degrees of
freedom spent, over the run's J/token; from NORMALIZED_MIN_WINDOWS windows, and a lower
bound on what a comparison meets, since it fits the setting's own idle power and slope
from the very windows it judges), and how many windows of each of two settings a
difference of --gap-pct would need to stand two standard errors clear of that spread.
A window's tokens are each request's output spread evenly from its first token to its
last (the engine model's steps are not kept). Nothing here is a controller: it measures
what a controller could learn by trying. Prints one line per length and, last, one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence

from wattserve.bench.control import (
    add_calibration_args,
    add_policy_args,
    float_list,
    load_or_calibrate,
    policy_from_args,
    shift_seeds,
)
from wattserve.sim.metrics import summarize
from wattserve.sim.oracle import StaticSetting, run_static
from wattserve.sim.run import RunResult, measure_capacity
from wattserve.sim.scenarios import RequestMix, make_scenarios

# The idle-removed fit spends two degrees of freedom: below this many windows its residual
# says little (four 60 s windows of a 300 s run left 0.16 %).
NORMALIZED_MIN_WINDOWS = 6


def tokens_between(requests: Sequence[tuple], t0_s: float, t1_s: float) -> float:
    """Output tokens in [t0_s, t1_s): a request's first token at arrival + TTFT, the rest
    spread evenly over the TPOT x (tokens - 1) that follow."""
    total = 0.0
    for arrival, ttft, tpot, out in requests:
        if ttft is None or out <= 0:
            continue
        first = arrival + ttft
        if t0_s <= first < t1_s:
            total += 1.0
        last = first + (tpot or 0.0) * (out - 1)
        if out > 1 and last > first:
            lo, hi = max(t0_s, first), min(t1_s, last)
            if hi > lo:
                total += (out - 1) * (hi - lo) / (last - first)
    return total


def energy_between(samples: Sequence, t0_s: float, t1_s: float) -> float:
    """Joules in [t0_s, t1_s) from the run's power samples (each the mean power since the
    one before it)."""
    joules = 0.0
    prev_t = None
    for s in samples:
        if prev_t is not None:
            lo, hi = max(t0_s, prev_t), min(t1_s, s.t_s)
            if hi > lo:
                joules += s.power_w * (hi - lo)
        prev_t = s.t_s
    return joules


def window_spread(
    windows: Sequence[tuple[float, float]], window_s: float, run_j_per_token: float
) -> dict:
    """(joules, tokens) per window -> the raw and idle-removed spreads (percent)."""
    kept = [(e, k) for e, k in windows if k > 0]
    n = len(kept)
    out: dict = {"window_s": window_s, "windows": n}
    if n < 4:
        return out
    js = [e / k for e, k in kept]
    raw_pct = 100.0 * statistics.stdev(js) / statistics.fmean(js)
    out["raw_spread_pct"] = round(raw_pct, 2)
    out["raw_pair_spread_pct"] = round(raw_pct * math.sqrt(2.0), 2)
    if n < NORMALIZED_MIN_WINDOWS:
        return out
    es, ks = zip(*kept, strict=True)
    k_mean, e_mean = statistics.fmean(ks), statistics.fmean(es)
    sxx = sum((k - k_mean) ** 2 for k in ks)
    if sxx <= 0:
        return out
    slope = sum((k - k_mean) * (e - e_mean) for k, e in zip(ks, es, strict=True)) / sxx
    idle_w = (e_mean - slope * k_mean) / window_s
    resid = [(e - idle_w * window_s - slope * k) / k for k, e in zip(ks, es, strict=True)]
    ss = sum(r * r for r in resid)
    norm_pct = 100.0 * math.sqrt(ss / (n - 2)) / run_j_per_token
    out["idle_w"] = round(idle_w, 1)
    out["j_per_token_over_idle"] = round(slope, 4)
    out["normalized_spread_pct"] = round(norm_pct, 2)
    return out


def windows_needed(spread_pct: float, gap_pct: float) -> int:
    """Windows of each of two settings for a gap of gap_pct to stand two standard errors
    clear: the difference of two means of n windows has sd spread x sqrt(2 / n)."""
    if not gap_pct > 0:
        raise ValueError(f"gap_pct must be > 0, got {gap_pct!r}")
    return max(1, math.ceil(2.0 * (2.0 * spread_pct / gap_pct) ** 2))


def measure(
    res: RunResult, windows_s: Sequence[float], warmup_s: float, end_s: float, gap_pct: float
) -> list[dict]:
    j_run = res.energy_j / res.output_tokens if res.output_tokens else math.nan
    rows = []
    for w in windows_s:
        spans, t = [], warmup_s
        while t + w <= end_s + 1e-9:
            spans.append(
                (energy_between(res.samples, t, t + w), tokens_between(res.requests, t, t + w))
            )
            t += w
        row = window_spread(spans, w, j_run)
        for key in ("raw_spread_pct", "normalized_spread_pct"):
            if key in row:
                row[key.replace("spread_pct", "windows_needed")] = windows_needed(row[key], gap_pct)
        rows.append(row)
    return rows


def _setting(text: str) -> StaticSetting:
    """level:clock MHz:max seqs:max batched tokens:decode interval ms, for argparse."""
    try:
        level, clock, seqs, tokens, interval = text.split(":")
        return StaticSetting(level, int(clock), int(seqs), int(tokens), float(interval))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not level:clock:seqs:tokens:interval (e.g. bf16:435:64:64:100): {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench control-noise", description=__doc__)
    ap.add_argument("--scenario", default="steady60")
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument(
        "--setting",
        type=_setting,
        default=_setting("bf16:435:64:64:100"),
        help="level:clock MHz:max seqs:max batched tokens:decode interval ms "
        "(default: the oracle's on steady 60 %%, default seeds)",
    )
    ap.add_argument("--windows-s", type=float_list, default=(10.0, 20.0, 30.0, 60.0))
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--gap-pct", type=float, default=1.5, help="the J/token gap to resolve")
    ap.add_argument("--duration-s", type=float, default=300.0)
    add_policy_args(ap)
    add_calibration_args(ap)
    args = ap.parse_args(argv)
    policy = policy_from_args(ap, args)
    if not all(w > 0 for w in args.windows_s):
        ap.error(f"--windows-s: every window must be > 0 s, got {args.windows_s}")
    if not args.gap_pct > 0:
        ap.error(f"--gap-pct must be > 0, got {args.gap_pct:g}")
    if not 0 <= args.warmup_s < args.duration_s:
        ap.error("--warmup-s must be >= 0 and shorter than --duration-s")
    scenarios = shift_seeds(
        make_scenarios(args.duration_s, args.budget_w, args.step_budget_w, args.low_budget_w),
        args.seed_offset,
    )
    if args.scenario not in scenarios:
        ap.error(f"--scenario: one of {', '.join(scenarios)}, got {args.scenario!r}")
    scenario = scenarios[args.scenario]
    args.levels = (args.setting.level,)  # the one level the setting runs

    cal, _ = load_or_calibrate(args)
    start = cal.full_precision
    mix = RequestMix()
    capacity = measure_capacity(cal, start, mix)
    res = run_static(scenario, args.setting, cal, capacity, mix, policy, start)
    summary = summarize(res, policy, scenario)
    rows = measure(res, args.windows_s, args.warmup_s, args.duration_s, args.gap_pct)
    print(
        f"{scenario.name} (seed offset {args.seed_offset}), {args.setting.label}: "
        f"{summary['j_per_token']} J/token, attainment {summary['attainment_pct']} %"
    )
    for row in rows:
        print(
            f"  {row['window_s']:>5g} s windows ({row['windows']}): J/token spread "
            f"{row.get('raw_spread_pct')} %, idle removed {row.get('normalized_spread_pct')} %; "
            f"windows a setting for a {args.gap_pct:g} % gap: {row.get('raw_windows_needed')} "
            f"raw, {row.get('normalized_windows_needed')} idle removed"
        )
    line = {
        "scenario": scenario.name,
        "seed_offset": args.seed_offset,
        "setting": args.setting.label,
        "j_per_token": summary["j_per_token"],
        "attainment_pct": summary["attainment_pct"],
        "gap_pct": args.gap_pct,
        "windows": rows,
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
