"""The pure allocation of one round: budget, floors, ceilings, band order, monotonicity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wattserve.fleet.allocation import InfeasibleFloors, NodeAsk, allocate

EPS_W = 1e-6


@st.composite
def asks_and_budget(draw, max_nodes: int = 12):
    n = draw(st.integers(1, max_nodes))
    asks = {}
    for i in range(n):
        floor_w = draw(st.floats(0, 300))
        ceiling_w = floor_w + draw(st.floats(0, 500))
        asks[f"n{i}"] = NodeAsk(
            band=draw(st.integers(0, 2)),
            floor_w=floor_w,
            ceiling_w=ceiling_w,
            need_w=draw(st.floats(0, 900)),
            goodput_per_w=draw(st.floats(0, 20)),
            share_w=draw(st.sampled_from([0.0, 150.0, 400.0])),
        )
    floors_w = sum(a.floor_w for a in asks.values())
    budget_w = floors_w + draw(st.floats(0, 3000))
    return asks, budget_w


@settings(max_examples=300, deadline=None)
@given(asks_and_budget())
def test_grants_fit_the_budget_and_the_bounds(case):
    asks, budget_w = case
    grants = allocate(asks, budget_w)
    assert set(grants) == set(asks)
    assert sum(grants.values()) <= budget_w + EPS_W
    for node, ask in asks.items():
        assert ask.floor_w - EPS_W <= grants[node] <= ask.ceiling_w + EPS_W


@settings(max_examples=300, deadline=None)
@given(asks_and_budget())
def test_a_band_is_short_only_when_every_lower_band_is_at_its_floors(case):
    asks, budget_w = case
    grants = allocate(asks, budget_w)
    for node, ask in asks.items():
        if grants[node] < ask.want_w - 1e-3:
            for other, lower in asks.items():
                if lower.band < ask.band:
                    assert grants[other] <= lower.floor_w + 1e-3, (node, other)


@settings(max_examples=300, deadline=None)
@given(asks_and_budget())
def test_the_budget_is_used_before_anyone_is_short(case):
    asks, budget_w = case
    grants = allocate(asks, budget_w)
    short = any(grants[n] < a.want_w - 1e-3 for n, a in asks.items())
    if short:
        assert sum(grants.values()) >= budget_w - 1e-3


@settings(max_examples=300, deadline=None)
@given(asks_and_budget(), st.data())
def test_more_need_never_gets_less(case, data):
    asks, budget_w = case
    node = data.draw(st.sampled_from(sorted(asks)))
    more_w = data.draw(st.floats(0, 500))
    before = allocate(asks, budget_w)[node]
    ask = asks[node]
    bigger = dict(asks)
    bigger[node] = NodeAsk(
        ask.band, ask.floor_w, ask.ceiling_w, ask.need_w + more_w, ask.goodput_per_w, ask.share_w
    )
    after = allocate(bigger, budget_w)[node]
    assert after >= before - 1e-3


@settings(max_examples=300, deadline=None)
@given(asks_and_budget())
def test_no_node_gets_past_its_fair_share_while_one_of_its_band_is_short_of_its_own(case):
    asks, budget_w = case
    grants = allocate(asks, budget_w)
    for node, ask in asks.items():
        if grants[node] < ask.owed_w - 1e-3:
            for other, peer in asks.items():
                if peer.band == ask.band:
                    assert grants[other] <= peer.owed_w + 1e-3, (node, other)


def test_the_fair_share_comes_before_the_water_filling():
    asks = {
        "efficient": NodeAsk(0, 100, 700, 600, goodput_per_w=10, share_w=350),
        "wasteful": NodeAsk(0, 100, 700, 600, goodput_per_w=1, share_w=350),
        "idle": NodeAsk(0, 100, 700, 120, goodput_per_w=0, share_w=350),
    }
    grants = allocate(asks, 920)
    # The idle node's unneeded share is water-filled; the wasteful node keeps its share.
    assert grants["idle"] == pytest.approx(120)
    assert grants["wasteful"] == pytest.approx(350)
    assert grants["efficient"] == pytest.approx(450)
    # Without fair shares the wasteful node gets less than its share.
    bare = {
        n: NodeAsk(a.band, a.floor_w, a.ceiling_w, a.need_w, a.goodput_per_w)
        for n, a in asks.items()
    }
    assert allocate(bare, 920)["wasteful"] < 350


def test_fair_shares_that_do_not_fit_are_cut_equally():
    asks = {
        "a": NodeAsk(0, 100, 700, 600, goodput_per_w=10, share_w=400),
        "b": NodeAsk(0, 100, 700, 600, goodput_per_w=1, share_w=400),
        "c": NodeAsk(0, 100, 700, 150, goodput_per_w=1, share_w=400),
    }
    assert allocate(asks, 650) == pytest.approx({"a": 250, "b": 250, "c": 150})


def test_water_filling_favours_the_node_a_watt_helps_most():
    asks = {
        "efficient": NodeAsk(0, 100, 700, 600, goodput_per_w=10),
        "wasteful": NodeAsk(0, 100, 700, 600, goodput_per_w=2),
    }
    grants = allocate(asks, 800)
    assert grants["efficient"] > grants["wasteful"] > 100
    assert sum(grants.values()) == pytest.approx(800)


def test_a_higher_band_is_served_first():
    asks = {
        "batch": NodeAsk(0, 100, 700, 700, goodput_per_w=50),
        "interactive": NodeAsk(1, 100, 700, 700, goodput_per_w=1),
    }
    grants = allocate(asks, 900)
    assert grants == {"batch": 200, "interactive": 700}


def test_surplus_goes_up_to_the_ceilings():
    asks = {"a": NodeAsk(0, 100, 400, 150, 1), "b": NodeAsk(0, 100, 300, 150, 1)}
    assert allocate(asks, 1000) == {"a": 400, "b": 300}


def test_floors_over_the_budget_fail_closed():
    with pytest.raises(InfeasibleFloors):
        allocate({"a": NodeAsk(0, 300, 400, 300, 1), "b": NodeAsk(0, 300, 400, 300, 1)}, 500)
