"""The plots of `bench control`: per scenario a timeline of power, clock, batch caps and
latency for every system; across scenarios J/token and SLO attainment. Reads RunResults
and summaries; writes PNG files, nothing else.
"""

from __future__ import annotations

import math
from pathlib import Path

from wattserve.controller.models import percentile_of
from wattserve.controller.policy import Policy
from wattserve.sim.run import RunResult


def plot_scenario(results: list[RunResult], policy: Policy, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    colors = {
        "controller": "tab:green",
        "controller_fixed_quant": "tab:olive",
        "controller_unpaced": "tab:cyan",
        "max_clock": "tab:red",
        "static_cap": "tab:orange",
        "pid_power": "tab:purple",
        "best_static": "tab:gray",
    }
    for res in results:
        c = colors.get(res.system, None)
        lw = 1.6 if res.system == "controller" else 0.9
        ts, ps = _smooth([s.t_s for s in res.samples], [s.power_w for s in res.samples], 1.0)
        axes[0].plot(ts, ps, color=c, lw=lw, label=res.system)
        win = 10.0
        grid = [res.duration_s * i / 200 for i in range(201)]
        ttft, tpot = [], []
        for g in grid:
            rows = [r for r in res.requests if g - win < r[0] <= g and r[1] is not None]
            ttft.append(1000 * percentile_of([r[1] for r in rows], 99) if rows else math.nan)
            tp = [r[2] for r in rows if r[2] is not None]
            tpot.append(1000 * percentile_of(tp, 99) if tp else math.nan)
        axes[1].plot(grid, ttft, color=c, lw=lw)
        axes[2].plot(grid, tpot, color=c, lw=lw)
    ctl = next((r for r in results if r.system == "controller"), results[0])
    axes[0].plot(
        [s.t_s for s in ctl.samples],
        [s.budget_w for s in ctl.samples],
        "k--",
        lw=1.2,
        label="budget",
    )
    axes[0].set_ylabel("power W (1 s mean)")
    axes[0].legend(loc="upper right", fontsize=8, ncol=3)
    axes[1].axhline(policy.ttft_slo_ms, color="k", ls="--", lw=1)
    axes[1].set_ylabel("p99 TTFT ms (10 s, by arrival)")
    axes[1].set_yscale("log")
    axes[2].axhline(policy.tpot_slo_ms, color="k", ls="--", lw=1)
    axes[2].set_ylabel("p99 TPOT ms (10 s, by arrival)")
    axes[2].set_yscale("log")
    ax = axes[3]
    clocks = [(s.t_s, s.knobs.get("sm_clock_mhz")) for s in ctl.samples if s.knobs]
    ax.plot(
        [t for t, _ in clocks],
        [f or math.nan for _, f in clocks],
        color="tab:green",
        lw=1.2,
        label="SM clock lock MHz (controller)",
    )
    ax.plot(
        [s.t_s for s in ctl.samples],
        [s.sm_clock_mhz for s in ctl.samples],
        color="tab:green",
        lw=0.5,
        alpha=0.4,
        label="SM clock actual MHz",
    )
    ax.set_ylabel("MHz")
    ax2 = ax.twinx()
    seqs = [(s.t_s, s.knobs.get("max_num_seqs")) for s in ctl.samples if s.knobs]
    ax2.step(
        [t for t, _ in seqs],
        [v or math.nan for _, v in seqs],
        color="tab:blue",
        lw=1,
        where="post",
        label="max_num_seqs",
    )
    paced = [(s.t_s, s.knobs.get("decode_interval_ms")) for s in ctl.samples if s.knobs]
    if any(v for _, v in paced):
        ax2.step(
            [t for t, _ in paced],
            [(v or 0.0) / 5.0 for _, v in paced],
            color="tab:pink",
            lw=1,
            where="post",
            label="decode interval ms / 5",
        )
    levels = sorted({s.knobs.get("quant_level") for s in ctl.samples if s.knobs.get("quant_level")})
    if len(levels) > 1 or levels:
        q = [(s.t_s, s.knobs.get("quant_level")) for s in ctl.samples if s.knobs.get("quant_level")]
        y = [8 * (1 + levels.index(lv)) for _, lv in q]
        ax2.step(
            [t for t, _ in q],
            y,
            color="tab:brown",
            lw=1,
            where="post",
            label="quant level: " + ", ".join(f"{8 * (1 + i)}={lv}" for i, lv in enumerate(levels)),
        )
    ax2.set_ylabel("max_num_seqs / quant level / interval")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    axes[3].set_xlabel("time s")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _smooth(ts: list[float], ys: list[float], window_s: float) -> tuple[list[float], list[float]]:
    out_t, out_y = [], []
    acc_t, acc_e, start = 0.0, 0.0, None
    prev = 0.0
    for t, y in zip(ts, ys, strict=True):
        span = t - prev
        prev = t
        if start is None:
            start = t - span
        acc_t += span
        acc_e += y * span
        if t - start >= window_s:
            out_t.append(t)
            out_y.append(acc_e / acc_t)
            acc_t, acc_e, start = 0.0, 0.0, None
    return out_t, out_y


def plot_summary(table: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(table)
    systems = list(next(iter(table.values())))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(systems)
    for k, sys_name in enumerate(systems):
        xs = [i + k * width for i in range(len(scenarios))]
        axes[0].bar(
            xs, [table[s][sys_name]["j_per_token"] or 0 for s in scenarios], width, label=sys_name
        )
        axes[1].bar(
            xs,
            [table[s][sys_name]["attainment_pct"] or 0 for s in scenarios],
            width,
            label=sys_name,
        )
    for ax, label in ((axes[0], "J per output token"), (axes[1], "SLO attainment %")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scenarios))], scenarios, rotation=20)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[1].set_ylim(0, 105)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
