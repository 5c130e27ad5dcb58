"""The reference check: the controller's measured J/token and misses against the reference
configuration's (top clock within the budget, the engine's largest caps, no pacing), and
the reference whenever the controller is not measured ahead. Synthetic traces only."""

from __future__ import annotations

import math
from collections import deque

from tests.unit.test_controller import (
    TABLE_INT8_TWICE_AS_FAST,
    LongPromptPlant,
    Plant,
    make_controller,
    run,
)
from wattserve.controller.controller import Controller, ControllerParams, ControllerState, Reason
from wattserve.controller.policy import Knobs
from wattserve.controller.reference import ReferenceState
from wattserve.controller.signals import EngineStats, Telemetry

TICK_S = 0.25
TOKENS_PER_TICK = 40


def trained(budget_w: float = 400.0) -> tuple[Controller, Plant]:
    """A controller whose models have learned a steady load (60 s), its ledger emptied
    for the test's own epochs."""
    ctl = make_controller(budget_w=budget_w)
    plant = Plant(compute_share=0.1)
    run(ctl, plant, 60)
    kept = ctl.params.reference.reference_epochs_kept
    ctl.reference.state = ReferenceState(reference_epochs=deque(maxlen=kept))
    return ctl, plant


class Ledger:
    """Feeds ReferenceCheck.note by hand: each tick makes TOKENS_PER_TICK output tokens
    at `power_w`, with one TTFT and one TPOT measured, under the knobs given."""

    def __init__(self, ctl: Controller, t_s: float) -> None:
        self.ctl = ctl
        self.t_s = t_s
        self.tokens = 0

    def feed(self, knobs: Knobs, power_w: float, seconds: float, ttft_s: float = 0.5) -> None:
        for _ in range(round(seconds / TICK_S)):
            self.t_s += TICK_S
            self.tokens += TOKENS_PER_TICK
            telemetry = Telemetry(self.t_s, power_w=power_w, power_avg_w=power_w)
            stats = EngineStats(
                self.t_s,
                num_running=8,
                generation_tokens_total=self.tokens,
                ttft_s=(ttft_s,),
                tpot_s=(0.05,),
            )
            policy = self.ctl.policy
            outlook = self.ctl.outlook(self.t_s)
            self.ctl.reference.note(telemetry, stats, knobs, policy, outlook, self.t_s)


def reference_knobs(
    ctl: Controller, base: Knobs, ceiling: int | None = None, budget_w: float = 400.0
) -> Knobs:
    return ctl.reference.knobs(base, ceiling, ctl.outlook(), budget_w)


def reference_and_lower(ctl: Controller) -> tuple[Knobs, Knobs]:
    ref = reference_knobs(ctl, Knobs(64, 512, "fp32"))
    return ref, ref.with_changes(sm_clock_mhz=1020)


def ten_seconds_each(power_w: float, ttft_s: float = 0.5) -> tuple[Controller, Ledger, Knobs]:
    """A trained controller's ledger after 10 s of the reference at 200 W, then 10 s of a
    lower clock at power_w with the same tokens (the switch back ends its last epoch);
    the controller, the ledger and the lower clock's knobs."""
    ctl, plant = trained()
    ref, lower = reference_and_lower(ctl)
    ledger = Ledger(ctl, plant.t_s)
    ledger.feed(ref, 200.0, 10)
    ledger.feed(lower, power_w, 10, ttft_s=ttft_s)
    ledger.feed(ref, 200.0, 0.25)
    return ctl, ledger, lower


def test_the_reference_is_the_top_clock_the_budget_allows_the_largest_caps_and_no_pacing():
    ctl, _ = trained()
    ref = reference_knobs(ctl, Knobs(8, 64, "fp32", 900, 300.0, 40.0))
    assert (ref.sm_clock_mhz, ref.max_num_seqs, ref.max_num_batched_tokens) == (1980, 64, 512)
    assert ref.decode_interval_ms == 0.0 and ref.power_limit_w == 300.0
    assert ref.quant_level == "fp32"
    assert ctl.reference.is_reference(ref)
    assert not ctl.reference.is_reference(ref.with_changes(sm_clock_mhz=1020))
    assert not ctl.reference.is_reference(ref.with_changes(max_num_batched_tokens=256))
    # The power guard's ceiling is part of the reference: the budget holds either way.
    assert reference_knobs(ctl, Knobs(8, 64), ceiling=1500).sm_clock_mhz == 1500
    # Below the board limit's range (200 W here) only the clock holds a budget: the check
    # stands aside, booking nothing and holding nothing.
    reference_knobs(ctl, Knobs(8, 64), budget_w=150.0)
    assert not ctl.reference.state.applies
    ctl.reference.state.hold_until_s = math.inf
    assert ctl.reference.holding(ctl.outlook().now_s) is None


def test_a_controller_that_spends_more_per_token_is_held_on_the_reference():
    ctl, plant = trained()
    ref, lower = reference_and_lower(ctl)
    ledger = Ledger(ctl, plant.t_s)
    ledger.feed(ref, 200.0, 10)
    for _ in range(400):  # the same tokens for 20 % more energy, until the verdict holds
        ledger.feed(lower, 240.0, TICK_S)
        if ctl.reference.state.holds:
            break
    v = ctl.reference.state.verdict
    assert v is not None and not v.ahead and 1.19 < v.j_ratio < 1.21
    assert ctl.reference.allowance_left_j() < 0
    why = ctl.reference.holding(ledger.t_s)
    assert why is not None and "not measured ahead of the reference" in why


def test_a_controller_measured_well_ahead_keeps_control():
    ctl, ledger, _ = ten_seconds_each(130.0)
    v = ctl.reference.state.verdict
    assert v is not None and v.ahead and 0.6 < v.j_ratio < 0.7
    assert ctl.reference.holding(ledger.t_s) is None
    assert ctl.reference.state.holds == 0


def test_cheaper_tokens_with_more_slo_misses_are_not_ahead():
    ctl, _, _ = ten_seconds_each(130.0, ttft_s=5.0)  # every first token over the 2 s SLO
    v = ctl.reference.state.verdict
    assert v is not None and v.j_ratio < 0.7 and v.miss_controlled > v.miss_reference
    assert not v.ahead


def test_holds_double_while_the_controller_stays_behind_and_stop_at_the_maximum():
    ctl, plant = trained()
    ref, lower = reference_and_lower(ctl)
    s = ctl.reference.state
    ledger = Ledger(ctl, plant.t_s)
    ledger.feed(ref, 200.0, 10)
    holds = []
    for _ in range(6):
        before = s.hold_until_s
        while s.hold_until_s == before:  # the controller's turn, until its verdict
            ledger.feed(lower, 240.0, TICK_S)
        holds.append(s.hold_until_s - ledger.t_s)
        ledger.feed(ref, 200.0, holds[-1])  # the hold: the reference runs
        assert ctl.reference.holding(ledger.t_s) is None
    assert holds == [10, 20, 40, 80, 160, 160]


def test_a_hold_makes_the_decision_the_reference_and_ends_on_time():
    ctl, plant = trained(budget_w=700.0)  # no power ceiling: the reference is the top clock
    assert ctl.state is ControllerState.TRACKING
    assert ctl.knobs.sm_clock_mhz < 1980  # the controller had walked the clock down
    ctl.reference.state.hold_until_s = plant.t_s + 5.0
    decisions = run(ctl, plant, 4)
    held = [d for d in decisions if d.state is ControllerState.REFERENCE]
    assert held and all(d.reason_code is Reason.REFERENCE for d in held)
    for d in held:
        assert (d.knobs.sm_clock_mhz, d.knobs.max_num_seqs) == (1980, 64)
        assert (d.knobs.max_num_batched_tokens, d.knobs.decode_interval_ms) == (512, 0.0)
    later = run(ctl, plant, 10)
    assert later[-1].state is not ControllerState.REFERENCE


def test_before_the_reference_is_measured_it_runs_after_learning():
    ctl = make_controller()
    plant = Plant(compute_share=0.1)
    decisions = run(ctl, plant, 30)
    states = [d.state for d in decisions]
    first_ref = states.index(ControllerState.REFERENCE)
    assert ControllerState.TRACKING not in states[:first_ref]  # learning, then the reference
    assert ControllerState.TRACKING in states[first_ref:]  # then the controller's turn
    assert len(ctl.reference.state.reference_epochs) >= ctl.params.reference.reference_min_epochs


def test_where_nothing_is_predicted_to_meet_the_targets_the_reference_runs():
    # The model predicts every clock misses the TTFT SLO (it counts 3000-token prompts):
    # nothing dearer than the reference is run for a target the reference misses too.
    params = ControllerParams.of(
        quant_dwell_s=20.0, quant_explore_dwell_s=10.0, quant_start_by_table=False
    )
    # A budget the plant never reaches: no power ceiling, the reference is the top clock.
    ctl = make_controller(levels=TABLE_INT8_TWICE_AS_FAST, params=params, budget_w=700.0)
    plant = LongPromptPlant(
        compute_share=0.3, decode_rate_tok_s=40.0, prompt_rate_tok_s=900.0, request_rate_s=0.3
    )
    decisions = run(ctl, plant, 120)
    infeasible = [d for d in decisions if d.reason_code is Reason.INFEASIBLE]
    assert len(infeasible) > 200
    for d in infeasible:
        k = d.knobs
        assert (k.sm_clock_mhz, k.max_num_batched_tokens, k.decode_interval_ms) == (1980, 512, 0)


def test_a_controller_slightly_behind_keeps_control_within_the_runs_allowance():
    # 0.5 % more energy per token: not ahead, but the run's energy above the reference
    # stays within reference_allowance (1 %) of the reference's: no hold yet.
    ctl, ledger, lower = ten_seconds_each(201.0)
    v = ctl.reference.state.verdict
    assert v is not None and not v.energy_ahead and v.latency_ahead
    assert ctl.reference.state.excess_j > 0 and ctl.reference.allowance_left_j() > 0
    assert ctl.reference.holding(ledger.t_s) is None and ctl.reference.state.holds == 0
    # At 5 % more the allowance (1 % of 300 s at the reference's 200 W) runs out within a
    # minute: then the reference holds.
    for _ in range(400):
        ledger.feed(lower, 210.0, TICK_S)
        if ctl.reference.state.holds:
            break
    assert ctl.reference.state.holds == 1 and ctl.reference.allowance_left_j() < 0
    assert ctl.reference.holding(ledger.t_s) is not None
