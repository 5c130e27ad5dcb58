"""`wattserve bench control-ceiling`: how much energy any fixed setting could save, in
hindsight, on one `bench control` scenario (steady 60 % by default), against the max-clock
baseline of the same run. It answers whether a J/token target is within reach of the
knobs at all, before blaming the controller for missing it.

It runs the engine model (daemon.sim) on the same seeded arrivals for a grid of
fixed settings, in four families, and reports the least J/token with >= 99 % attainment in
each:
- one level and one locked clock (what `best_static` searches, on a finer clock grid);
- per-phase clocks: steps with prefill at one clock, decode-only steps at another;
- decode pacing: a decode-only step starts no sooner than an interval after the previous
  one while no request waits (bigger decode batches, idle gaps between steps);
- both.
Per-phase clocks are a mechanism of the engine model only, here to measure what they would
be worth; decode pacing is the engine's knob (EngineLimits.decode_interval_ms) and the
controller's. Nothing in this module is a controller or a baseline: every setting knows
the whole trace in advance.
Prints one line per family and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from bench.control import DEFAULT_LEVELS, add_calibration_args, load_or_calibrate
from bench.control_systems import run_model
from controller.policy import ControlMode, Policy
from daemon.sim.metrics import summarize
from daemon.sim.run import measure_capacity
from daemon.sim.scenarios import RequestMix, make_scenarios

PREFILL_CLOCKS_MHZ = (495, 645, 795, 945, 1095, 1245)
DECODE_CLOCKS_MHZ = (345, 495, 645)
DECODE_INTERVALS_MS = (100.0, 150.0, 200.0, 250.0)
FAMILIES = ("one_clock", "phase_clocks", "paced", "phase_clocks_paced")


def _family(mhz: int, decode_mhz: int, interval_ms: float) -> str:
    split = decode_mhz != mhz
    if interval_ms > 0:
        return "phase_clocks_paced" if split else "paced"
    return "phase_clocks" if split else "one_clock"


def grid(
    levels: tuple[str, ...],
    clocks_mhz: tuple[int, ...] = PREFILL_CLOCKS_MHZ,
    decode_clocks_mhz: tuple[int, ...] = DECODE_CLOCKS_MHZ,
    intervals_ms: tuple[float, ...] = DECODE_INTERVALS_MS,
) -> list[tuple[str, int, int, float]]:
    """(level, clock, decode-only clock, decode interval ms); decode never above prefill."""
    out = []
    for level, mhz, interval in itertools.product(levels, clocks_mhz, (0.0, *intervals_ms)):
        for decode_mhz in sorted({mhz, *(d for d in decode_clocks_mhz if d < mhz)}):
            out.append((level, mhz, decode_mhz, interval))
    return out


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench control-ceiling", description=__doc__)
    ap.add_argument("--scenario", default="steady60")
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--levels", type=lambda s: tuple(s.split(",")), default=DEFAULT_LEVELS)
    ap.add_argument("--clocks-mhz", type=_ints, default=PREFILL_CLOCKS_MHZ)
    ap.add_argument("--decode-clocks-mhz", type=_ints, default=DECODE_CLOCKS_MHZ)
    ap.add_argument("--intervals-ms", type=_floats, default=DECODE_INTERVALS_MS)
    ap.add_argument("--budget-w", type=float, default=300.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=400.0)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    add_calibration_args(ap)
    args = ap.parse_args(argv)

    cal, _ = load_or_calibrate(args)
    start = cal.full_precision
    levels = tuple(lv for lv in args.levels if lv in cal.levels)
    mix = RequestMix()
    policy = Policy(
        power_budget_w=args.budget_w,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        mode=ControlMode.AUTO,
    )
    capacity = measure_capacity(cal, start, mix)
    scenario = make_scenarios(args.duration_s, args.budget_w, 220.0, 180.0)[args.scenario]

    def run(system: str) -> dict:
        res = run_model(scenario, system, cal, capacity, mix, policy, levels, start)
        return summarize(res, policy, scenario)

    t0 = time.perf_counter()
    base = run("max_clock")
    ctrl = run("controller")
    best: dict[str, tuple[float, dict, str]] = {}
    settings = grid(levels, args.clocks_mhz, args.decode_clocks_mhz, args.intervals_ms)
    for level, mhz, decode_mhz, interval in settings:
        r = run(f"fixed:{level}:{mhz}:{decode_mhz}:{interval:g}")
        if (r["attainment_pct"] or 0) < 99.0:
            continue
        fam = _family(mhz, decode_mhz, interval)
        label = (
            f"{level} @ {mhz} MHz"
            + (f", decode-only @ {decode_mhz} MHz" if decode_mhz != mhz else "")
            + (f", decode every >= {interval:g} ms" if interval else "")
        )
        if fam not in best or r["j_per_token"] < best[fam][0]:
            best[fam] = (r["j_per_token"], r, label)

    def saving(j: float) -> float:
        return round(100.0 * (1.0 - j / base["j_per_token"]), 2)

    print(
        f"{scenario.name}: max_clock {base['j_per_token']} J/token at "
        f"{base['attainment_pct']} %; controller {ctrl['j_per_token']} J/token at "
        f"{ctrl['attainment_pct']} % ({saving(ctrl['j_per_token'])} % saved); "
        f"{len(settings)} fixed settings in {time.perf_counter() - t0:.0f} s"
    )
    line: dict = {
        "scenario": scenario.name,
        "max_clock_j_per_token": base["j_per_token"],
        "max_clock_attainment_pct": base["attainment_pct"],
        "controller_saving_pct": saving(ctrl["j_per_token"]),
        "controller_attainment_pct": ctrl["attainment_pct"],
    }
    for fam in FAMILIES:
        if fam not in best:
            print(f"{fam:>20}: no setting reached 99 % attainment")
            line[f"{fam}_saving_pct"] = None
            continue
        j, r, label = best[fam]
        print(
            f"{fam:>20}: {label}: {j} J/token ({saving(j)} % saved), attainment "
            f"{r['attainment_pct']} %, p99 TTFT {r['p99_ttft_ms']} ms, TPOT {r['p99_tpot_ms']} ms"
        )
        line[f"{fam}_saving_pct"] = saving(j)
        line[f"{fam}_setting"] = label
    print(json.dumps(line))
    return 0
