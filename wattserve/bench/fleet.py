"""`wattserve bench fleet`: one site budget over 8, 16 and 64 simulated nodes.

Simulated time (1 s steps over one compressed day, `--day-s`), no daemon, no broker: each
node is a curve model, not the engine model of wattserve/bench/control.py (too heavy for 64 nodes x
a day, and being split): tokens/s capacity at a power cap p is
C(p) = C_max * ((p - P_idle) / (P_max - P_idle)) ** alpha (concave, as DVFS is), and the
node's controller draws the least power that serves what it can. A request stream meets
its SLOs while utilisation stays under 90 % of C(p); goodput is min(load, 0.9 C(p)),
attainment goodput / load. Three GPU classes (H200-, A100- and L40S-like curves) with
shifted diurnal loads (each node its own phase and peak, some hot, some cool; phases spread
over --phase-spread of a day) and random bursts, all scaled by --load-scale; one site
budget at --budget-ratio (default 0.6) of the nodes' summed maxima.

Compared in the same run on the same loads: a static equal split, static caps by rated
power (Dynamo-planner style), no budget at all (`uncapped`, the ceiling of any allocation),
the per-step optimum of the budget in hindsight (`hindsight`: true loads and curves, no
bands, no lag, no fairness; the best any allocator could do), and the allocator
(wattserve.fleet.allocator, the production code, fed each period with demands by the formula of
wattserve.fleet.node.node_demand, the SLO pressure modelled as load over 90 % of capacity;
grants apply at the next step). Reported per strategy: goodput, SLO attainment (site and
per class), J per goodput token, seconds the site drew over the budget (and the limits in
force summed over it), grant churn; allocation CPU time per round. The last line printed is
one JSON object for the largest scenario.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from wattserve.fleet.allocator import Allocator, AllocatorParams, Demand, NodeSpec

SLO_UTILISATION = 0.9
NEED_MARGIN_RATIO = 0.1  # fleet.need_margin_ratio's default
PRESSURE_MIN, PRESSURE_MAX, QUEUE_PRESSURE = 0.5, 2.0, 1.25  # as wattserve/fleet/node.py
_HINDSIGHT_BISECT_STEPS = 60
STRATEGIES = ("equal_split", "rated_caps", "allocator", "hindsight", "uncapped")


@dataclass(frozen=True)
class GpuClass:
    name: str
    idle_w: float
    max_w: float
    capacity_tok_s: float  # at max_w
    alpha: float  # curvature of capacity in power above idle


CLASSES = (
    GpuClass("h200", idle_w=100.0, max_w=700.0, capacity_tok_s=3000.0, alpha=0.5),
    GpuClass("a100", idle_w=60.0, max_w=400.0, capacity_tok_s=1200.0, alpha=0.6),
    GpuClass("l40s", idle_w=40.0, max_w=350.0, capacity_tok_s=700.0, alpha=0.7),
)


@dataclass
class Fleet:
    """Per-node arrays (numpy, length n)."""

    cls: list[str]
    idle_w: np.ndarray
    max_w: np.ndarray
    cap_tok_s: np.ndarray
    alpha: np.ndarray
    floor_w: np.ndarray
    band: np.ndarray

    def capacity(self, cap_w: np.ndarray) -> np.ndarray:
        frac = np.clip((cap_w - self.idle_w) / (self.max_w - self.idle_w), 0.0, 1.0)
        return self.cap_tok_s * frac**self.alpha

    def power_for(self, served: np.ndarray) -> np.ndarray:
        frac = np.clip(served / self.cap_tok_s, 0.0, 1.0)
        return self.idle_w + (self.max_w - self.idle_w) * frac ** (1.0 / self.alpha)

    def hindsight_caps(self, load: np.ndarray, budget_w: float) -> np.ndarray:
        """The caps that maximise this step's goodput within budget_w, knowing the loads and
        the curves: water-filling on the true marginal goodput per watt."""
        span_w = self.max_w - self.idle_w
        # Past the power at which 0.9 C(p) covers the load a watt buys nothing.
        served_frac = np.clip(load / (SLO_UTILISATION * self.cap_tok_s), 0.0, 1.0)
        enough_w = np.clip(
            self.idle_w + span_w * served_frac ** (1.0 / self.alpha), self.floor_w, self.max_w
        )
        # d(0.9 C)/dp = slope * frac ** (alpha - 1), falling in p (alpha < 1).
        slope = SLO_UTILISATION * self.alpha * self.cap_tok_s / span_w

        def caps_at(level: float) -> np.ndarray:
            frac = (level / slope) ** (1.0 / (self.alpha - 1.0)) if level > 0 else 1.0
            return np.clip(self.idle_w + span_w * np.clip(frac, 0.0, 1.0), self.floor_w, enough_w)

        if caps_at(0.0).sum() <= budget_w:
            return caps_at(0.0)
        low, high = 0.0, float(slope.max()) * 1e6
        for _ in range(_HINDSIGHT_BISECT_STEPS):
            mid = (low + high) / 2
            low, high = (mid, high) if caps_at(mid).sum() > budget_w else (low, mid)
        return caps_at(high)


def make_fleet(n: int, rng: random.Random) -> Fleet:
    classes = [CLASSES[i % len(CLASSES)] for i in range(n)]
    return Fleet(
        cls=[c.name for c in classes],
        idle_w=np.array([c.idle_w for c in classes]),
        max_w=np.array([c.max_w for c in classes]),
        cap_tok_s=np.array([c.capacity_tok_s for c in classes]),
        alpha=np.array([c.alpha for c in classes]),
        floor_w=np.array([c.idle_w + 0.15 * (c.max_w - c.idle_w) for c in classes]),
        band=np.array([1 if i % 4 == 0 else 0 for i in range(n)]),
    )


def make_loads(
    fleet: Fleet, steps: int, day_s: float, rng: random.Random, phase_spread: float = 1.0
) -> np.ndarray:
    """Offered tokens/s, shape (steps, n): shifted diurnal curves plus bursts; the nodes'
    phases spread over phase_spread of a day (0: every node peaks at once)."""
    n = len(fleet.cls)
    t = np.arange(steps, dtype=float)[:, None]
    phase = np.array([rng.random() * phase_spread for _ in range(n)])
    # Heterogeneous peaks: a few nodes run hot at their peak, most well below it.
    peak = np.array([rng.choice((1.2, 0.9, 0.6, 0.4, 0.3)) for _ in range(n)]) * fleet.cap_tok_s
    trough = 0.15
    diurnal = trough + (1 - trough) * 0.5 * (1 - np.cos(2 * math.pi * (t / day_s + phase)))
    load = peak * diurnal
    bursts = np.ones((steps, n))
    for j in range(n):
        at = 0
        while True:
            at += int(rng.expovariate(1 / (day_s / 6)))
            if at >= steps:
                break
            length = rng.randint(60, 300)
            bursts[at : at + length, j] *= rng.uniform(1.5, 2.5)
    return load * bursts


@dataclass
class Outcome:
    goodput_tok: float
    offered_tok: float
    energy_j: float
    over_budget_s: int
    caps_over_budget_s: int
    class_goodput: dict[str, float]
    class_offered: dict[str, float]
    grant_changes: int
    alloc_cpu_ms: list[float]
    site_draw_w: list[float] = field(default_factory=list)  # per step
    site_goodput_tok_s: list[float] = field(default_factory=list)  # per step

    def summary(self, n: int, hours: float) -> dict:
        return {
            "goodput_tok_s": round(self.goodput_tok / (hours * 3600), 1),
            "attainment_pct": round(100 * self.goodput_tok / self.offered_tok, 2),
            "class_attainment_pct": {
                c: round(100 * self.class_goodput[c] / self.class_offered[c], 2)
                for c in sorted(self.class_offered)
            },
            "j_per_goodput_token": round(self.energy_j / self.goodput_tok, 4),
            "site_over_budget_s": self.over_budget_s,
            "caps_over_budget_s": self.caps_over_budget_s,
            "grant_changes_per_node_hour": round(self.grant_changes / n / hours, 2),
        }


def simulate(
    fleet: Fleet,
    loads: np.ndarray,
    budget_w: float,
    strategy: str,
    period_s: int,
    seed: int,
) -> Outcome:
    steps, n = loads.shape
    ids = [f"n{j}" for j in range(n)]
    if strategy == "equal_split":
        caps = np.clip(np.full(n, budget_w / n), fleet.floor_w, fleet.max_w)
    elif strategy == "uncapped":  # the ceiling: no site budget at all (a reference)
        caps = fleet.max_w.copy()
    elif strategy == "rated_caps":
        caps = np.clip(budget_w * fleet.max_w / fleet.max_w.sum(), fleet.floor_w, fleet.max_w)
    else:
        caps = fleet.floor_w.copy()  # every node starts at its safe floor
    alloc = None
    if strategy == "allocator":
        specs = [
            NodeSpec(ids[j], float(fleet.floor_w[j]), float(fleet.max_w[j]), int(fleet.band[j]))
            for j in range(n)
        ]
        params = AllocatorParams(
            site_budget_w=budget_w,
            period_s=float(period_s),
            lease_s=5.0 * period_s,
            grace_s=2.0 * period_s,
            demand_timeout_s=3.0 * period_s,
        )
        alloc = Allocator(specs, params, random.Random(seed))
    grants: list[tuple[int, float, float] | None] = [None] * n  # epoch, W, expires
    out = Outcome(0.0, 0.0, 0.0, 0, 0, {}, {}, 0, [])
    classes = np.array(fleet.cls)
    for c in set(fleet.cls):
        out.class_goodput[c] = out.class_offered[c] = 0.0
    draw = fleet.idle_w.copy()
    served = np.zeros(n)
    load = loads[0]
    t0 = 1_767_000_000.0
    for step in range(steps):
        now_s = t0 + step
        if alloc is not None and step % period_s == 0:
            capacity = fleet.capacity(caps)
            pressure = np.where(
                capacity > 0, load / (SLO_UTILISATION * np.maximum(capacity, 1e-9)), PRESSURE_MAX
            )
            pressure = np.where(load > capacity, np.maximum(pressure, QUEUE_PRESSURE), pressure)
            pressure = np.clip(pressure, PRESSURE_MIN, PRESSURE_MAX)
            need = np.clip(draw * pressure * (1 + NEED_MARGIN_RATIO), fleet.floor_w, fleet.max_w)
            good = np.minimum(served, SLO_UTILISATION * capacity)
            per_w = good / draw
            for j in range(n):
                g = grants[j]
                live = g is not None and g[2] > now_s
                alloc.observe_demand(
                    ids[j],
                    Demand(
                        need_w=float(need[j]),
                        goodput_per_w=float(per_w[j]),
                        device_min_w=float(fleet.floor_w[j]),
                        device_max_w=float(fleet.max_w[j]),
                        power_w=float(draw[j]),
                        grant_epoch=g[0] if live else None,
                        received_s=now_s,
                        grant_w=g[1] if live else None,
                        grant_expires_s=g[2] if live else None,
                    ),
                )
            cpu0 = time.process_time()
            result = alloc.round(now_s)
            out.alloc_cpu_ms.append((time.process_time() - cpu0) * 1000)
            for g in result.grants:
                j = int(g.node_id[1:])
                if abs(g.budget_w - caps[j]) > 1.0:
                    out.grant_changes += 1
                grants[j] = (g.epoch, g.budget_w, g.expires_s)
                caps[j] = g.budget_w
        if alloc is not None:
            for j in range(n):  # a lease that ran out: the safe floor
                g = grants[j]
                if g is not None and g[2] <= now_s:
                    caps[j], grants[j] = fleet.floor_w[j], None
        load = loads[step]
        if strategy == "hindsight":
            caps = fleet.hindsight_caps(load, budget_w)
        capacity = fleet.capacity(caps)
        served = np.minimum(load, capacity)
        draw = np.minimum(fleet.power_for(served), caps)
        good = np.minimum(load, SLO_UTILISATION * capacity)
        out.site_draw_w.append(float(draw.sum()))
        out.site_goodput_tok_s.append(float(good.sum()))
        out.goodput_tok += float(good.sum())
        out.offered_tok += float(load.sum())
        out.energy_j += float(draw.sum())
        if draw.sum() > budget_w + 1e-6:
            out.over_budget_s += 1
        if caps.sum() > budget_w + 1e-6:
            out.caps_over_budget_s += 1
        for c in out.class_goodput:
            mask = classes == c
            out.class_goodput[c] += float(good[mask].sum())
            out.class_offered[c] += float(load[mask].sum())
    return out


def run_scenario(n: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed + n)
    fleet = make_fleet(n, rng)
    steps = int(args.day_s * args.days)
    loads = make_loads(fleet, steps, args.day_s, rng, args.phase_spread) * args.load_scale
    budget_w = args.budget_ratio * float(fleet.max_w.sum())
    hours = steps / 3600
    results = {}
    cpu_ms: list[float] = []
    traces = {}
    for strategy in STRATEGIES:
        o = simulate(fleet, loads, budget_w, strategy, args.period_s, args.seed)
        results[strategy] = o.summary(n, hours)
        cpu_ms += o.alloc_cpu_ms
        traces[strategy] = (o.site_draw_w, o.site_goodput_tok_s)
    if args.plot is not None and n == max(args.nodes):
        plot(args.plot, n, budget_w, traces)
    eq, al = results["equal_split"], results["allocator"]
    cpu_sorted = sorted(cpu_ms)
    class_margin_pp = {
        c: round(al["class_attainment_pct"][c] - eq["class_attainment_pct"][c], 2)
        for c in sorted(eq["class_attainment_pct"])
    }

    def gain_pct(strategy: str) -> float:
        return round(100 * (results[strategy]["goodput_tok_s"] / eq["goodput_tok_s"] - 1), 2)

    return {
        "nodes": n,
        "site_budget_w": round(budget_w, 1),
        "budget_ratio": args.budget_ratio,
        "load_scale": args.load_scale,
        "phase_spread": args.phase_spread,
        "uncapped_over_budget_s": results["uncapped"]["site_over_budget_s"],
        "simulated_s": steps,
        "period_s": args.period_s,
        "strategies": results,
        "goodput_gain_vs_equal_split_pct": gain_pct("allocator"),
        # What no allocation can pass: every node at its maximum, and the budget's optimum.
        "uncapped_gain_vs_equal_split_pct": gain_pct("uncapped"),
        "hindsight_gain_vs_equal_split_pct": gain_pct("hindsight"),
        "goodput_gain_vs_rated_caps_pct": round(
            100 * (al["goodput_tok_s"] / results["rated_caps"]["goodput_tok_s"] - 1), 2
        ),
        "share_of_uncapped_goodput_pct": round(
            100 * al["goodput_tok_s"] / results["uncapped"]["goodput_tok_s"], 2
        ),
        "share_of_hindsight_goodput_pct": round(
            100 * al["goodput_tok_s"] / results["hindsight"]["goodput_tok_s"], 2
        ),
        "attainment_pct": al["attainment_pct"],
        "equal_split_attainment_pct": eq["attainment_pct"],
        "class_attainment_vs_equal_split_pp": class_margin_pp,
        "class_attainment_ge_equal_split": all(v >= 0 for v in class_margin_pp.values()),
        "site_over_budget_s": al["site_over_budget_s"],
        "allocation_cpu_ms_p50": round(statistics.median(cpu_sorted), 3),
        "allocation_cpu_ms_p99": round(cpu_sorted[int(0.99 * (len(cpu_sorted) - 1))], 3),
        "model": "curve",
    }


def plot(path: str, n: int, budget_w: float, traces: dict) -> None:
    """Site power against the budget and site goodput, one-minute means, per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for strategy, (draw, good) in traces.items():
        minutes = len(draw) // 60
        t = np.arange(minutes)
        top.plot(t, np.array(draw[: minutes * 60]).reshape(minutes, 60).mean(1), label=strategy)
        bottom.plot(t, np.array(good[: minutes * 60]).reshape(minutes, 60).mean(1), label=strategy)
    top.axhline(budget_w, color="k", linestyle="--", label="site budget")
    top.set_ylabel("site power, W")
    bottom.set_ylabel("goodput, tok/s")
    bottom.set_xlabel("simulated minutes")
    top.set_title(f"wattserve bench fleet: {n} nodes, one-minute means")
    top.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench fleet", description=__doc__)
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--budget-ratio", type=float, default=0.6, help="of the summed maxima")
    ap.add_argument("--load-scale", type=float, default=1.0, help="every node's load x this")
    ap.add_argument(
        "--phase-spread", type=float, default=1.0, help="of a day; 0: all nodes peak at once"
    )
    ap.add_argument("--day-s", type=float, default=7200.0, help="one compressed day")
    ap.add_argument("--days", type=float, default=1.0)
    ap.add_argument("--period-s", type=int, default=2, choices=[1, 2, 3, 4, 5])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="PNG of the largest scenario over time")
    args = ap.parse_args(argv)
    if not 0.0 < args.budget_ratio <= 1.0:
        ap.error("--budget-ratio must be within (0, 1]")
    last = None
    for n in sorted(args.nodes):
        last = run_scenario(n, args)
        s = last["strategies"]
        eq, rc, al = s["equal_split"], s["rated_caps"], s["allocator"]
        print(
            f"{n} nodes, budget {last['site_budget_w']:.0f} W: goodput tok/s equal "
            f"{eq['goodput_tok_s']:.0f}, rated {rc['goodput_tok_s']:.0f}, allocator "
            f"{al['goodput_tok_s']:.0f} ({last['goodput_gain_vs_equal_split_pct']:+.1f}% vs "
            f"equal; hindsight {last['hindsight_gain_vs_equal_split_pct']:+.1f}%, uncapped "
            f"{last['uncapped_gain_vs_equal_split_pct']:+.1f}%); attainment "
            f"{eq['attainment_pct']:.1f} / {rc['attainment_pct']:.1f} / "
            f"{al['attainment_pct']:.1f} %; every class >= equal split: "
            f"{last['class_attainment_ge_equal_split']}; over budget "
            f"{last['site_over_budget_s']} s; "
            f"round p99 {last['allocation_cpu_ms_p99']:.2f} ms CPU",
            flush=True,
        )
        print(json.dumps(last), flush=True)
    print(json.dumps(last))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
