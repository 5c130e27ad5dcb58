"""The hindsight oracle: for one scenario, the best static setting of the knobs the
controller turns (SM clock, batch caps, quantization level, decode pacing), searched
jointly by running the engine model on the scenario's own seeded arrivals, so it is
deterministic. It is the reference a controller is measured against, not a controller:
every setting it tries knows the whole trace in advance.

The rule: the least J per output token among the *admissible* settings, those whose SLO
attainment is at least the policy's percentile (99 %: p99 TTFT and TPOT within the SLOs)
and whose time over budget is at most 1 %; where none is, the one with the highest
attainment within that budget allowance (then the least J/token). The board power limit
follows the scenario's budget in every setting (the budget is an input, not a choice).

The search (`search`): a coarse grid, every level x the coarse values of each axis, each
clock column walked from the top down and left at its first clock that misses the
attainment target (a lower clock is assumed no faster: those settings are pruned); then a
pattern search from the best coarse settings, trying one step up and down each ordered
axis and every other level, moving to the best improvement, halving the steps when none
improves, until every step is one value of the fine axis.

It must not import bench; it changes no controller state.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wattserve.controller.policy import Policy
from wattserve.sim.calibration import Calibration
from wattserve.sim.engine_model import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from wattserve.sim.run import RunResult, run_scenario
from wattserve.sim.scenarios import RequestMix, Scenario
from wattserve.sim.systems import System

MAX_OVER_BUDGET_PCT = 1.0  # the project's standing bound on time over budget

# The ordered axes of a setting, in the order the search tries them.
ORDERED_AXES = (
    "sm_clock_mhz",
    "max_num_seqs",
    "max_num_batched_tokens",
    "decode_interval_ms",
    "decode_clock_mhz",
)


@dataclass(frozen=True)
class StaticSetting:
    """One value of every knob for a whole run. decode_clock_mhz: a second clock for
    decode-only steps, a mechanism of the engine model only (the ceiling study's; None:
    one clock, as the real engine has)."""

    level: str
    sm_clock_mhz: int
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    decode_interval_ms: float = 0.0
    decode_clock_mhz: int | None = None

    def is_valid(self) -> bool:
        return self.decode_clock_mhz is None or self.decode_clock_mhz < self.sm_clock_mhz

    @property
    def label(self) -> str:
        out = f"{self.level} @ {self.sm_clock_mhz} MHz"
        if self.decode_clock_mhz is not None:
            out += f", decode-only @ {self.decode_clock_mhz} MHz"
        if (self.max_num_seqs, self.max_num_batched_tokens) != (
            DEFAULT_MAX_NUM_SEQS,
            DEFAULT_MAX_NUM_BATCHED_TOKENS,
        ):
            out += f", caps {self.max_num_seqs} seqs / {self.max_num_batched_tokens} tokens"
        if self.decode_interval_ms:
            out += f", decode every >= {self.decode_interval_ms:g} ms"
        return out

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class StaticSystem(System):
    """A StaticSetting applied once before the first step; the board power limit follows
    the budget. Nothing is decided while it runs."""

    name = "static"

    def __init__(self, engine, device, clock, budget_w: float, setting: StaticSetting) -> None:
        super().__init__(engine, device, clock)
        self.setting = setting
        engine.set_quant_level(setting.level)
        device.lock_sm_clocks_mhz(setting.sm_clock_mhz, setting.sm_clock_mhz)
        if setting.decode_clock_mhz is not None:
            engine.phase_clocks_mhz = (setting.sm_clock_mhz, setting.decode_clock_mhz)
        engine.set_limits(
            max_num_seqs=setting.max_num_seqs,
            max_num_batched_tokens=setting.max_num_batched_tokens,
            decode_interval_ms=setting.decode_interval_ms,
        )
        self.set_budget_w(budget_w)

    def set_budget_w(self, budget_w: float) -> None:
        self.device.set_power_limit_w(budget_w)


@dataclass(frozen=True)
class Axis:
    """The values one ordered knob may take (ascending) and the few the coarse grid tries."""

    fine: tuple
    coarse: tuple

    def __post_init__(self) -> None:
        if not self.fine or not set(self.coarse) <= set(self.fine):
            raise ValueError(f"Axis: coarse {self.coarse} must be a subset of fine {self.fine}")

    @classmethod
    def of(cls, fine, coarse=None) -> Axis:
        fine = tuple(sorted(set(fine), key=_order))
        return cls(fine, fine if coarse is None else tuple(sorted(set(coarse), key=_order)))

    def first_step(self) -> int:
        """The pattern search's first step, in fine values: half the coarse spacing."""
        if len(self.coarse) < 2:
            return max(1, len(self.fine) // 4)
        idx = [self.fine.index(v) for v in self.coarse]
        return max(1, round((idx[-1] - idx[0]) / (len(idx) - 1) / 2))


def _order(v) -> float:
    # None (one clock, no split) sorts above every split clock.
    return math.inf if v is None else float(v)


@dataclass(frozen=True)
class SearchSpace:
    levels: tuple[str, ...]
    axes: dict[str, Axis]  # every name in ORDERED_AXES


def default_space(
    levels: tuple[str, ...],
    ladder_mhz: tuple[int, ...],
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    block_size_tokens: int = 16,
    decode_interval_max_ms: float = 1000.0,
) -> SearchSpace:
    """The controller's own knob ranges (caps up to the engine's, pacing up to the
    controller's maximum, the device's clock ladder). Fine: every ladder clock (15 MHz on
    the virtual H200), caps in eighths of the engine's (token budget in block multiples),
    pacing in 25 ms steps. Coarse: clocks every 150 MHz from the bottom to 945 MHz, then
    every 300 MHz and the top; pacing 0 / 150 / 300 ms; the engine's caps."""
    coarse_clocks = [c for c in ladder_mhz if c <= 945 and (c - ladder_mhz[0]) % 150 == 0]
    coarse_clocks += [c for c in ladder_mhz if c > 945 and (c - 945) % 300 == 0]
    coarse_clocks.append(ladder_mhz[-1])
    seqs = sorted({max(1, max_num_seqs * k // 8) for k in range(1, 9)})
    tok_step = max(
        block_size_tokens, max_num_batched_tokens // 16 // block_size_tokens * block_size_tokens
    )
    tokens = {*range(tok_step, max_num_batched_tokens + 1, tok_step), max_num_batched_tokens}
    intervals = [25.0 * k for k in range(int(decode_interval_max_ms // 25) + 1)]
    return SearchSpace(
        levels=tuple(levels),
        axes={
            "sm_clock_mhz": Axis.of(ladder_mhz, coarse_clocks),
            "max_num_seqs": Axis.of(seqs, (max_num_seqs,)),
            "max_num_batched_tokens": Axis.of(tokens, (max_num_batched_tokens,)),
            "decode_interval_ms": Axis.of(
                intervals, [i for i in (0.0, 150.0, 300.0) if i in intervals]
            ),
            "decode_clock_mhz": Axis.of((None,)),
        },
    )


def rank_key(
    summary: dict, target_pct: float, max_over_budget_pct: float = MAX_OVER_BUDGET_PCT
) -> tuple:
    """Sort key of one run's summary under the oracle's rule (smaller is better)."""
    attainment = summary.get("attainment_pct") or 0.0
    over = summary.get("over_budget_pct") or 0.0
    j = summary.get("j_per_token") or math.inf
    within = over <= max_over_budget_pct
    if within and attainment >= target_pct:
        return (0, 0, 0.0, j)
    return (1, 0 if within else 1, -attainment, j)


@dataclass
class OracleResult:
    setting: StaticSetting
    summary: dict
    admissible: bool
    evaluated: int  # distinct settings run
    target_pct: float

    def as_dict(self) -> dict:
        return {
            "setting": self.setting.as_dict(),
            "label": self.setting.label,
            "j_per_token": self.summary.get("j_per_token"),
            "attainment_pct": self.summary.get("attainment_pct"),
            "over_budget_pct": self.summary.get("over_budget_pct"),
            "p99_ttft_ms": self.summary.get("p99_ttft_ms"),
            "p99_tpot_ms": self.summary.get("p99_tpot_ms"),
            "admissible": self.admissible,
            "settings_evaluated": self.evaluated,
            "rule": f"least J/token with attainment >= {self.target_pct:g} % and <= "
            f"{MAX_OVER_BUDGET_PCT:g} % of the time over budget",
        }


def search(
    evaluate: Callable[[StaticSetting], dict],
    space: SearchSpace,
    target_pct: float,
    starts: int = 2,
    max_evals: int = 400,
    memo: dict[StaticSetting, dict] | None = None,
    seeds: tuple[StaticSetting, ...] = (),
) -> OracleResult:
    """The best setting of `space` under the oracle's rule; `evaluate` runs one setting
    and returns its summary (attainment_pct, j_per_token, over_budget_pct). Each setting
    is evaluated at most once, at most `max_evals` in this search; `memo` (setting ->
    summary) carries runs over from other searches of the same scenario; `seeds` are
    settings of the space run with the coarse grid (e.g. the best of a narrower search, so
    the result is at least as good)."""
    memo = {} if memo is None else memo
    seen: set[StaticSetting] = set()

    def key(s: StaticSetting):
        if s not in memo:
            memo[s] = evaluate(s)
        seen.add(s)
        return (*rank_key(memo[s], target_pct), _tiebreak(s))

    def exhausted() -> bool:
        return len(seen) >= max_evals

    axes = space.axes
    others = [a for a in ORDERED_AXES if a != "sm_clock_mhz"]
    # Coarse: each level x the coarse values of the other axes, clocks from the top down.
    for level in space.levels:
        for combo in itertools.product(*(axes[a].coarse for a in others)):
            values = dict(zip(others, combo, strict=True))
            for mhz in reversed(axes["sm_clock_mhz"].coarse):
                s = StaticSetting(level, mhz, **values)
                if not s.is_valid():
                    continue
                if exhausted():
                    break
                key(s)
                if (memo[s].get("attainment_pct") or 0.0) < target_pct:
                    break  # lower clocks are no faster: pruned
    for s in seeds:
        key(s)
    ranked = sorted(seen, key=key)
    for s in ranked[:starts]:
        _pattern_search(s, key, space, exhausted)
    best = min(seen, key=key)
    return OracleResult(best, memo[best], key(best)[0] == 0, len(seen), target_pct)


def _pattern_search(start: StaticSetting, key, space: SearchSpace, exhausted) -> StaticSetting:
    steps = {a: space.axes[a].first_step() for a in ORDERED_AXES if len(space.axes[a].fine) > 1}
    cur = start
    while not exhausted():
        cands = []
        for level in space.levels:
            if level != cur.level:
                cands.append(dataclasses.replace(cur, level=level))
        for a, step in steps.items():
            fine = space.axes[a].fine
            i = fine.index(getattr(cur, a))
            for j in (i - step, i + step):
                if 0 <= j < len(fine):
                    cands.append(dataclasses.replace(cur, **{a: fine[j]}))
        cands = [c for c in cands if c.is_valid()]
        best = None
        for c in cands:
            if exhausted():
                break
            if best is None or key(c) < key(best):
                best = c
        if best is not None and key(best) < key(cur):
            cur = best
            continue
        if all(s == 1 for s in steps.values()):
            break
        steps = {a: max(1, s // 2) for a, s in steps.items()}
    return cur


def _tiebreak(s: StaticSetting) -> tuple:
    # Equal figures: the simpler, faster setting (higher clock, bigger caps, less pacing).
    return (
        -s.sm_clock_mhz,
        -s.max_num_seqs,
        -s.max_num_batched_tokens,
        s.decode_interval_ms,
        _order(s.decode_clock_mhz) * -1,
        s.level,
    )


def run_static(
    scenario: Scenario,
    setting: StaticSetting,
    cal: Calibration,
    capacity_req_s: float,
    mix: RequestMix,
    policy: Policy,
    start_level: str,
    drain_s: float = 60.0,
    device_calibration: Path | None = None,
) -> RunResult:
    """One scenario with one static setting on the engine model, in simulated time."""

    def make(engine, device, clock, run_policy: Policy) -> System:
        return StaticSystem(engine, device, clock, run_policy.power_budget_w, setting)

    return run_scenario(
        scenario, make, cal, capacity_req_s, mix, policy, start_level, drain_s, device_calibration
    )


def scenario_evaluator(
    scenario: Scenario,
    cal: Calibration,
    capacity_req_s: float,
    mix: RequestMix,
    policy: Policy,
    start_level: str,
    on_eval: Callable[[StaticSetting, dict], None] | None = None,
    device_calibration: Path | None = None,
) -> Callable[[StaticSetting], dict]:
    """`search`'s evaluate for one scenario: a run on the engine model, summarized."""
    from wattserve.sim.metrics import summarize

    def evaluate(s: StaticSetting) -> dict:
        res = run_static(
            scenario, s, cal, capacity_req_s, mix, policy, start_level,
            device_calibration=device_calibration,
        )
        out = summarize(res, policy, scenario)
        if on_eval is not None:
            on_eval(s, out)
        return out

    return evaluate


def find_oracle(
    scenario: Scenario,
    cal: Calibration,
    capacity_req_s: float,
    mix: RequestMix,
    policy: Policy,
    start_level: str,
    space: SearchSpace,
    starts: int = 2,
    max_evals: int = 400,
    on_eval: Callable[[StaticSetting, dict], None] | None = None,
    device_calibration: Path | None = None,
) -> tuple[OracleResult, RunResult]:
    """The oracle of one scenario (see the module's rule) and its run (for plots)."""
    evaluate = scenario_evaluator(
        scenario, cal, capacity_req_s, mix, policy, start_level, on_eval, device_calibration
    )
    found = search(evaluate, space, policy.slo_percentile, starts, max_evals)
    # The runs are deterministic: the best one again, rather than every run kept.
    res = run_static(
        scenario, found.setting, cal, capacity_req_s, mix, policy, start_level,
        device_calibration=device_calibration,
    )
    return found, res
