"""`bench control` on the real engine: measuring it for the engine model's calibration,
its speed table and its capacity on this CPU, and running one scenario with one system on
it in wall time, the virtual GPU stretching its steps.

Measurement and wall-time runs only; the fits and the simulated runs are wattserve.sim's.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wattserve.bench.control_systems import make_system
from wattserve.controller.policy import ControlMode, Policy
from wattserve.sim.calibration import Calibration, LevelFit, fit_steps
from wattserve.sim.run import (
    RunResult,
    Sample,
    decision_reasons,
    energy_sample,
    power_sample,
    scenario_device_config,
)
from wattserve.sim.scenarios import RequestMix, Scenario, arrivals, prompt_tokens
from wattserve.sim.systems import PERIOD_S

# Real-engine runs: requests per scenario unless told otherwise (enough for a confidence
# interval on attainment a few points wide at the attainments seen here).
DEFAULT_REQUESTS = 200


def duration_for_requests(
    build: Callable[[float], Scenario],
    requests: int,
    capacity_req_s: float,
    mix: RequestMix,
    grow: float = 1.05,
    rounds: int = 40,
) -> float:
    """The scenario duration (s) that brings at least `requests` arrivals: first the one
    whose expected count is `requests` (the load's mean over the scenario x capacity x the
    duration; a few fixed-point rounds, for loads shaped by their duration), then longer by
    `grow` until the scenario's own seeded arrivals number that many. `build(d)` makes the
    scenario at duration d."""
    if requests < 1 or not capacity_req_s > 0:
        raise ValueError("duration_for_requests: requests >= 1 and capacity_req_s > 0")
    d = 60.0
    for _ in range(4):
        sc = build(d)
        mean_load = statistics.fmean(sc.load(d * (i + 0.5) / 1000) for i in range(1000))
        if not mean_load > 0:
            raise ValueError(f"scenario {sc.name}: no load")
        d = requests / (mean_load * capacity_req_s)
    for _ in range(rounds):
        if len(arrivals(build(d), capacity_req_s, mix)) >= requests:
            return d
        d *= grow
    raise ValueError(f"no duration brings {requests} arrivals")


def wilson_interval(successes: int, count: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval (lo, hi) of a binomial proportion, as fractions."""
    if count < 1 or not 0 <= successes <= count:
        raise ValueError("wilson_interval: 0 <= successes <= count, count >= 1")
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / count
    denom = 1.0 + z * z / count
    center = (p + z * z / (2 * count)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / count + z * z / (4 * count * count))
    return max(0.0, center - half), min(1.0, center + half)


def attainment_interval(successes: int, count: int, confidence: float = 0.95) -> dict:
    """Attainment with its Wilson interval, in percent, for the table and the JSON."""
    lo, hi = wilson_interval(successes, count, confidence)
    return {
        "count": count,
        "successes": successes,
        "confidence": confidence,
        "lo_pct": round(100.0 * lo, 2),
        "hi_pct": round(100.0 * hi, 2),
        "half_width_pct": round(50.0 * (hi - lo), 2),
    }


def real_targets(table: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per scenario, the real engine's target checked: the controller's attainment at
    least max clock's less the half-width of max clock's interval (`attainment_met`), its
    J/token at most max clock's (`j_per_token_met`), no second over the budget
    (`over_budget_met`). Max clock has no board limit, so on
    a load above the engine's capacity it buys attainment over the budget
    (`max_clock_over_budget_s`); where static_cap ran (the top clock, board limit at the
    budget, the engine's default caps), `static_cap_reaches_bar` says whether the top
    clock within the budget reaches the bar there. Scenarios without both systems'
    figures are left out."""
    out: dict[str, dict] = {}
    for name, rows in table.items():
        ctl, top = rows.get("controller"), rows.get("max_clock")
        if not ctl or not top or "attainment_ci" not in top:
            continue
        if ctl.get("attainment_pct") is None or top.get("attainment_pct") is None:
            continue
        bar = round(top["attainment_pct"] - top["attainment_ci"]["half_width_pct"], 2)
        j, j_top = ctl.get("j_per_token"), top.get("j_per_token")
        facts = {
            "attainment_pct": ctl["attainment_pct"],
            "attainment_bar_pct": bar,
            "attainment_met": ctl["attainment_pct"] >= bar,
            "j_per_token": j,
            "max_clock_j_per_token": j_top,
            "j_per_token_met": j is not None and j_top is not None and j <= j_top,
            "over_budget_s": ctl.get("over_budget_s"),
            "over_budget_met": ctl.get("over_budget_s") == 0,
            "max_clock_over_budget_s": top.get("over_budget_s"),
        }
        cap = rows.get("static_cap")
        if cap and cap.get("attainment_pct") is not None:
            facts["static_cap_attainment_pct"] = cap["attainment_pct"]
            facts["static_cap_reaches_bar"] = cap["attainment_pct"] >= bar
        out[name] = facts
    return out


def describe_targets(targets: dict[str, dict]) -> list[str]:
    """One line per scenario of real_targets, for the log the bench prints."""
    lines = []
    for name, t in targets.items():
        line = (
            f"{name:>12} target: attainment {t['attainment_pct']}% against "
            f"{t['attainment_bar_pct']}% ({'met' if t['attainment_met'] else 'not met'}), "
            f"J/token {t['j_per_token']} against max clock's {t['max_clock_j_per_token']} "
            f"({'met' if t['j_per_token_met'] else 'not met'}); {t['over_budget_s']} s over "
            f"budget ({'met' if t['over_budget_met'] else 'not met'}); max clock "
            f"{t['max_clock_over_budget_s']} s over budget"
        )
        if "static_cap_reaches_bar" in t:
            line += (
                f"; static_cap {t['static_cap_attainment_pct']}% "
                f"({'reaches' if t['static_cap_reaches_bar'] else 'under'} the bar)"
            )
        lines.append(line)
    return lines


def calibrate(model: str, levels: tuple[str, ...], dtype: str, threads: int | None) -> Calibration:
    """Measure the real engine's steps at each level over a spread of batch shapes."""
    import torch

    from wattserve.bench.engine import corpus_token_ids, corpus_window
    from wattserve.bench.quant import eval_text_file, perplexity
    from wattserve.daemon.config import default_cache_dir
    from wattserve.daemon.engine.engine import Engine, EngineOptions
    from wattserve.daemon.engine.loader import load_model
    from wattserve.daemon.engine.request import SamplingParams

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
        coef, cv, kept = fit_steps(rows)
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


def _real_engine(
    loaded: Any, level: str, levels: tuple[str, ...] = (), prefix_caching: bool = True
) -> Any:
    """A fresh real engine over the loaded weights, as every real-engine run here uses it:
    a 512 MiB KV pool, caps 64/512, starting at `level`, allowed `level` and `levels`
    (prefix_caching False: every prompt token computed, for measuring speeds)."""
    from wattserve.daemon.engine.engine import Engine, EngineOptions

    return Engine(
        loaded,
        EngineOptions(
            kv_cache_bytes=1 << 29,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            quantization_levels=tuple(dict.fromkeys((level, *levels))),
            quantization_level=level,
            enable_prefix_caching=prefix_caching,
        ),
    )


def measure_level_speeds_real(loaded: Any, levels: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each level's speed on the real engine here and now, as bench quant's table gives it
    to the daemon on the machine it runs on: decode tok/s at batch 16
    (wattserve.bench.quant.measure_speed: one interleaved round, 16 prompts of 64 tokens, 32 new
    tokens each) and prefill tok/s (one 256-token prompt per level, best of two
    interleaved rounds), with the prefix cache off: a prompt served from it would read as a
    prefill many times faster than the level computes one (on a 2-core CPU without AVX-512
    the cached rounds read fp32 3,702, bf16 1,026 and int8 3,812 tok/s where those levels
    compute 550, 67 and 67). The calibration's speeds may come from another machine: on a CPU
    without bf16 instructions bf16 decodes slower than fp32 and bf16 and int8 prefill
    several times slower, where a table from a machine with them ranks both ahead."""
    from wattserve.bench.engine import corpus_token_ids
    from wattserve.bench.quant import DecodeTimer, measure_speed
    from wattserve.daemon.engine.request import SamplingParams

    engine = _real_engine(loaded, levels[0], levels, prefix_caching=False)
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
    from wattserve.bench.engine import corpus_token_ids, corpus_window
    from wattserve.daemon.engine.request import SamplingParams

    engine = _real_engine(loaded, level)
    ids = corpus_token_ids(engine.tokenizer, 8192)
    rng = random.Random(99)
    done: list[float] = []

    def add() -> None:
        prompt = corpus_window(ids, prompt_tokens(rng, mix), rng)
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
    device_calibration: Path | None = None,
) -> RunResult:
    """One scenario with one system on the real engine (a fresh one over the loaded
    weights), in wall time; speeds: the controller's speed table (measure_level_speeds_real);
    device_calibration: the virtual GPU's measured power calibration, if any."""
    from wattserve.bench.engine import corpus_token_ids
    from wattserve.daemon.coupling import device_step_hook
    from wattserve.daemon.device import open_device
    from wattserve.daemon.engine.request import SamplingParams

    engine = _real_engine(loaded, start_level, levels)
    ids = corpus_token_ids(engine.tokenizer, 8192)
    policy = policy.with_changes(power_budget_w=scenario.budget_w(0.0), mode=ControlMode.AUTO)
    with tempfile.TemporaryDirectory() as state_dir:
        device = open_device(scenario_device_config(scenario, Path(state_dir), device_calibration))
        system = make_system(
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
        _, last = energy_sample(device)
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
                # A new budget is decided on at once, as the daemon's loop does (a policy
                # change wakes it), not at the next period.
                woken = b != budget
                if woken:
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
                periodic = now >= next_tick
                if periodic or woken:
                    knobs = system.tick()
                if periodic:
                    next_tick += PERIOD_S
                sample, last = power_sample(device, last, t_start, budget, engine, knobs)
                if sample is not None:
                    samples.append(sample)
                time.sleep(0.02)
        finally:
            engine.stop(abort_pending=True)
            device.close(restore=False)
    requests = [(r[0] - t_start, r[1], r[2], r[3]) for r in records.values()]
    for j in range(i, len(todo)):
        requests.append((todo[j][0], None, None, 0))
    return RunResult(
        scenario=scenario.name,
        system=system.name,
        requests=requests,
        samples=samples,
        energy_j=last[1] - e_start,
        output_tokens=engine.counters.generation_tokens,
        duration_s=samples[-1].t_s if samples else 0.0,
        knob_changes=system.knob_changes,
        reasons=decision_reasons(system),
    )
