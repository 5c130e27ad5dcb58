"""Single writer between allocator instances, over the broker's retained claim."""

from __future__ import annotations

from wattserve.fleet.leader import Leadership, Role


def broker_order(instances, claims, now_s):
    """Every subscriber sees the claims in the same order (the broker's)."""
    for claimant in claims:
        for inst in instances:
            inst.on_claim(claimant, now_s)


def test_one_of_two_simultaneous_claimants_leads():
    a, b = Leadership("a", 6.0, 2.0), Leadership("b", 6.0, 2.0)
    assert a.tick(0.0).publish_claim and b.tick(0.0).publish_claim
    broker_order([a, b], ["a", "b"], 0.1)  # b's claim landed last
    assert a.role is Role.CLAIMING  # b came after a: a yields when it confirms
    assert a.tick(2.0).role is Role.STANDBY
    assert b.tick(2.0).role is Role.LEADER


def test_a_standby_stays_passive_while_the_leader_renews_and_takes_over_after():
    leader, standby = Leadership("a", 6.0, 2.0), Leadership("b", 6.0, 2.0)
    leader.tick(0.0)
    broker_order([leader, standby], ["a"], 0.0)
    assert leader.tick(2.0).role is Role.LEADER
    for t in (2.0, 4.0, 6.0, 8.0):
        broker_order([leader, standby], ["a"], t)  # renewals
        assert standby.tick(t + 0.5).role is Role.STANDBY
        assert not standby.tick(t + 0.5).publish_claim
    # The leader dies; its Will clears the claim (or the claim just stops coming).
    assert standby.tick(8.0 + 5.0).role is Role.STANDBY
    action = standby.tick(8.0 + 6.0)
    assert action.publish_claim and action.role is Role.CLAIMING
    standby.on_claim("b", 14.1)
    assert standby.tick(16.0).role is Role.LEADER


def test_a_leader_that_sees_a_newer_claim_steps_down():
    a = Leadership("a", 6.0, 2.0)
    a.tick(0.0)
    a.on_claim("a", 0.0)
    assert a.tick(2.0).role is Role.LEADER
    a.on_claim("b", 3.0)
    assert a.role is Role.STANDBY
    assert not a.tick(3.5).publish_claim


def test_a_fresh_connection_listens_before_it_claims():
    a = Leadership("a", 6.0, 2.0)
    a.on_connect(10.0)
    assert not a.tick(10.0).publish_claim
    a.on_claim("b", 10.05)  # the retained claim of a live leader
    assert not a.tick(12.0).publish_claim and a.role is Role.STANDBY
