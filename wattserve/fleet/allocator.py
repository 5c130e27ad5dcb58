"""The fleet allocator: turns demands into leased grants, one round per period.

It owns what one round cannot know: the grants issued and not yet superseded (a node may
still run under an older, larger one), which nodes went silent, hysteresis, the slow and
jittered pace of give-backs, and the site meter's emergency cut. A node's floor and ceiling
are the site's (NodeSpec): what a node reports only narrows them, its measured power is
charged when above its grant, and what it reports of its grant is bounded by one lease.
The target of a round is
`wattserve.fleet.allocation.allocate`. Time and randomness are injected (`now_s`, `rng`); it
must not read a clock, sleep, publish or log: the service (wattserve/fleet/service.py) does the I/O.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from wattserve.fleet.allocation import InfeasibleFloors, NodeAsk, allocate


class FleetConfigError(ValueError):
    """The fleet cannot be run safely as configured (fail closed)."""


@dataclass(frozen=True)
class NodeSpec:
    """A node the site budget is shared with. band: higher is more important (cut last).

    floor_w must be at least the node's own `[fleet] safe_floor_w`: it is what the node falls
    back to when its lease expires, so it is what the allocator reserves for a node it
    cannot reach.
    """

    node_id: str
    floor_w: float
    ceiling_w: float
    band: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.floor_w) and self.floor_w >= 0):
            raise FleetConfigError(f"node {self.node_id}: floor_w must be >= 0")
        if not (math.isfinite(self.ceiling_w) and self.ceiling_w >= self.floor_w):
            raise FleetConfigError(f"node {self.node_id}: ceiling_w must be >= floor_w")


@dataclass(frozen=True)
class AllocatorParams:
    """Timing and pacing. Seconds and watts; times are the injected clock's (unix seconds)."""

    site_budget_w: float
    period_s: float = 2.0
    lease_s: float = 10.0  # a grant's life; the node drops to its safe floor after it
    grace_s: float = 5.0  # a silent node stays charged until its lease plus this
    demand_timeout_s: float = 6.0  # no demand for this long: the node is silent
    hysteresis_w: float = 10.0  # targets this close to the grant in force change nothing
    raise_step_w: float = 50.0  # at most this much more per node per round (give-backs)
    raise_jitter_ratio: float = 0.5  # each raise step is drawn from [1 - this, 1] x step
    # A node's fair share is this x the site budget / the number of nodes: in a band that is
    # short, a node gets its need up to it before watts go by marginal goodput (0: none).
    fair_share_ratio: float = 1.0
    site_meter_threshold_w: float | None = None  # measured site power above it: emergency
    site_meter_timeout_s: float = 6.0  # an older reading is ignored
    emergency_margin_ratio: float = 0.05  # cut to this far below the threshold
    emergency_hold_s: float = 10.0  # no give-backs for this long after an emergency cut

    def __post_init__(self) -> None:
        if not (math.isfinite(self.site_budget_w) and self.site_budget_w > 0):
            raise FleetConfigError("site_budget_w must be > 0")
        if not 1.0 <= self.period_s <= 5.0:
            raise FleetConfigError(f"period_s must be within 1..5 s, got {self.period_s}")
        if self.lease_s <= self.period_s:
            raise FleetConfigError("lease_s must exceed period_s (a grant must outlive a round)")
        if self.grace_s < 0 or self.demand_timeout_s < self.period_s:
            raise FleetConfigError("grace_s must be >= 0 and demand_timeout_s >= period_s")
        if self.hysteresis_w < 0 or self.raise_step_w <= 0:
            raise FleetConfigError("hysteresis_w must be >= 0 and raise_step_w > 0")
        if not 0 <= self.raise_jitter_ratio < 1:
            raise FleetConfigError("raise_jitter_ratio must be within [0, 1)")
        if not 0 <= self.fair_share_ratio <= 1:
            raise FleetConfigError("fair_share_ratio must be within [0, 1]")
        if not 0 <= self.emergency_margin_ratio < 1:
            raise FleetConfigError("emergency_margin_ratio must be within [0, 1)")


@dataclass(frozen=True)
class Demand:
    """One node's demand as the allocator uses it (from the `demand` message).

    need_w: power it needs to meet its SLOs now; goodput_per_w: marginal goodput per watt;
    device_min_w / device_max_w: its power-limit range; power_w: measured, None if unknown;
    grant_epoch, grant_w, grant_expires_s: the grant it runs under, None if none (it is at
    its safe floor). A node reports them so that an allocator that has just started (or
    taken over from another) charges grants it did not issue itself.
    """

    need_w: float
    goodput_per_w: float
    device_min_w: float
    device_max_w: float
    power_w: float | None
    grant_epoch: int | None
    received_s: float
    grant_w: float | None = None
    grant_expires_s: float | None = None


@dataclass(frozen=True)
class Grant:
    node_id: str
    budget_w: float
    epoch: int
    expires_s: float


@dataclass(frozen=True)
class NodeRound:
    """One node's line in a round's report (the status page)."""

    state: str  # "active" | "silent" | "released" (silent past lease + grace) | "unknown"
    charge_w: float  # what the node may draw before this round's grants apply
    target_w: float | None
    grant_w: float | None  # issued this round; None: none issued (silent)
    demand: Demand | None


@dataclass(frozen=True)
class Round:
    time_s: float
    epoch: int
    grants: tuple[Grant, ...]
    nodes: Mapping[str, NodeRound]
    committed_w: float  # worst case: every node at the larger of its charge and new grant
    headroom_w: float  # site budget minus committed_w
    emergency: bool
    # Floors plus the charges of silent and unknown nodes exceed the budget: no grant is
    # issued this round (the nodes fall to their safe floors as their leases run out).
    infeasible: bool


@dataclass
class _Ledger:
    issued: list[tuple[int, float, float]] = field(default_factory=list)  # epoch, W, expires
    demand: Demand | None = None
    last_power_w: float | None = None
    epoch: int = -1  # the last epoch granted to this node (epochs rise per node)


class Allocator:
    """Leased grants for a fixed set of nodes within one site budget.

    Raises FleetConfigError at construction when the floors do not fit the budget.
    """

    def __init__(
        self, nodes: Iterable[NodeSpec], params: AllocatorParams, rng: random.Random
    ) -> None:
        self._specs = {n.node_id: n for n in nodes}
        if not self._specs:
            raise FleetConfigError("no nodes")
        floors_w = sum(n.floor_w for n in self._specs.values())
        if floors_w > params.site_budget_w:
            raise FleetConfigError(
                f"node floors sum to {floors_w:.1f} W, over the site budget "
                f"{params.site_budget_w:.1f} W: refusing to allocate"
            )
        self._params = params
        self._share_w = params.fair_share_ratio * params.site_budget_w / len(self._specs)
        self._rng = rng
        self._ledgers = {n: _Ledger() for n in self._specs}
        self._epoch = 0
        self._site_power: tuple[float, float] | None = None
        self._emergency_until_s = -math.inf
        self._started_s: float | None = None

    @property
    def params(self) -> AllocatorParams:
        return self._params

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def observe_demand(self, node_id: str, demand: Demand) -> bool:
        """Record a node's demand; False (ignored) for a node not in the config.

        What the node says of the grant it holds counts for one lease after its arrival
        at most: a far-future expiry must not keep a node charged once it falls silent."""
        ledger = self._ledgers.get(node_id)
        if ledger is None:
            return False
        spec = self._specs[node_id]
        if demand.grant_expires_s is not None:
            bound_s = demand.received_s + self._params.lease_s
            demand = replace(demand, grant_expires_s=min(demand.grant_expires_s, bound_s))
        if demand.grant_w is not None:
            demand = replace(demand, grant_w=min(demand.grant_w, spec.ceiling_w))
        ledger.demand = demand
        if demand.power_w is not None:
            self.observe_power(node_id, demand.power_w)
        return True

    def observe_power(self, node_id: str, power_w: float) -> None:
        """A node's measured power (its demand or telemetry), up to its ceiling: charged
        when above its grant, and while it is silent."""
        ledger = self._ledgers.get(node_id)
        if ledger is not None and math.isfinite(power_w):
            ledger.last_power_w = min(max(power_w, 0.0), self._specs[node_id].ceiling_w)

    def observe_site_power(self, power_w: float, time_s: float) -> None:
        """The site meter's reading."""
        self._site_power = (power_w, time_s)

    def round(self, now_s: float) -> Round:
        """One allocation round at now_s (unix seconds): grants for every active node."""
        p = self._params
        if self._started_s is None:
            self._started_s = now_s
        self._epoch = max(self._epoch + 1, int(now_s * 1000))
        states: dict[str, str] = {}
        charges: dict[str, float] = {}
        for node, ledger in self._ledgers.items():
            self._prune(ledger, now_s)
            states[node] = self._state(ledger, now_s)
            charges[node] = self._charge(node, states[node], now_s)
        active = [n for n in self._specs if states[n] == "active"]
        fixed_w = sum(charges[n] for n in self._specs if states[n] != "active")
        asks = {n: self._ask(n) for n in active}
        share_w = p.site_budget_w - fixed_w
        infeasible = False
        try:
            targets = allocate(asks, max(share_w, 0.0))
        except InfeasibleFloors:
            infeasible = True
            targets = {n: a.floor_w for n, a in asks.items()}

        emergency = self._emergency(now_s)
        bases = {n: self._base(n, now_s) for n in active}
        if emergency:
            site_w = self._site_power[0] if self._site_power else 0.0
            factor = p.site_meter_threshold_w * (1 - p.emergency_margin_ratio) / site_w
            for n in active:
                targets[n] = min(targets[n], max(asks[n].floor_w, bases[n] * factor))
        raising_allowed = now_s >= self._emergency_until_s

        grants_w: dict[str, float] = {}
        for n in active:
            base = min(max(bases[n], asks[n].floor_w), asks[n].ceiling_w)
            grants_w[n] = (
                targets[n]
                if targets[n] < base - p.hysteresis_w
                else min(base, targets[n] + p.hysteresis_w)
            )
        if fixed_w + sum(grants_w.values()) > p.site_budget_w:
            grants_w = {n: min(grants_w[n], targets[n]) for n in active}
        if infeasible:
            grants_w = {}  # floors that do not fit are never granted

        def committed() -> float:
            return fixed_w + sum(max(charges[n], grants_w.get(n, 0.0)) for n in active)

        if raising_allowed and not infeasible:
            order = sorted(active, key=lambda n: (-asks[n].band, -asks[n].goodput_per_w, n))
            for n in order:
                # What the node is owed (its need up to its fair share) comes back with
                # no hysteresis or pacing: the static equal split would already give it.
                lift = min(targets[n], asks[n].owed_w) - grants_w[n]
                if lift > 0:
                    room_n = p.site_budget_w - committed() + max(0.0, charges[n] - grants_w[n])
                    grants_w[n] += max(0.0, min(lift, room_n))
                want = targets[n] - grants_w[n]
                if want <= p.hysteresis_w:
                    continue
                step = p.raise_step_w * self._rng.uniform(1 - p.raise_jitter_ratio, 1.0)
                if want - step <= p.hysteresis_w:
                    step = want  # land on the target, not a hysteresis short of it
                room = p.site_budget_w - committed()
                # Raising n costs only what lifts it above its outstanding charge.
                room_n = room + max(0.0, charges[n] - grants_w[n])
                grants_w[n] += max(0.0, min(want, step, room_n))

        grants = []
        for n in grants_w:
            ledger = self._ledgers[n]
            # Above the epoch the node reports, too (a predecessor's clock may run ahead of
            # ours, and a node refuses a grant older than the one it runs under); per node,
            # so that one node's report moves only its own epochs.
            reported = ledger.demand.grant_epoch if ledger.demand is not None else None
            ledger.epoch = max(self._epoch, ledger.epoch + 1, (reported or -1) + 1)
            grant = Grant(n, grants_w[n], ledger.epoch, now_s + p.lease_s)
            ledger.issued.append((grant.epoch, grant.budget_w, grant.expires_s))
            grants.append(grant)
        committed_w = committed()
        nodes = {
            n: NodeRound(
                state=states[n],
                charge_w=charges[n],
                target_w=targets.get(n),
                grant_w=grants_w.get(n),
                demand=self._ledgers[n].demand,
            )
            for n in self._specs
        }
        return Round(
            time_s=now_s,
            epoch=max((g.epoch for g in grants), default=self._epoch),
            grants=tuple(grants),
            nodes=nodes,
            committed_w=committed_w,
            headroom_w=p.site_budget_w - committed_w,
            emergency=emergency,
            infeasible=infeasible,
        )

    # ---- internals ---------------------------------------------------------------------

    def _prune(self, ledger: _Ledger, now_s: float) -> None:
        # Keep the newest grant even when expired: a silent node is charged it for the grace.
        acked = ledger.demand.grant_epoch if ledger.demand else None
        newest = ledger.issued[-1:] if ledger.issued else []
        kept = [g for g in ledger.issued[:-1] if g[2] > now_s and (acked is None or g[0] >= acked)]
        ledger.issued = kept + newest

    def _state(self, ledger: _Ledger, now_s: float) -> str:
        p = self._params
        if ledger.demand is None:
            return "unknown"
        if now_s - ledger.demand.received_s <= p.demand_timeout_s:
            return "active"
        expiries = [g[2] for g in ledger.issued[-1:]]
        if ledger.demand.grant_expires_s is not None:
            expiries.append(ledger.demand.grant_expires_s)
        if expiries and now_s < max(expiries) + p.grace_s:
            return "silent"
        return "released"

    def _charge(self, node: str, state: str, now_s: float) -> float:
        """What node may draw now: its live, unsuperseded grants (or its floor without any);
        a silent node also its last measured power, until its lease plus grace."""
        spec = self._specs[node]
        ledger = self._ledgers[node]
        if state == "unknown":
            # Not heard since start: it may still hold a grant from an allocator before
            # this one, for at most a lease; until then it is charged its ceiling.
            assert self._started_s is not None
            warm_s = self._params.lease_s + self._params.grace_s
            return spec.ceiling_w if now_s < self._started_s + warm_s else spec.floor_w
        if state == "released":
            return spec.floor_w
        live = [w for (_, w, expires) in ledger.issued if expires > now_s]
        demand = ledger.demand
        if demand is not None and demand.grant_w is not None:
            if demand.grant_expires_s is not None and demand.grant_expires_s > now_s:
                live.append(demand.grant_w)
        charge = max(live) if live else spec.floor_w
        if state == "silent":
            last_w = ledger.issued[-1][1] if ledger.issued else spec.floor_w
            if demand is not None and demand.grant_w is not None:
                last_w = max(last_w, demand.grant_w)
            charge = max(charge, last_w)
        # A node drawing more than its grant (not yet enforced, or a limit it cannot reach)
        # is charged what it draws: the site meter sees watts, not grants.
        charge = max(charge, ledger.last_power_w or 0.0)
        return max(charge, spec.floor_w)

    def _ask(self, node: str) -> NodeAsk:
        spec = self._specs[node]
        demand = self._ledgers[node].demand
        assert demand is not None  # active nodes have one
        # The site's floor, whatever the node reports (a reported floor at its ceiling once
        # made the floors overflow the budget and still be granted); a reported maximum
        # below the site's ceiling narrows the range.
        floor_w = spec.floor_w
        ceiling_w = max(floor_w, min(spec.ceiling_w, demand.device_max_w))
        return NodeAsk(
            band=spec.band,
            floor_w=floor_w,
            ceiling_w=ceiling_w,
            need_w=max(demand.need_w, 0.0),
            goodput_per_w=max(demand.goodput_per_w, 0.0),
            share_w=self._share_w,
        )

    def _base(self, node: str, now_s: float) -> float:
        """The grant in force: the newest live one issued here, else the live one the node
        reports (a predecessor's, after a takeover), else the floor (lease expired)."""
        ledger = self._ledgers[node]
        if ledger.issued and ledger.issued[-1][2] > now_s:
            return ledger.issued[-1][1]
        d = ledger.demand
        if d is not None and d.grant_w is not None and (d.grant_expires_s or 0.0) > now_s:
            return d.grant_w
        return self._specs[node].floor_w

    def _emergency(self, now_s: float) -> bool:
        p = self._params
        if p.site_meter_threshold_w is None or self._site_power is None:
            return False
        power_w, time_s = self._site_power
        if now_s - time_s > p.site_meter_timeout_s or power_w <= p.site_meter_threshold_w:
            return False
        self._emergency_until_s = now_s + p.emergency_hold_s
        return True
