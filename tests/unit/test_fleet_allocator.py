"""The stateful allocator: leases, make-before-break raises, silent nodes, the site meter.

The property test plays rounds against simulated nodes that obey the node-side rules
(apply only a live grant of a newer epoch; at lease expiry drop to the safe floor), with
grants lost, delayed and applied in any order, and checks that the power limits in force
never sum above the site budget.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wattserve.fleet.allocator import (
    Allocator,
    AllocatorParams,
    Demand,
    FleetConfigError,
    Grant,
    NodeSpec,
)

PERIOD_S = 2.0


class SimNode:
    """A node as wattserve/fleet/node.py behaves: its power limit is the grant in force."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.grant: Grant | None = None

    def limit_w(self, now_s: float) -> float:
        if self.grant is None or self.grant.expires_s <= now_s:
            self.grant = None
            return self.spec.floor_w  # the safe floor
        return self.grant.budget_w

    def offer(self, grant: Grant, now_s: float) -> None:
        if grant.expires_s <= now_s:
            return
        if self.grant is not None and grant.epoch <= self.grant.epoch:
            return
        self.grant = grant

    def demand(self, need_w: float, gain: float, now_s: float) -> Demand:
        live = self.grant if self.grant and self.grant.expires_s > now_s else None
        return Demand(
            need_w=need_w,
            goodput_per_w=gain,
            device_min_w=0.0,
            device_max_w=self.spec.ceiling_w,
            power_w=self.limit_w(now_s) * 0.9,
            grant_epoch=live.epoch if live else None,
            received_s=now_s,
            grant_w=live.budget_w if live else None,
            grant_expires_s=live.expires_s if live else None,
        )


def make_fleet(n: int, budget_w: float, **params) -> tuple[Allocator, list[NodeSpec]]:
    specs = [NodeSpec(f"n{i}", floor_w=100.0, ceiling_w=700.0, band=i % 2) for i in range(n)]
    alloc = Allocator(
        specs,
        AllocatorParams(site_budget_w=budget_w, period_s=PERIOD_S, **params),
        random.Random(1),
    )
    return alloc, specs


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 8),
    slack_w=st.floats(0, 3000),
    seed=st.integers(0, 2**32 - 1),
    rounds=st.integers(5, 40),
)
def test_limits_in_force_never_exceed_the_site_budget(n, slack_w, seed, rounds):
    rng = random.Random(seed)
    budget_w = 100.0 * n + slack_w
    alloc, specs = make_fleet(n, budget_w, lease_s=7.0, grace_s=3.0)
    nodes = {s.node_id: SimNode(s) for s in specs}
    in_flight: list[Grant] = []  # grants delayed by the broker
    now_s = 1_000.0
    for _ in range(rounds):
        for node in nodes.values():
            if rng.random() < 0.8:  # sometimes a node stays silent
                alloc.observe_demand(
                    node.spec.node_id,
                    node.demand(rng.uniform(0, 900), rng.uniform(0, 10), now_s),
                )
        result = alloc.round(now_s)
        assert sum(g.budget_w for g in result.grants) <= budget_w + 1e-6
        for g in result.grants:
            assert g.budget_w >= 100.0 - 1e-6
        in_flight.extend(g for g in result.grants if rng.random() < 0.85)
        rng.shuffle(in_flight)
        # Deliver some now, in any order, checking the site after each one.
        keep = []
        for g in in_flight:
            if rng.random() < 0.7:
                nodes[g.node_id].offer(g, now_s)
                assert sum(x.limit_w(now_s) for x in nodes.values()) <= budget_w + 1e-6
            else:
                keep.append(g)
        in_flight = keep
        now_s += PERIOD_S * rng.uniform(0.5, 1.5)
        assert sum(x.limit_w(now_s) for x in nodes.values()) <= budget_w + 1e-6


def test_floors_over_the_budget_refuse_to_start():
    with pytest.raises(FleetConfigError, match="floors"):
        make_fleet(4, 399.0)


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_a_fair_share_ratio_outside_0_1_is_refused(ratio):
    with pytest.raises(FleetConfigError, match="fair_share_ratio"):
        make_fleet(2, 900.0, fair_share_ratio=ratio)


def drive(alloc, nodes, needs, now_s, rounds, gain=None):
    result = None
    for _ in range(rounds):
        for node_id, node in nodes.items():
            if node_id in needs:
                g = (gain or {}).get(node_id, 1.0)
                alloc.observe_demand(node_id, node.demand(needs[node_id], g, now_s))
        result = alloc.round(now_s)
        for g in result.grants:
            nodes[g.node_id].offer(g, now_s)
        now_s += PERIOD_S
    return result, now_s


def test_grants_follow_load_cut_fast_and_raise_slowly():
    alloc, specs = make_fleet(2, 900.0, raise_step_w=50.0, hysteresis_w=10.0)
    nodes = {s.node_id: SimNode(s) for s in specs}
    result, now_s = drive(alloc, nodes, {"n0": 600, "n1": 600}, 0.0, 20)
    grants = {g.node_id: g.budget_w for g in result.grants}
    assert grants["n1"] == pytest.approx(600, abs=1)  # band 1 first
    assert grants["n0"] == pytest.approx(300, abs=1)
    # n1's load drops: its cut comes in one round (to its need plus the 100 W surplus,
    # which goes to the higher band first); n0's raise waits until the cut is applied (the
    # grant n1 runs under is charged until it acknowledges the new one), then comes up to
    # its fair share (450 W) at once and above it in steps.
    result, now_s = drive(alloc, nodes, {"n0": 600, "n1": 200}, now_s, 1)
    grants = {g.node_id: g.budget_w for g in result.grants}
    assert grants["n1"] == pytest.approx(300, abs=1e-6)
    assert grants["n0"] <= 301  # freed watts not reused yet (n1 stopped 0.5 W short)
    before = grants["n0"]
    result, now_s = drive(alloc, nodes, {"n0": 600, "n1": 200}, now_s, 1)
    assert before < 450
    step = {g.node_id: g.budget_w for g in result.grants}["n0"] - 450
    assert 25 - 1e-6 <= step <= 50 + 1e-6  # jittered within [0.5, 1] x raise_step_w
    result, now_s = drive(alloc, nodes, {"n0": 600, "n1": 200}, now_s, 15)
    grants = {g.node_id: g.budget_w for g in result.grants}
    assert grants["n0"] == pytest.approx(600, abs=11)
    assert sum(grants.values()) <= 900


def test_small_changes_inside_the_hysteresis_change_nothing():
    alloc, specs = make_fleet(2, 900.0, hysteresis_w=20.0)
    nodes = {s.node_id: SimNode(s) for s in specs}
    result, now_s = drive(alloc, nodes, {"n0": 600, "n1": 600}, 0.0, 40)
    before = {g.node_id: g.budget_w for g in result.grants}
    assert before["n1"] == pytest.approx(600, abs=20)
    assert before["n0"] == pytest.approx(300, abs=20)
    # Targets move by 5 W (n1 595, n0 305): nothing is reissued with another budget.
    result, now_s = drive(alloc, nodes, {"n0": 610, "n1": 595}, now_s, 3)
    assert {g.node_id: g.budget_w for g in result.grants} == before


def test_a_silent_node_is_charged_until_lease_and_grace_then_released():
    alloc, specs = make_fleet(2, 1000.0, lease_s=6.0, grace_s=4.0, demand_timeout_s=4.0)
    nodes = {s.node_id: SimNode(s) for s in specs}
    result, now_s = drive(alloc, nodes, {"n0": 700, "n1": 500}, 0.0, 20)
    held = {g.node_id: g.budget_w for g in result.grants}
    assert held["n1"] == pytest.approx(500, abs=1)
    last_grant_s = now_s - PERIOD_S
    states = []
    while now_s < last_grant_s + 6.0 + 4.0 + 3 * PERIOD_S:
        result, now_s = drive(alloc, nodes, {"n0": 700}, now_s, 1)
        states.append((result.time_s, result.nodes["n1"].state, result.nodes["n1"].charge_w))
        n0 = {g.node_id: g.budget_w for g in result.grants}["n0"]
        assert n0 + result.nodes["n1"].charge_w <= 1000 + 1e-6
        if result.nodes["n1"].state == "silent":
            assert result.nodes["n1"].charge_w >= 500 - 1e-6
            assert n0 <= 500 + 1e-6
    assert states[-1][1] == "released"
    # Released: n1 is charged its floor (its safe floor) and n0 grows into the rest.
    result, now_s = drive(alloc, nodes, {"n0": 700}, now_s, 10)
    assert {g.node_id: g.budget_w for g in result.grants}["n0"] == pytest.approx(700, abs=11)
    assert result.nodes["n1"].charge_w == 100


def test_a_fresh_allocator_charges_grants_it_did_not_issue():
    alloc, specs = make_fleet(2, 1000.0)
    nodes = {s.node_id: SimNode(s) for s in specs}
    drive(alloc, nodes, {"n0": 300, "n1": 700}, 0.0, 20)
    assert nodes["n1"].grant.budget_w == pytest.approx(700, abs=1)
    # A standby takes over; n1 has not spoken yet, n0 now wants everything.
    standby, _ = make_fleet(2, 1000.0)
    now_s = 40.0
    standby.observe_demand("n0", nodes["n0"].demand(900, 1.0, now_s))
    result = standby.round(now_s)
    assert result.nodes["n1"].charge_w == 700  # unknown: its ceiling until a lease passes
    assert {g.node_id: g.budget_w for g in result.grants}["n0"] <= 300 + 1e-6
    standby.observe_demand("n1", nodes["n1"].demand(700, 1.0, now_s + 2))
    result = standby.round(now_s + 2)
    assert result.nodes["n1"].charge_w == pytest.approx(nodes["n1"].grant.budget_w)


def test_the_site_meter_over_its_threshold_cuts_everyone_at_once():
    alloc, specs = make_fleet(4, 2400.0, site_meter_threshold_w=2000.0, emergency_margin_ratio=0.1)
    nodes = {s.node_id: SimNode(s) for s in specs}
    needs = {s.node_id: 600.0 for s in specs}
    result, now_s = drive(alloc, nodes, needs, 0.0, 20)
    before = sum(g.budget_w for g in result.grants)
    assert before == pytest.approx(2400, abs=1)
    alloc.observe_site_power(2500.0, now_s)
    result, now_s = drive(alloc, nodes, needs, now_s, 1)
    assert result.emergency
    after = sum(g.budget_w for g in result.grants)
    assert after <= before * 2000 * 0.9 / 2500 + 1e-6
    # No give-backs while the emergency hold lasts, even with the meter quiet again.
    alloc.observe_site_power(1500.0, now_s)
    result, now_s = drive(alloc, nodes, needs, now_s, 3)
    assert sum(g.budget_w for g in result.grants) <= after + 1e-6


def test_a_takeover_keeps_the_grants_in_force_and_outbids_their_epochs():
    alloc, specs = make_fleet(2, 1000.0)
    nodes = {s.node_id: SimNode(s) for s in specs}
    drive(alloc, nodes, {"n0": 300, "n1": 700}, 0.0, 20)
    held = nodes["n1"].grant
    assert held.budget_w == pytest.approx(700, abs=1)
    # The standby's clock runs 30 s behind its predecessor's.
    standby, _ = make_fleet(2, 1000.0)
    now_s = 40.0 - 30.0
    for node_id, need in (("n0", 300.0), ("n1", 700.0)):
        d = nodes[node_id].demand(need, 1.0, now_s)
        standby.observe_demand(node_id, d)
    result = standby.round(now_s)
    grants = {g.node_id: g for g in result.grants}
    assert result.epoch > held.epoch  # the nodes accept them
    assert grants["n1"].budget_w == pytest.approx(held.budget_w)  # no cut to the floor


@pytest.mark.parametrize(("ratio", "owed_w"), [(1.0, 450.0), (0.0, None)])
def test_a_node_that_needs_its_equal_share_keeps_it(ratio, owed_w):
    # Two nodes in one band, 900 W: the equal split is 450 W each. The node a watt helps
    # less still gets 450 W with fair shares on; without, water-filling gives it less.
    specs = [NodeSpec(f"n{i}", floor_w=100.0, ceiling_w=700.0) for i in range(2)]
    params = AllocatorParams(site_budget_w=900.0, period_s=PERIOD_S, fair_share_ratio=ratio)
    alloc = Allocator(specs, params, random.Random(1))
    nodes = {s.node_id: SimNode(s) for s in specs}
    result, _ = drive(alloc, nodes, {"n0": 700, "n1": 700}, 0.0, 30, gain={"n0": 10, "n1": 1})
    grants = {g.node_id: g.budget_w for g in result.grants}
    assert sum(grants.values()) <= 900 + 1e-6
    if owed_w is None:
        assert grants["n1"] < 400
    else:
        assert grants["n1"] == pytest.approx(owed_w, abs=11)  # within the hysteresis


def test_a_node_whose_need_jumps_gets_its_fair_share_once_the_watts_are_free():
    # One band, 900 W: the equal split is 450 W each. n1 idles at 150 W while n0 takes the
    # rest; then n1's need jumps to 700 W. Its raise to its 450 W share waits one round for
    # n0's cut to be acknowledged (make-before-break), then comes whole: not in paced steps
    # of at most raise_step_w, and not left a hysteresis short.
    specs = [NodeSpec(f"n{i}", floor_w=100.0, ceiling_w=700.0) for i in range(2)]
    params = AllocatorParams(
        site_budget_w=900.0, period_s=PERIOD_S, raise_step_w=50.0, hysteresis_w=10.0
    )
    alloc = Allocator(specs, params, random.Random(1))
    nodes = {s.node_id: SimNode(s) for s in specs}
    gain = {"n0": 10, "n1": 1}
    result, now_s = drive(alloc, nodes, {"n0": 700, "n1": 150}, 0.0, 30, gain=gain)
    grants = {g.node_id: g.budget_w for g in result.grants}
    assert grants["n0"] == pytest.approx(700, abs=11)
    assert grants["n1"] < 250
    result, now_s = drive(alloc, nodes, {"n0": 700, "n1": 700}, now_s, 1, gain=gain)
    grants = {g.node_id: g.budget_w for g in result.grants}
    assert grants["n0"] == pytest.approx(450, abs=1e-6)  # cut at once
    assert grants["n1"] < 250  # n0 still runs under its 700 W grant
    result, now_s = drive(alloc, nodes, {"n0": 700, "n1": 700}, now_s, 1, gain=gain)
    grants = {g.node_id: g.budget_w for g in result.grants}
    assert grants["n1"] == pytest.approx(450, abs=1e-6)
    assert sum(grants.values()) <= 900 + 1e-6


def ask(need_w: float, now_s: float, **kw) -> Demand:
    args = dict(
        need_w=need_w,
        goodput_per_w=1.0,
        device_min_w=0.0,
        device_max_w=700.0,
        power_w=None,
        grant_epoch=None,
        received_s=now_s,
    )
    return Demand(**{**args, **kw})


def test_a_node_drawing_above_its_grant_is_charged_what_it_draws():
    """n0 runs under a 300 W grant but draws 650 W (a limit not enforced yet, or a PUT):
    the site sees watts, so n1 may only have what is left of them."""
    alloc, _ = make_fleet(2, 1000.0, lease_s=7.0, grace_s=3.0)
    now_s = 1_000.0
    for _ in range(3):  # past the fresh allocator's warm-up charge of unknown nodes
        alloc.observe_demand("n0", ask(300.0, now_s, power_w=650.0))
        alloc.observe_demand("n1", ask(900.0, now_s))
        result = alloc.round(now_s)
        now_s += 7.0
    assert result.nodes["n0"].charge_w == 650.0
    grants = {g.node_id: g.budget_w for g in result.grants}
    assert grants["n1"] <= 1000.0 - 650.0 + 1e-6
    assert result.committed_w <= 1000.0 + 1e-6
    # A report above the site's ceiling counts as the ceiling, no more.
    alloc.observe_power("n0", 5_000.0)
    assert alloc.round(now_s).nodes["n0"].charge_w == 700.0


def test_floors_that_do_not_fit_are_never_granted():
    """n2 fell silent drawing 700 W: with it charged, the floors of n0 and n1 no longer
    fit the 1,000 W budget. No grant goes out (each node falls to its safe floor at its
    lease's end) rather than floors over the budget."""
    specs = [NodeSpec(f"n{i}", floor_w=300.0, ceiling_w=700.0) for i in range(3)]
    params = AllocatorParams(site_budget_w=1000.0, period_s=PERIOD_S, lease_s=7.0, grace_s=3.0)
    alloc = Allocator(specs, params, random.Random(1))
    now_s = 1_000.0
    alloc.observe_demand("n2", ask(700.0, now_s, power_w=700.0))
    for node in ("n0", "n1"):
        alloc.observe_demand(node, ask(300.0, now_s))
    alloc.round(now_s)
    now_s += 7.0  # n2 silent from here on
    for node in ("n0", "n1"):
        alloc.observe_demand(node, ask(300.0, now_s))
    result = alloc.round(now_s)
    assert result.nodes["n2"].state == "silent" and result.infeasible
    assert result.grants == ()
    assert result.committed_w > 1000.0  # what is owed, reported as it is


def test_a_far_future_expiry_keeps_a_silent_node_charged_one_lease_at_most():
    """A demand reporting a grant that expires in a year: once the node falls silent it is
    released after one lease plus the grace from that demand, not a year later."""
    alloc, _ = make_fleet(2, 1000.0, lease_s=7.0, grace_s=3.0)
    now_s = 1_000.0
    far = dict(grant_epoch=5, grant_w=690.0, grant_expires_s=now_s + 3.0e7, power_w=690.0)
    alloc.observe_demand("n0", ask(700.0, now_s, **far))
    alloc.observe_demand("n1", ask(700.0, now_s))
    states = []
    for _ in range(10):
        alloc.observe_demand("n1", ask(700.0, now_s))
        states.append((now_s - 1_000.0, alloc.round(now_s).nodes["n0"].state))
        now_s += PERIOD_S
    # Silent after demand_timeout_s (6 s); its last grant (issued then) runs 7 s, then 3 s.
    released = [t for t, state in states if state == "released"]
    assert released and released[0] <= 6.0 + 7.0 + 3.0 + PERIOD_S


def test_a_reported_epoch_moves_only_that_nodes_epochs():
    alloc, _ = make_fleet(2, 1000.0)
    now_s = 1_000.0
    alloc.observe_demand("n0", ask(300.0, now_s, grant_epoch=10**14, grant_w=300.0))
    alloc.observe_demand("n1", ask(300.0, now_s))
    epochs = {g.node_id: g.epoch for g in alloc.round(now_s).grants}
    assert epochs["n0"] == 10**14 + 1  # n0 accepts it
    assert epochs["n1"] == int(now_s * 1000)  # n1's grants are not dragged along


def test_a_reported_floor_above_the_sites_does_not_raise_it():
    alloc, _ = make_fleet(2, 1000.0)
    now_s = 1_000.0
    for node in ("n0", "n1"):
        alloc.observe_demand(node, ask(100.0, now_s, device_min_w=700.0))
    result = alloc.round(now_s)
    # Floors of 700 W each would not fit the 1,000 W budget: the site's 100 W hold.
    assert not result.infeasible and len(result.grants) == 2
    assert sum(g.budget_w for g in result.grants) <= 1000.0 + 1e-6
