"""The latency guard's adaptive margin and its watch over descents, on the synthetic plant
of test_controller (no torch, no device, simulated seconds).

- The margin: measured latencies over the model's percentile prediction in force, per
  level and clock; their split-conformal quantile multiplies predictions before the SLO
  check (Learner.error_factor, Outlook.feasible).
- Descents earn their way: a descent whose measured latencies come near an SLO is reverted
  before a miss, and the lower clock barred for a while (LatencyGuard).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.test_controller import Plant, make_controller, run
from wattserve.controller.controller import Controller, ControllerParams, ControllerState, Reason
from wattserve.controller.models import QuantileRatio, conformal_quantile
from wattserve.controller.signals import EngineStats


def test_conformal_quantile_takes_the_split_conformal_rank():
    # ceil((n + 1)(1 - alpha))-th smallest: n = 9 at alpha 0.1 is the 9th (the largest),
    # n = 19 the 18th; n = 8 cannot bound 90 % (rank 9 > 8).
    assert conformal_quantile([float(i) for i in range(1, 10)], 0.1) == 9.0
    assert conformal_quantile([float(i) for i in range(1, 20)], 0.1) == 18.0
    assert conformal_quantile([float(i) for i in range(1, 9)], 0.1) is None
    assert conformal_quantile([], 0.1) is None


def test_ratios_answer_for_their_own_key_where_it_has_enough_else_pooled():
    q = QuantileRatio(default=1.0, window=100, max_age_s=50.0)
    for i in range(9):
        q.add(float(i), 2.0, 1.0, key=("fp32", 495))
    for i in range(3):
        q.add(float(i), 1.0, 1.0, key=("fp32", 1980))
    assert q.conformal(10.0, 0.1, ("fp32", 495)) == 2.0
    # 1980 MHz has three ratios of its own: too few; the pooled twelve answer (rank 12).
    assert q.conformal(10.0, 0.1, ("fp32", 1980)) == 2.0
    assert q.conformal(100.0, 0.1, ("fp32", 495)) is None  # all past max_age_s


def _settled(params: ControllerParams | None = None) -> tuple[Controller, Plant]:
    """A controller tracking a load whose TPOT at its chosen clock is near the margin
    (predicted about 150 ms against 0.85 x 200 ms), its model practised (> 300 steps)."""
    ctl = make_controller(params=params)
    plant = Plant(compute_share=0.5, decode_rate_tok_s=120.0)
    run(ctl, plant, 100)
    assert ctl.state is ControllerState.TRACKING
    assert ctl.learner.step_model("fp32").samples >= ctl.params.clock.descend_evidence_steps
    return ctl, plant


def _measured(ctl: Controller, plant: Plant, factor: float, n: int) -> None:
    """n requests whose TTFT and TPOT run `factor` x the model's percentile prediction in
    force, learnt outside tracking (the percentile ratios learn only while tracking; the
    margin in every state)."""
    learner = ctl.learner
    ttft_ms, tpot_ms = learner.pred_ttft_pct_ms.value, learner.pred_tpot_pct_ms.value
    assert ttft_ms and tpot_ms
    for i in range(n):
        now = plant.t_s + 0.01 * (i + 1)
        stats = EngineStats(
            timestamp_s=now,
            ttft_s=(factor * ttft_ms / 1000.0,),
            tpot_s=(factor * tpot_ms / 1000.0,),
        )
        learner.learn(
            None,
            stats,
            now,
            ctl.knobs.sm_clock_mhz,
            paced=False,
            tracking=False,
            since_clock_change_s=10.0,
            before_step=lambda step, clock: None,
        )


def test_a_model_that_under_predicts_grows_the_margin_and_holds_a_higher_clock():
    ctl, plant = _settled(ControllerParams.of(margin_settle_s=0.0))
    clock = ctl.knobs.sm_clock_mhz
    assert ctl.learner.error_factor("tpot", "fp32", clock, plant.t_s) == 1.0
    _measured(ctl, plant, 1.9, 12)
    for kind in ("ttft", "tpot"):
        assert ctl.learner.error_factor(kind, "fp32", clock, plant.t_s) == pytest.approx(1.9)
    # The prediction at the clock in force now fails the SLO check with the margin ...
    o = ctl.outlook(plant.t_s)
    w = ctl.learner.workload.current()
    k = ctl.knobs
    pr = o.predict("fp32", clock, k.max_num_seqs, k.max_num_batched_tokens, w, 45.0)
    assert pr.tpot_ms <= ctl.policy.tpot_slo_ms * ctl.params.targets.slo_margin  # alone it passes
    assert not o.feasible(pr, 400.0)
    # ... and the controller moves to a higher clock and stays there.
    decisions = run(ctl, plant, 20)
    assert all(d.knobs.sm_clock_mhz > clock for d in decisions[-20:])


def test_with_accurate_predictions_the_margin_stays_at_one_and_saves_as_much():
    ctl, plant = _settled()
    now = plant.t_s
    k = ctl.knobs
    assert len(ctl.learner.ttft_error) >= 9  # measured, not the fallback
    for kind in ("ttft", "tpot"):
        assert ctl.learner.error_factor(kind, "fp32", k.sm_clock_mhz, now) == 1.0
    # The same run without an adaptive margin (margin_max 1) chooses the same clocks.
    off, off_plant = _settled(ControllerParams.of(margin_max=1.0))
    assert off.knobs.sm_clock_mhz == k.sm_clock_mhz
    assert off_plant.powers[-40:] == plant.powers[-40:]


def _descend_after_a_guard(ctl: Controller, plant: Plant) -> tuple[int, int]:
    """A growing queue makes the guard raise the clock; once it empties the optimizer
    descends again. Returns (clock before the descent, clock after)."""
    knobs = ctl.knobs
    for waiting in (1, 2, 3, 4, 5):
        plant.waiting = waiting
        telemetry, stats = plant.tick(knobs)
        knobs = ctl.observe(telemetry, stats, plant.t_s).knobs
    plant.waiting = 0
    for _ in range(200):
        before = knobs.sm_clock_mhz
        telemetry, stats = plant.tick(knobs)
        d = ctl.observe(telemetry, stats, plant.t_s)
        knobs = d.knobs
        if d.state is ControllerState.TRACKING and knobs.sm_clock_mhz < before:
            return before, knobs.sm_clock_mhz
    raise AssertionError("no descent after the guard")


def test_a_descent_whose_measured_latency_nears_the_slo_is_reverted_before_a_miss():
    ctl, plant = _settled()
    before, after = _descend_after_a_guard(ctl, plant)
    near_s = 0.9 * ctl.policy.ttft_slo_ms / 1000.0
    # A request that arrived after the descent sees its first token at 0.9 x the SLO at
    # the lower clock: no miss yet.
    decisions = run(ctl, plant, near_s + 0.5)
    assert all(x.knobs.sm_clock_mhz == after for x in decisions)
    telemetry, stats = plant.tick(ctl.knobs)
    stats = dataclasses.replace(stats, ttft_s=(0.2, near_s))
    d = ctl.observe(telemetry, stats, plant.t_s)
    assert all(x * 1000.0 <= ctl.policy.ttft_slo_ms for x in stats.ttft_s)
    assert d.reason_code is Reason.DESCENT_REVERTED
    assert d.knobs.sm_clock_mhz == before
    # That clock is a floor for descent_bar_s: the optimizer may not go back below it ...
    decisions = run(ctl, plant, ctl.params.latency_guard.descent_bar_s - 5.0)
    assert min(x.knobs.sm_clock_mhz for x in decisions) >= before
    assert ctl.latency_guard.floor(plant.t_s) == before
    # ... and then the bar lifts.
    run(ctl, plant, 10.0)
    assert ctl.latency_guard.floor(plant.t_s) is None


def test_a_descent_whose_latencies_stay_clear_of_the_slo_earns_its_way():
    ctl, plant = _settled()
    _, after = _descend_after_a_guard(ctl, plant)
    telemetry, stats = plant.tick(ctl.knobs)
    stats = dataclasses.replace(stats, ttft_s=(0.2, 0.5 * ctl.policy.ttft_slo_ms / 1000.0))
    d = ctl.observe(telemetry, stats, plant.t_s)
    assert d.reason_code is not Reason.DESCENT_REVERTED
    decisions = run(ctl, plant, ctl.params.latency_guard.descent_watch_s + 1.0)
    assert ctl.counters.decisions[Reason.DESCENT_REVERTED.value] == 0
    assert max(x.knobs.sm_clock_mhz for x in decisions) <= after  # kept, or lower still
    assert ctl.latency_guard.floor(plant.t_s) is None


def test_a_longer_decode_interval_whose_tpot_nears_the_slo_is_reverted_and_barred():
    ctl = make_controller(decode_interval_max_ms=1000.0)
    plant = Plant(compute_share=0.1, decode_rate_tok_s=40.0, prompt_rate_tok_s=40.0)
    knobs = ctl.knobs
    for _ in range(2000):
        before = knobs.decode_interval_ms
        telemetry, stats = plant.tick(knobs)
        d = ctl.observe(telemetry, stats, plant.t_s)
        knobs = d.knobs
        if d.state is ControllerState.TRACKING and knobs.decode_interval_ms > before:
            break
    else:
        raise AssertionError("decode pacing never lengthened")
    longer = knobs.decode_interval_ms
    # A request finishing now saw a TPOT of 0.9 x the SLO: no miss, but near it.
    telemetry, stats = plant.tick(knobs)
    stats = dataclasses.replace(stats, tpot_s=(0.9 * ctl.policy.tpot_slo_ms / 1000.0,))
    d = ctl.observe(telemetry, stats, plant.t_s)
    assert d.reason_code is Reason.DESCENT_REVERTED
    assert d.knobs.decode_interval_ms == before < longer
    # No interval longer than the one restored while the bar holds.
    decisions = run(ctl, plant, ctl.params.latency_guard.descent_bar_s - 5.0)
    assert max(x.knobs.decode_interval_ms for x in decisions) <= before
