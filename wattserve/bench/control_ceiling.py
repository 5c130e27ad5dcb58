"""`wattserve bench control-ceiling`: how much energy any static setting could save, in
hindsight, on one `bench control` scenario (steady 60 % by default), against the max-clock
baseline of the same run. It answers whether a J/token target is within reach of the
knobs at all, before blaming the controller for missing it.

It runs the hindsight oracle's search (wattserve.sim.oracle: coarse grid, then a pattern
search; the least J/token with >= 99 % attainment) over restricted knob spaces, one per
family, sharing the runs between them:
- one_clock: one level and one locked clock (the engine's caps, no pacing);
- phase_clocks: steps with prefill at one clock, decode-only steps at another;
- paced: one clock and decode pacing (a decode-only step starts no sooner than an
  interval after the previous one while no request waits);
- phase_clocks_paced: both;
- oracle: clock, batch caps, level and pacing jointly (what `bench control` reports as
  the oracle; no per-phase clocks).
Per-phase clocks are a mechanism of the engine model only, here to measure what they would
be worth; the other knobs are the engine's and the controller's. Nothing in this module is
a controller or a baseline: every setting knows the whole trace in advance.
Prints one line per family and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from wattserve.bench.control import (
    DEFAULT_LEVELS,
    add_calibration_args,
    add_policy_args,
    float_list,
    int_list,
    load_or_calibrate,
    policy_from_args,
)
from wattserve.bench.control_systems import run_model
from wattserve.daemon.device.virtual import VirtualGpuParams
from wattserve.sim.metrics import summarize
from wattserve.sim.oracle import Axis, SearchSpace, default_space, scenario_evaluator, search
from wattserve.sim.run import measure_capacity
from wattserve.sim.scenarios import RequestMix, make_scenarios

DECODE_CLOCKS_MHZ = (345, 495, 645)
FAMILIES = ("one_clock", "phase_clocks", "paced", "phase_clocks_paced", "oracle")


def family_spaces(joint: SearchSpace, decode_clocks_mhz: tuple[int, ...]) -> dict[str, SearchSpace]:
    """Each family's knob space, cut from the oracle's joint one (plus per-phase clocks)."""
    caps_fixed = {
        a: Axis.of((joint.axes[a].fine[-1],)) for a in ("max_num_seqs", "max_num_batched_tokens")
    }
    unpaced = {"decode_interval_ms": Axis.of((0.0,))}
    one_clock = {"decode_clock_mhz": Axis.of((None,))}
    split = {"decode_clock_mhz": Axis.of((*decode_clocks_mhz, None))}

    def cut(**axes: Axis) -> SearchSpace:
        return dataclasses.replace(joint, axes={**joint.axes, **caps_fixed, **axes})

    return {
        "one_clock": cut(**unpaced, **one_clock),
        "phase_clocks": cut(**unpaced, **split),
        "paced": cut(**one_clock),
        "phase_clocks_paced": cut(**split),
        "oracle": joint,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench control-ceiling", description=__doc__)
    ap.add_argument("--scenario", default="steady60")
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--levels", type=lambda s: tuple(s.split(",")), default=DEFAULT_LEVELS)
    ap.add_argument(
        "--clocks-mhz", type=int_list, default=None, help="clocks to search (default: the ladder)"
    )
    ap.add_argument("--decode-clocks-mhz", type=int_list, default=DECODE_CLOCKS_MHZ)
    ap.add_argument(
        "--intervals-ms",
        type=float_list,
        default=None,
        help="decode pacing intervals besides 0 (default: every 25 ms up to 1000)",
    )
    add_policy_args(ap)
    add_calibration_args(ap)
    args = ap.parse_args(argv)
    policy = policy_from_args(ap, args)

    cal, _ = load_or_calibrate(args)
    start = cal.full_precision
    levels = tuple(lv for lv in args.levels if lv in cal.levels)
    mix = RequestMix()
    capacity = measure_capacity(cal, start, mix)
    scenario = make_scenarios(
        args.duration_s, args.budget_w, args.step_budget_w, args.low_budget_w
    )[args.scenario]

    def run(system: str) -> dict:
        res = run_model(scenario, system, cal, capacity, mix, policy, levels, start)
        return summarize(res, policy, scenario)

    t0 = time.perf_counter()
    base = run("max_clock")
    ctrl = run("controller")
    joint = default_space(
        levels, VirtualGpuParams().sm_clock_ladder_mhz(), block_size_tokens=cal.block_size_tokens
    )
    given = {}
    if args.clocks_mhz:
        given["sm_clock_mhz"] = Axis.of(args.clocks_mhz)
    if args.intervals_ms:
        given["decode_interval_ms"] = Axis.of((0.0, *args.intervals_ms))
    joint = dataclasses.replace(joint, axes={**joint.axes, **given})
    evaluate = scenario_evaluator(scenario, cal, capacity, mix, policy, start)
    memo: dict = {}
    best = {}
    for fam, space in family_spaces(joint, args.decode_clocks_mhz).items():
        # The oracle's space holds the one-clock and paced families': start from theirs.
        seeds = tuple(best[f].setting for f in ("one_clock", "paced") if fam == "oracle")
        best[fam] = search(evaluate, space, policy.slo_percentile, memo=memo, seeds=seeds)

    def saving(j: float) -> float:
        return round(100.0 * (1.0 - j / base["j_per_token"]), 2)

    print(
        f"{scenario.name}: max_clock {base['j_per_token']} J/token at "
        f"{base['attainment_pct']} %; controller {ctrl['j_per_token']} J/token at "
        f"{ctrl['attainment_pct']} % ({saving(ctrl['j_per_token'])} % saved); "
        f"{len(memo)} static settings in {time.perf_counter() - t0:.0f} s"
    )
    line: dict = {
        "scenario": scenario.name,
        "max_clock_j_per_token": base["j_per_token"],
        "max_clock_attainment_pct": base["attainment_pct"],
        "controller_saving_pct": saving(ctrl["j_per_token"]),
        "controller_attainment_pct": ctrl["attainment_pct"],
        "settings_run": len(memo),
    }
    for fam in FAMILIES:
        found = best[fam]
        if not found.admissible:
            print(f"{fam:>20}: no setting reached {found.target_pct:g} % attainment")
            line[f"{fam}_saving_pct"] = None
            continue
        r, j = found.summary, found.summary["j_per_token"]
        print(
            f"{fam:>20}: {found.setting.label}: {j} J/token ({saving(j)} % saved), attainment "
            f"{r['attainment_pct']} %, p99 TTFT {r['p99_ttft_ms']} ms, TPOT {r['p99_tpot_ms']} ms"
        )
        line[f"{fam}_saving_pct"] = saving(j)
        line[f"{fam}_setting"] = found.setting.label
    print(json.dumps(line))
    return 0
