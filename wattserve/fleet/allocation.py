"""One allocation round's target: priority bands, then water-filling on marginal goodput.

Input: each node's floor, ceiling, the power it needs to meet its SLOs now, its marginal
goodput per watt, its fair share and its priority band; and the watts there are to share.
Output: a target
grant per node. Pure and deterministic: no clock, no randomness, no state; hysteresis,
leases and the pace of changes are the allocator's (`wattserve.fleet.allocator`), not this module's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# Bisection steps on the water level; 60 halvings take any float range to its last bits.
_BISECT_STEPS = 60


@dataclass(frozen=True)
class NodeAsk:
    """What one node asks for in a round. Watts; goodput in tokens/s that meet the SLOs.

    band: priority band, higher is more important (cut last).
    floor_w <= ceiling_w; need_w is clamped into [floor_w, ceiling_w] by the allocation.
    goodput_per_w: marginal goodput per watt at the floor (> 0); the allocation assumes it
    falls linearly to zero at need_w (diminishing returns), which is what makes the
    water-filling spread watts instead of handing all to the single best node.
    share_w: the node's fair share; inside a band that cannot be met in full, the node gets
    min(want_w, share_w) before any watt goes by marginal goodput (0: no such guarantee).
    """

    band: int
    floor_w: float
    ceiling_w: float
    need_w: float
    goodput_per_w: float
    share_w: float = 0.0

    def __post_init__(self) -> None:
        for name in ("floor_w", "ceiling_w", "need_w", "goodput_per_w", "share_w"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if self.ceiling_w < self.floor_w:
            raise ValueError(f"ceiling_w {self.ceiling_w} < floor_w {self.floor_w}")

    @property
    def want_w(self) -> float:
        """need_w clamped into [floor_w, ceiling_w]."""
        return min(max(self.need_w, self.floor_w), self.ceiling_w)

    @property
    def owed_w(self) -> float:
        """What a short band gives this node before water-filling: its want up to its share."""
        return max(self.floor_w, min(self.want_w, self.share_w))


class InfeasibleFloors(ValueError):
    """The floors alone exceed the watts to share: fail closed, allocate nothing."""


def allocate(asks: Mapping[str, NodeAsk], budget_w: float) -> dict[str, float]:
    """Target grants summing to at most budget_w, each within [floor_w, ceiling_w].

    NOTE: the order of filling is the safety and fairness contract.
    1. Every node gets its floor (raises InfeasibleFloors if the floors do not fit).
    2. Needs, band by band from the highest: a band's needs are met in full before the next
       band gets a watt above its floor, so a band is short only when every lower band is at
       its floors. Inside a band that cannot be met in full, each node first gets its want
       up to its fair share (share_w; if even those do not fit, equal watts up to them),
       so no node that needs its share is worse off than under a static split; the rest
       goes by water-filling on marginal goodput per watt: one water level L, node i at the
       power where its marginal goodput g_i * (want_i - p) / (want_i - floor_i) equals L.
    3. What is left after all needs, band by band from the highest, up to the ceilings,
       equal watts per node (headroom for bursts between rounds).
    """
    if not math.isfinite(budget_w) or budget_w < 0:
        raise ValueError(f"budget_w must be finite and >= 0, got {budget_w!r}")
    grants = {node: ask.floor_w for node, ask in asks.items()}
    left_w = budget_w - sum(grants.values())
    if left_w < -1e-9:
        raise InfeasibleFloors(
            f"floors sum to {sum(grants.values()):.1f} W over the {budget_w:.1f} W budget"
        )
    bands = sorted({ask.band for ask in asks.values()}, reverse=True)
    for band in bands:
        members = {n: a for n, a in asks.items() if a.band == band}
        wanted_w = sum(a.want_w - a.floor_w for a in members.values())
        if wanted_w <= left_w:
            for node, ask in members.items():
                grants[node] = ask.want_w
            left_w -= wanted_w
        else:
            for node, extra_w in _short_band(members, max(left_w, 0.0)).items():
                grants[node] += extra_w
            left_w = 0.0
            break
    for band in bands:
        if left_w <= 0:
            break
        members = {n: asks[n].ceiling_w - grants[n] for n in asks if asks[n].band == band}
        given = _equal_fill(members, left_w)
        for node, extra_w in given.items():
            grants[node] += extra_w
        left_w -= sum(given.values())
    # Float sums can land a hair over the budget; shave it off the largest grant above floor.
    excess_w = sum(grants.values()) - budget_w
    if excess_w > 0:
        node = max(grants, key=lambda n: grants[n] - asks[n].floor_w)
        grants[node] = max(asks[node].floor_w, grants[node] - excess_w)
    return grants


def _short_band(members: Mapping[str, NodeAsk], watts: float) -> dict[str, float]:
    """Watts above the floors for one band that cannot be met in full: the fair shares
    first, then equal marginals."""
    owed = {n: a.owed_w - a.floor_w for n, a in members.items()}
    if sum(owed.values()) >= watts:
        return _equal_fill(owed, watts)
    extra = _water_fill(members, owed, watts - sum(owed.values()))
    return {n: owed[n] + extra[n] for n in members}


def _water_fill(
    members: Mapping[str, NodeAsk], owed: Mapping[str, float], watts: float
) -> dict[str, float]:
    """Watts on top of what each node is owed (above its floor): equal marginals."""
    spans = {n: a.want_w - a.floor_w for n, a in members.items()}
    rooms = {n: spans[n] - owed[n] for n in members}
    live = {n: a for n, a in members.items() if rooms[n] > 0}
    if not live or watts <= 0:
        return {n: 0.0 for n in members}
    # A node reporting no marginal gain still ranks, last: a tiny positive goodput.
    gains = {n: max(a.goodput_per_w, 1e-12) for n, a in live.items()}

    def extra_at(level: float) -> dict[str, float]:
        return {n: max(0.0, spans[n] * (1.0 - level / gains[n]) - owed[n]) for n in live}

    low, high = 0.0, max(gains.values())
    for _ in range(_BISECT_STEPS):
        mid = (low + high) / 2
        if sum(extra_at(mid).values()) > watts:
            low = mid
        else:
            high = mid
    extra = extra_at(high)  # the side that fits
    # Bisection leaves a sliver unallocated (more where gains differ by many orders of
    # magnitude); it goes to the best nodes with room, so a short band uses every watt.
    left = watts - sum(extra.values())
    for n in sorted(live, key=lambda n: -gains[n]):
        if left <= 0:
            break
        take = min(left, rooms[n] - extra[n])
        extra[n] += take
        left -= take
    return {n: extra.get(n, 0.0) for n in members}


def _equal_fill(room: Mapping[str, float], watts: float) -> dict[str, float]:
    """Equal watts per node, each up to its room; what one cannot take goes to the others."""
    given = {n: 0.0 for n in room}
    open_nodes = sorted((n for n in room if room[n] > 0), key=lambda n: room[n])
    left = watts
    while open_nodes and left > 1e-12:
        share = left / len(open_nodes)
        smallest = open_nodes[0]
        if room[smallest] - given[smallest] <= share:
            take = room[smallest] - given[smallest]
            for n in open_nodes:
                given[n] += take
            left -= take * len(open_nodes)
            open_nodes = [n for n in open_nodes if room[n] - given[n] > 1e-12]
        else:
            for n in open_nodes:
                given[n] += share
            left = 0.0
    return given
