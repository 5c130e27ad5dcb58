"""`wattserve bench control`: the feedback controller against three baselines, closed loop
on the virtual GPU, over seeded scenarios; per scenario and system: SLO attainment, p99
TTFT and TPOT, J per output token, seconds over budget, peak temperature, knob changes.

Two engines. `--engine model` (default): an engine model in simulated time: the real
scheduler and KV-cache manager (plain Python), step times from a linear fit per
quantization level calibrated on the real engine's measured steps (by default the
calibration committed in wattserve/bench/data/, so the same command gives the same figures on any
machine of this kind; `--calibrate-here` measures this machine's), booked on the virtual
GPU with a SimClock, so minutes of load take seconds. `--engine real`: the real engine on
this CPU in wall time with the virtual GPU stretching its steps, each scenario long enough
for `--requests` arrivals (200 by default; attainment is reported with its 95 % Wilson
interval), the controller's speed table measured on the spot as the daemon's comes from
bench quant run where it serves (the engine model's comes from its calibration). Both drive
the daemon's own ControlLoop. Baselines, same arrivals: max clock with fixed batch caps (the
uncontrolled engine), a static power cap at the budget, and a PI(D) loop on power only.
Writes control-<engine>-<scenario>.png and a summary plot under --out (default
<cache>/bench/control/, never the source tree unless named); the last line printed is one
JSON object. Prompts are token counts (the engine model needs no text; the real
engine reads windows of the Python licence text, as bench engine does).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from wattserve.bench import output_dir
from wattserve.bench.control_plots import plot_scenario, plot_summary
from wattserve.bench.control_real import (
    DEFAULT_REQUESTS,
    attainment_interval,
    calibrate,
    describe_targets,
    duration_for_requests,
    measure_capacity_real,
    measure_level_speeds_real,
    real_targets,
    run_real,
)
from wattserve.bench.control_systems import best_static, run_model
from wattserve.controller.policy import ControlMode, Policy
from wattserve.sim.calibration import Calibration, calibration_path
from wattserve.sim.metrics import slo_met, summarize
from wattserve.sim.oracle import OracleResult
from wattserve.sim.run import measure_capacity
from wattserve.sim.scenarios import RequestMix, Scenario, make_scenarios

DEFAULT_LEVELS = ("fp32", "bf16", "int8")


SYSTEMS = (
    "controller",
    "controller_fixed_quant",
    "controller_unpaced",
    "max_clock",
    "static_cap",
    "pid_power",
    "best_static",
)


# The calibration committed with the bench: the same command gives the same JSON on any
# machine of this kind. Measured on the 2-core CI kind on 2026-12-04 (other jobs were
# running); `--calibrate-here` measures this machine's instead.
COMMITTED_CALIBRATIONS = Path(__file__).resolve().parent / "data"


def committed_calibration_path(model: str, dtype: str, threads: int) -> Path:
    return COMMITTED_CALIBRATIONS / f"control-calibration-{model}-{dtype}-t{threads}.json"


def load_or_calibrate(args) -> tuple[Calibration, dict[str, Any]]:
    """The engine model's calibration and where it came from (for the JSON line).

    In order: `--calibration FILE`; `--calibrate-here` (measured now on this machine and
    saved to the cache); the calibration committed with the bench for this model, dtype
    and thread count. A missing one is an error naming the flag, never a silent
    measurement: a figure must not depend on what a cache happens to hold.
    """
    from wattserve.daemon.config import default_cache_dir

    threads = args.threads or 2
    if args.calibrate_here:
        path = calibration_path(default_cache_dir(), args.model, args.dtype, threads)
        print(f"calibrating the real engine ({', '.join(args.levels)}); saving to {path}")
        cal = calibrate(args.model, tuple(args.levels), args.dtype, threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(cal.to_json() + "\n")
        source = "measured here"
    else:
        path = args.calibration or committed_calibration_path(args.model, args.dtype, threads)
        source = "file" if args.calibration else "committed"
        if not path.is_file():
            raise SystemExit(
                f"no calibration at {path}: pass --calibrate-here to measure this machine's, "
                "or --calibration FILE"
            )
        cal = Calibration.from_json(path.read_text())
        if cal is None:
            raise SystemExit(f"{path}: not a calibration of this version (--calibrate-here)")
    missing = [lv for lv in args.levels if lv not in cal.levels]
    if missing:
        raise SystemExit(f"{path}: no calibration for {', '.join(missing)} (--calibrate-here)")
    print(f"calibration: {path} ({source}, measured {cal.measured_at})", flush=True)
    return cal, calibration_facts(path, source, cal)


def calibration_facts(path: Path, source: str, cal: Calibration) -> dict[str, Any]:
    """Everything of the calibration that can change the figures, for the JSON line."""
    import hashlib

    # The committed calibration is named relative to this package, so moving the package
    # (or installing it elsewhere) does not change the JSON line.
    if source == "committed":
        shown = path.relative_to(COMMITTED_CALIBRATIONS.parent).as_posix()
    else:
        shown = str(path)
    return {
        "source": source,
        "path": shown,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "measured_at": cal.measured_at,
        "levels": {
            lv: {
                "base_s": fit.base_s,
                "per_prefill_token_s": fit.per_prefill_token_s,
                "per_decode_token_s": fit.per_decode_token_s,
                "noise_cv": fit.noise_cv,
                "ppl_increase_pct": fit.ppl_increase_pct,
            }
            for lv, fit in cal.levels.items()
        },
    }


def add_calibration_args(ap: argparse.ArgumentParser) -> None:
    """The arguments load_or_calibrate reads: the model, dtype and threads the calibration
    is for, and where it comes from."""
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--calibration", type=Path, default=None, help="a calibration file to use instead"
    )
    ap.add_argument(
        "--calibrate-here",
        action="store_true",
        help="measure the real engine on this machine (saved to the cache) instead of the "
        "calibration committed with the bench",
    )


def add_policy_args(ap: argparse.ArgumentParser) -> None:
    """The policy every control bench runs under (policy_from_args) and the scenarios'
    budgets (make_scenarios)."""
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


def policy_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Policy:
    """The AUTO-mode policy add_policy_args' arguments give; one Policy refuses is an
    argparse error (exit 2), not a traceback."""
    try:
        return Policy(
            power_budget_w=args.budget_w,
            ttft_slo_ms=args.ttft_slo_ms,
            tpot_slo_ms=args.tpot_slo_ms,
            mode=ControlMode.AUTO,
            max_ppl_increase_pct=args.max_ppl_increase_pct,
        )
    except ValueError as e:
        ap.error(str(e))


def int_list(text: str) -> tuple[int, ...]:
    """A comma list of integers, for argparse."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None


def float_list(text: str) -> tuple[float, ...]:
    """A comma list of numbers, for argparse."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text!r}") from None


def write_trace(res, path: Path) -> None:
    """One run's timeline as JSON lines: a `sample` per power sample (time, power, budget,
    clock, queues), a `decision` whenever the system's knobs or reason change (all its
    fields: state, reason, the prediction it chose), and a `request` per arrival."""
    lines = []
    last: dict | None = None
    for x in res.samples:
        if x.knobs and x.knobs != last:
            lines.append({"kind": "decision", "t_s": round(x.t_s, 3), **x.knobs})
            last = x.knobs
        lines.append(
            {
                "kind": "sample",
                "t_s": round(x.t_s, 3),
                "power_w": round(x.power_w, 1),
                "budget_w": x.budget_w,
                "sm_clock_mhz": x.sm_clock_mhz,
                "running": x.running,
                "waiting": x.waiting,
            }
        )
    for arrival, ttft, tpot, out in res.requests:
        lines.append(
            {
                "kind": "request",
                "arrival_s": round(arrival, 3),
                "ttft_s": ttft,
                "tpot_s": tpot,
                "output_tokens": out,
            }
        )
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def shift_seeds(scenarios: dict[str, Scenario], offset: int) -> dict[str, Scenario]:
    """The same scenarios with every seed moved by `offset` (0: unchanged)."""
    return {name: replace(sc, seed=sc.seed + offset) for name, sc in scenarios.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench control", description=__doc__)
    ap.add_argument("--engine", choices=["model", "real"], default="model")
    ap.add_argument(
        "--scenarios",
        default=None,
        help="comma list (default: all for model, steady60,burst,budget_step for real)",
    )
    ap.add_argument(
        "--systems",
        default=None,
        help=f"comma list of {', '.join(SYSTEMS)} (real: all but the second)",
    )
    ap.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="per scenario (model 300; real: from --requests)",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"real engine: each scenario lasts until this many arrivals are due, from its "
        f"mean arrival rate (default {DEFAULT_REQUESTS}; --duration-s overrides)",
    )
    ap.add_argument("--levels", type=lambda s: s.split(","), default=list(DEFAULT_LEVELS))
    ap.add_argument(
        "--start-level", default=None, help="level the engine starts at (default: full precision)"
    )
    add_policy_args(ap)
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
    ap.add_argument(
        "--seed-offset",
        type=int,
        default=0,
        help="add N to every scenario's seed (arrivals, step noise, virtual GPU): the same "
        "scenarios on other draws; 0 gives the default figures",
    )
    add_calibration_args(ap)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the plots and per-scenario JSON go (default: <cache>/bench/control)",
    )
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="also write each run's timeline under --out (trace-<engine>-<scenario>-<system>"
        ".jsonl: power and queues per sample, each decision when it changes, each request)",
    )
    ap.add_argument(
        "--device-calibration",
        type=Path,
        default=None,
        help="a power calibration `wattserve bench gpu` wrote on a real GPU: the virtual GPU "
        "prices power from it (default: its H200 profile's physical model)",
    )
    args = ap.parse_args(argv)
    if args.device_calibration is not None:
        from wattserve.daemon.device.power_calibration import (
            PowerCalibration,
            PowerCalibrationError,
        )

        try:
            PowerCalibration.load(args.device_calibration)
        except PowerCalibrationError as e:
            ap.error(f"--device-calibration: {e}")
    args.out = args.out or output_dir("control")
    policy = policy_from_args(ap, args)

    cal, cal_facts = load_or_calibrate(args)
    start = args.start_level or cal.full_precision
    levels = tuple(lv for lv in args.levels if lv in cal.levels)
    mix = RequestMix()
    loaded = None
    speeds: dict[str, dict[str, float]] | None = None
    if args.engine == "real":
        import torch

        from wattserve.daemon.config import default_cache_dir
        from wattserve.daemon.engine.loader import load_model

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

    def build(d: float) -> dict[str, Scenario]:
        return shift_seeds(
            make_scenarios(d, args.budget_w, args.step_budget_w, args.low_budget_w),
            args.seed_offset,
        )

    duration = args.duration_s or 300.0
    scenarios = build(duration)
    names = (
        args.scenarios
        or ("steady60,burst,budget_step" if args.engine == "real" else ",".join(scenarios))
    ).split(",")
    durations = dict.fromkeys(names, duration)
    requests_target = None
    if args.engine == "real" and args.duration_s is None:
        # Long enough to mean something: each scenario until --requests arrivals are due.
        requests_target = args.requests or DEFAULT_REQUESTS
        for name in names:
            durations[name] = duration_for_requests(
                lambda d, name=name: build(d)[name], requests_target, capacity, mix
            )
            scenarios[name] = build(durations[name])[name]
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
        + "); "
        + (
            f"{duration:g} s per scenario"
            if requests_target is None
            else f"{requests_target} requests per scenario: "
            + ", ".join(f"{n} {durations[n]:.0f} s" for n in names)
        ),
        flush=True,
    )
    table: dict[str, dict[str, dict]] = {}
    oracles: dict[str, OracleResult] = {}
    views: dict[str, Callable[[Any], dict]] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        sc = scenarios[name]
        results = []
        for sys_name in systems:
            t0 = time.perf_counter()
            if sys_name == "best_static":
                res, oracles[name] = best_static(
                    sc, cal, capacity, mix, policy, levels, start, args.device_calibration
                )
                print(
                    f"{name:>12} {'best_static':>22}: hindsight oracle "
                    f"{oracles[name].setting.label} ({oracles[name].evaluated} settings run)",
                    flush=True,
                )
            elif args.engine == "model":
                res = run_model(
                    sc, sys_name, cal, capacity, mix, policy, levels, start,
                    device_calibration=args.device_calibration,
                )
            else:
                res = run_real(
                    sc, sys_name, capacity, mix, policy, levels, start, cal, loaded, speeds,
                    device_calibration=args.device_calibration,
                )
            summary = summarize(res, policy, sc)
            ci = ""
            if args.engine == "real" and res.requests:
                summary["attainment_ci"] = attainment_interval(
                    slo_met(res, policy), len(res.requests)
                )
                c = summary["attainment_ci"]
                ci = (
                    f" ({c['successes']}/{c['count']}, 95 % CI {c['lo_pct']}-{c['hi_pct']}%, "
                    f"+-{c['half_width_pct']})"
                )
            table.setdefault(name, {})[sys_name] = summary
            if args.trace:
                write_trace(res, args.out / f"trace-{args.engine}-{name}-{sys_name}.jsonl")
            results.append(res)
            if sys_name == "controller" and res.view is not None:
                views[name] = res.view
            print(
                f"{name:>12} {sys_name:>22}: attainment {summary['attainment_pct']}%{ci}, p99 TTFT "
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
        if args.engine == "real":
            # Each scenario's figures as soon as it ends: a long real run cut short keeps
            # the scenarios it finished.
            part = {"scenario": name, "duration_s": durations[name], "per_system": table[name]}
            (args.out / f"control-real-{name}.json").write_text(json.dumps(part) + "\n")
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
    oracle = oracle_facts(table, oracles, views)
    line = _headline(
        table,
        args,
        cal,
        capacity,
        duration if requests_target is None else {n: round(durations[n], 1) for n in names},
        levels,
        speeds,
        oracle,
    )
    if requests_target is not None:
        line["requests_per_scenario_target"] = requests_target
    if args.engine == "real":
        line["real_engine_targets"] = real_targets(table)
        for text in describe_targets(line["real_engine_targets"]):
            print(text, flush=True)
    line["oracle"] = oracle
    line["calibration"] = cal_facts
    if args.device_calibration is not None:  # only then: the line is unchanged without one
        import hashlib

        line["device_calibration"] = {
            "path": str(args.device_calibration),
            "sha256": hashlib.sha256(args.device_calibration.read_bytes()).hexdigest(),
        }
    line["seed_offset"] = args.seed_offset
    line["seeds"] = {name: scenarios[name].seed for name in names}
    # The engine model takes quality and speeds from the calibration; only the real
    # engine measures a speed table (speed_table_tok_s). No quantization table is read.
    line["quant_table"] = None
    print(json.dumps(line))
    return 0


def oracle_facts(
    table: dict,
    oracles: dict[str, OracleResult],
    views: dict[str, Callable[[Any], dict]] | None = None,
) -> dict[str, dict]:
    """Per scenario: the hindsight oracle's setting and figures, its saving against max
    clock, and the controller's saving as a fraction of it (`saving_vs_oracle_ratio`;
    None where max clock or the controller did not run, or the oracle saves nothing);
    with `views` (the controller's models frozen when the arrivals ended), what they
    predict for the oracle's setting (`controller_view_of_oracle`: set against the
    oracle's measured J/token and percentiles, why the controller did not take it)."""

    def saving(row: dict | None, base: dict | None) -> float | None:
        if not row or not base or not row.get("j_per_token") or not base.get("j_per_token"):
            return None
        return round(100.0 * (1 - row["j_per_token"] / base["j_per_token"]), 2)

    out = {}
    for name, found in oracles.items():
        base = table[name].get("max_clock")
        oracle_saving = saving(found.summary, base)
        ctl_saving = saving(table[name].get("controller"), base)
        ratio = None
        if oracle_saving is not None and ctl_saving is not None and oracle_saving > 0:
            ratio = round(ctl_saving / oracle_saving, 3)
        out[name] = {
            **found.as_dict(),
            "oracle_saving_vs_max_clock_pct": oracle_saving,
            "controller_saving_vs_max_clock_pct": ctl_saving,
            "saving_vs_oracle_ratio": ratio,
        }
        if views and name in views:
            out[name]["controller_view_of_oracle"] = views[name](found.setting)
    return out


def _headline(
    table: dict,
    args,
    cal: Calibration,
    capacity: float,
    duration: float | dict[str, float],
    levels,
    speeds: dict[str, dict[str, float]] | None,
    oracle: dict[str, dict],
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
        for key in ("oracle_saving_vs_max_clock_pct", "saving_vs_oracle_ratio"):
            if "steady60" in oracle:
                line[key] = oracle["steady60"][key]
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
