"""`wattserve bench control --engine model` end to end on a made-up calibration: the
engine model, the virtual GPU on a SimClock, the ControlLoop and the baselines, the
metrics, the plots and the JSON line. Simulated seconds; no model, no torch steps."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from types import SimpleNamespace

import pytest

from wattserve.bench.control_systems import make_system
from wattserve.daemon.cli import main as cli_main
from wattserve.sim.calibration import Calibration, LevelFit
from wattserve.sim.engine_model import SimRequest, SimulatedEngine


def _calibration() -> Calibration:
    def level(scale: float, weight_bytes: int, ppl: float) -> LevelFit:
        return LevelFit(
            base_s=0.012 * scale,
            per_prefill_token_s=0.0015 * scale,
            per_decode_token_s=0.004 * scale,
            per_context_token_s=2e-6,
            noise_cv=0.1,
            weight_bytes=weight_bytes,
            prepare_s=1.0,
            samples=100,
            ppl_increase_pct=ppl,
        )

    return Calibration(
        model="made-up",
        dtype="float32",
        threads=2,
        full_precision="fp32",
        shape={
            "num_layers": 30,
            "hidden_size": 576,
            "num_heads": 9,
            "num_kv_heads": 3,
            "head_dim": 64,
            "intermediate_size": 1536,
            "vocab_size": 49152,
        },
        kv_bytes_per_token=46080,
        block_size_tokens=16,
        levels={"fp32": level(1.0, 538_000_000, 0.0), "bf16": level(0.6, 269_000_000, 0.1)},
        measured_at="test",
    )


def _bench_json(which: str, tmp_path, capsys, *argv: str) -> dict:
    """`wattserve bench <which>` on the made-up calibration; its last line, parsed."""
    path = tmp_path / "cal.json"
    path.write_text(_calibration().to_json())
    rc = cli_main(["bench", which, "--calibration", str(path), *argv])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_bench_control_model_engine_prints_the_headline_json(tmp_path, capsys, monkeypatch):
    # No --out: the plots go under the cache, never into the working directory's docs/.
    cache, cwd = tmp_path / "cache", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("WATTSERVE_CACHE", str(cache))
    monkeypatch.chdir(cwd)
    line = _bench_json(
        "control",
        tmp_path,
        capsys,
        "--levels",
        "fp32,bf16",
        "--scenarios",
        "steady60,budget_step",
        "--systems",
        "controller,max_clock,pid_power",
        "--duration-s",
        "45",
    )
    assert list(cwd.iterdir()) == []
    plots = cache / "bench" / "control"
    for key in (
        "attainment_pct",
        "energy_saving_vs_max_clock_pct",
        "over_budget_pct",
        "settle_s",
        "overshoot_pct",
    ):
        assert key in line, key
    table = line["per_scenario"]
    assert set(table) == {"steady60", "budget_step"}
    for row in table["steady60"].values():
        assert row["requests"] > 0 and row["j_per_token"] > 0
    # The controller never draws more than the uncontrolled engine per token.
    assert (
        table["steady60"]["controller"]["j_per_token"]
        <= table["steady60"]["max_clock"]["j_per_token"]
    )
    assert (plots / "control-model-steady60.png").stat().st_size > 10_000
    assert (plots / "control-model-summary.png").is_file()
    # Every input that can change the figures is named: the calibration (its file, hash
    # and fitted values) and each scenario's seed.
    cal = line["calibration"]
    assert cal["source"] == "file" and cal["path"] == str(tmp_path / "cal.json")
    assert cal["sha256"] == hashlib.sha256((tmp_path / "cal.json").read_bytes()).hexdigest()
    assert (
        cal["levels"]["fp32"]["per_decode_token_s"]
        == _calibration().levels["fp32"].per_decode_token_s
    )
    assert line["seeds"] == {"steady60": 2, "budget_step": 6}
    assert line["seed_offset"] == 0


def test_bench_control_prices_power_from_a_device_calibration_when_given(tmp_path, capsys):
    from tests.unit.test_power_calibration import _fit, _points

    device_cal = tmp_path / "power-calibration.json"
    device_cal.write_text(_fit(_points()).to_json())
    args = ("--levels", "fp32", "--scenarios", "steady60", "--systems", "max_clock")
    args += ("--duration-s", "20", "--no-plots", "--out", str(tmp_path))
    base = _bench_json("control", tmp_path, capsys, *args)
    priced = _bench_json(
        "control", tmp_path, capsys, *args, "--device-calibration", str(device_cal)
    )
    assert "device_calibration" not in base  # without one the line is as it always was
    assert priced["device_calibration"]["path"] == str(device_cal)
    # Same arrivals and steps, another power model: the energy differs, the requests do not.
    row, row_priced = (x["per_scenario"]["steady60"]["max_clock"] for x in (base, priced))
    assert row["requests"] == row_priced["requests"]
    assert row_priced["j_per_token"] < row["j_per_token"]


def test_bench_control_seed_offset_moves_every_seed_and_the_draws(tmp_path, capsys):
    args = ("--levels", "fp32,bf16", "--scenarios", "steady60", "--systems", "max_clock")
    args += ("--duration-s", "30", "--no-plots", "--out", str(tmp_path))
    base = _bench_json("control", tmp_path, capsys, *args)
    moved = _bench_json("control", tmp_path, capsys, *args, "--seed-offset", "3")
    assert moved["seed_offset"] == 3 and moved["seeds"] == {"steady60": 5}
    # Other seeds draw other arrivals, so the same system serves another request count.
    assert (
        moved["per_scenario"]["steady60"]["max_clock"]
        != base["per_scenario"]["steady60"]["max_clock"]
    )


def test_bench_control_uses_the_committed_calibration_unless_told_otherwise(tmp_path):
    from wattserve.bench.control import committed_calibration_path, load_or_calibrate

    args = SimpleNamespace(
        model="embedded",
        dtype="float32",
        threads=None,
        levels=["fp32", "bf16", "int8"],
        calibration=None,
        calibrate_here=False,
    )
    cal, facts = load_or_calibrate(args)
    path = committed_calibration_path("embedded", "float32", 2)
    assert path.is_file() and facts["source"] == "committed"
    # Named relative to the bench package, so a move of the package leaves the JSON as it is.
    assert facts["path"] == "data/control-calibration-embedded-float32-t2.json"
    assert cal.model == "SmolLM2-135M-Instruct" and set(cal.levels) >= {"fp32", "bf16", "int8"}
    # Nothing committed for another thread count: an error naming the way out, not a
    # measurement made behind the user's back.
    with pytest.raises(SystemExit, match="--calibrate-here"):
        load_or_calibrate(SimpleNamespace(**{**vars(args), "threads": 3}))


def _engine_model(tmp_path):
    from wattserve.daemon.config import DeviceConfig
    from wattserve.daemon.device import SimClock, open_device

    clock = SimClock(0.0)
    device = open_device(
        DeviceConfig(backend="virtual", mode="control", state_dir=tmp_path), clock=clock
    )
    return SimulatedEngine(_calibration(), "fp32", clock, device, seed=1), clock, device


def test_engine_model_study_mechanisms_per_phase_clocks_and_decode_pacing(tmp_path):
    """The ceiling study's two mechanisms do what they say: steps with prefill run at the
    first clock, decode-only steps at the second; decode-only steps start at least the
    interval apart, and a request arriving during the gap is taken at once."""
    engine, clock, device = _engine_model(tmp_path)
    try:
        locks: list[tuple[int, int]] = []
        real_lock = device.lock_sm_clocks_mhz

        def spy(lo: int, hi: int):
            locks.append((lo, hi))
            return real_lock(lo, hi)

        device.lock_sm_clocks_mhz = spy
        engine.phase_clocks_mhz = (1245, 345)
        engine.set_limits(decode_interval_ms=200.0)
        for i in range(3):
            engine.add_request(SimRequest(f"r{i}", 0.0, 40, 12))
        steps = []
        late_added = False
        for _ in range(2000):
            if not engine.has_work():
                break
            st = engine.step()
            if st is None:
                resume = engine.resume_at_s()
                assert resume is not None, "an engine with work steps unless it paces"
                if not late_added and len(steps) >= 6:
                    # A request arrives halfway through a gap.
                    clock.advance((resume - clock()) / 2)
                    engine.add_request(SimRequest("late", clock(), 24, 4))
                    late_added = True
                    assert engine.resume_at_s() is None
                else:
                    clock.advance(resume - clock())
                continue
            steps.append(st)
            assert locks[-1] == ((1245, 1245) if st.prefill_tokens else (345, 345))
        assert not engine.has_work() and late_added
        decode_only = [s for s in steps if s.prefill_tokens == 0]
        assert len(decode_only) >= 10
        for prev, cur in zip(steps, steps[1:], strict=False):
            if prev.prefill_tokens == 0 and cur.prefill_tokens == 0:
                assert cur.started_at_s - prev.started_at_s >= 0.2 - 1e-9
        late = next(s for s in steps if s.prefill_tokens == 24)
        before = max(s.started_at_s for s in steps if s.started_at_s < late.started_at_s)
        assert late.started_at_s - before < 0.2  # it did not wait out the gap
    finally:
        device.close(restore=False)


def test_bench_control_ceiling_reports_each_family(tmp_path, capsys):
    line = _bench_json(
        "control-ceiling",
        tmp_path,
        capsys,
        "--levels",
        "bf16",
        "--duration-s",
        "30",
        "--clocks-mhz",
        "795,1980",
        "--decode-clocks-mhz",
        "345",
        "--intervals-ms",
        "150",
    )
    assert line["scenario"] == "steady60" and line["max_clock_j_per_token"] > 0
    for fam in ("one_clock", "phase_clocks", "paced", "phase_clocks_paced", "oracle"):
        assert f"{fam}_saving_pct" in line
    # The top clock on bf16 meets the SLOs here, so the one-clock family has a setting,
    # and bf16 at a locked clock uses less energy than fp32 at max clock with no lock.
    assert line["one_clock_saving_pct"] is not None and line["one_clock_saving_pct"] > 0
    # The oracle searches clock, caps, level and pacing jointly: it does at least as well
    # as one clock, or one clock and pacing.
    assert line["oracle_saving_pct"] >= line["one_clock_saving_pct"]
    assert line["oracle_saving_pct"] >= line["paced_saving_pct"]


def test_bench_control_noise_reports_each_window_length(tmp_path, capsys):
    line = _bench_json(
        "control-noise",
        tmp_path,
        capsys,
        "--setting",
        "bf16:795:64:512:0",
        "--duration-s",
        "120",
        "--windows-s",
        "10,45",
    )
    assert line["scenario"] == "steady60" and line["j_per_token"] > 0
    short, long = line["windows"]
    assert (short["window_s"], short["windows"]) == (10.0, 9)
    assert (long["window_s"], long["windows"]) == (45.0, 2)
    # Poisson arrivals: ten-second windows' J/token spreads; the idle share taken out,
    # less of it is left, and a 1.5 % gap needs fewer windows to resolve.
    assert short["raw_spread_pct"] > 0
    assert 0 < short["normalized_spread_pct"] < short["raw_spread_pct"]
    assert short["normalized_windows_needed"] <= short["raw_windows_needed"]
    assert "raw_spread_pct" not in long  # two windows give no spread


def test_a_fixed_system_name_with_one_study_field_is_refused_by_name():
    from wattserve.controller.policy import Policy

    policy = Policy(power_budget_w=300.0, ttft_slo_ms=2000.0, tpot_slo_ms=400.0)
    with pytest.raises(ValueError, match="decode-only MHz"):
        make_system("fixed:bf16:645:345", None, None, None, policy, None, (), inline=True)


def test_the_oracle_on_a_tiny_scenario_finds_the_exhaustive_best_and_beats_one_knob_baselines():
    """A 40 s steady scenario on the made-up calibration with a tight TTFT SLO (500 ms),
    so the lowest clocks miss it: the answer, known by running every setting of a small
    space, is what the search finds in fewer runs; no static setting that turns one knob
    away from the uncontrolled engine's does better."""
    import itertools

    from wattserve.controller.policy import ControlMode, Policy
    from wattserve.sim.oracle import (
        Axis,
        SearchSpace,
        StaticSetting,
        rank_key,
        scenario_evaluator,
        search,
    )
    from wattserve.sim.run import measure_capacity
    from wattserve.sim.scenarios import RequestMix, Scenario

    cal, mix = _calibration(), RequestMix()
    capacity = measure_capacity(cal, "fp32", mix, seconds=30.0)
    policy = Policy(
        power_budget_w=300.0, ttft_slo_ms=500.0, tpot_slo_ms=400.0, mode=ControlMode.AUTO
    )
    scenario = Scenario("tiny", 40.0, lambda t: 0.8, lambda t: 300.0, seed=3)
    runs: dict[StaticSetting, dict] = {}
    evaluate_run = scenario_evaluator(scenario, cal, capacity, mix, policy, "fp32")

    def evaluate(s: StaticSetting) -> dict:
        if s not in runs:
            runs[s] = evaluate_run(s)
        return runs[s]

    values = {
        "sm_clock_mhz": (345, 495, 645, 795, 945, 1245, 1980),
        "max_num_seqs": (64,),
        "max_num_batched_tokens": (128, 512),
        "decode_interval_ms": (0.0, 100.0),
        "decode_clock_mhz": (None,),
    }
    space = SearchSpace(("fp32", "bf16"), {a: Axis.of(v) for a, v in values.items()})
    found = search(evaluate, space, policy.slo_percentile)
    searched = len(runs)
    every = [
        StaticSetting(level, *combo[:4])
        for level in space.levels
        for combo in itertools.product(*values.values())
    ]
    assert searched == found.evaluated < len(every)

    def key(s: StaticSetting) -> tuple:
        return rank_key(evaluate(s), policy.slo_percentile)

    best = min(every, key=key)
    assert found.admissible and found.summary["attainment_pct"] >= 99.0
    assert key(found.setting) == key(best)
    # The SLO binds: the least J/token of all misses it.
    cheapest = min(every, key=lambda s: runs[s]["j_per_token"])
    assert runs[cheapest]["attainment_pct"] < 99.0
    # One knob at a time, away from full precision, top clock, the engine's caps, no pacing.
    uncontrolled = StaticSetting("fp32", 1980, 64, 512, 0.0)
    single_knob = [dataclasses.replace(uncontrolled, level="bf16")] + [
        dataclasses.replace(uncontrolled, **{axis: v}) for axis, vs in values.items() for v in vs
    ]
    admissible = [s for s in single_knob if key(s)[0] == 0]
    assert len(admissible) >= 5
    for s in admissible:
        assert found.summary["j_per_token"] <= runs[s]["j_per_token"], s


def test_bench_control_reports_the_oracle_per_scenario_and_in_the_bars(tmp_path, capsys):
    line = _bench_json(
        "control",
        tmp_path,
        capsys,
        "--levels",
        "fp32,bf16",
        "--scenarios",
        "steady60",
        "--systems",
        "controller,max_clock,best_static",
        "--duration-s",
        "30",
        "--no-plots",
    )
    for key in (
        "attainment_pct",
        "energy_saving_vs_max_clock_pct",
        "over_budget_pct",
        "oracle_saving_vs_max_clock_pct",
        "saving_vs_oracle_ratio",
    ):
        assert key in line, key
    oracle = line["oracle"]["steady60"]
    assert set(oracle["setting"]) >= {
        "level",
        "sm_clock_mhz",
        "max_num_seqs",
        "max_num_batched_tokens",
        "decode_interval_ms",
    }
    assert oracle["setting"]["level"] in ("fp32", "bf16")
    row = line["per_scenario"]["steady60"]
    # The oracle's run again is the same run: the table's row has its figures.
    assert oracle["j_per_token"] == row["best_static"]["j_per_token"]
    assert oracle["attainment_pct"] == row["best_static"]["attainment_pct"]
    assert oracle["oracle_saving_vs_max_clock_pct"] == pytest.approx(
        100 * (1 - oracle["j_per_token"] / row["max_clock"]["j_per_token"]), abs=0.01
    )
    assert oracle["oracle_saving_vs_max_clock_pct"] > 0
    assert line["saving_vs_oracle_ratio"] == pytest.approx(
        line["energy_saving_vs_max_clock_pct"] / oracle["oracle_saving_vs_max_clock_pct"],
        abs=1e-3,
    )
    assert oracle["p99_ttft_ms"] == row["best_static"]["p99_ttft_ms"]
    assert oracle["p99_tpot_ms"] == row["best_static"]["p99_tpot_ms"]
    # What the controller's models, frozen when the arrivals ended, predict for the
    # oracle's setting: at the load they saw, and feasible only within the SLO margins.
    view = oracle["controller_view_of_oracle"]
    assert view["request_rate_per_s"] > 0
    assert isinstance(view["stable"], bool) and isinstance(view["feasible"], bool)
    if view["feasible"]:
        assert view["stable"]
        assert view["p99_ttft_ms"] <= 0.85 * 2000.0
        assert view["p99_tpot_ms"] <= 0.85 * 400.0
        assert view["j_per_token"] > 0
    if not view["stable"]:
        assert view["j_per_token"] is None and not view["feasible"]
