"""The engine-model runner (wattserve.sim.run) with a recording system: when a system hears of
a budget change and when it may act on it. Made-up calibration, simulated seconds; no
torch steps, no controller."""

from __future__ import annotations

import pytest

from wattserve.controller.policy import Policy
from wattserve.sim.calibration import Calibration, LevelFit
from wattserve.sim.run import run_scenario
from wattserve.sim.scenarios import RequestMix, Scenario
from wattserve.sim.systems import System

STEP_S = 1.13  # off the 0.25 s tick grid and off the runner's 0.1 s idle advances


def _calibration() -> Calibration:
    fit = LevelFit(
        base_s=0.01,
        per_prefill_token_s=0.0002,
        per_decode_token_s=0.001,
        per_context_token_s=2e-6,
        noise_cv=0.1,
        weight_bytes=538_000_000,
        prepare_s=1.0,
        samples=100,
        ppl_increase_pct=0.0,
    )
    shape = {
        "num_layers": 30,
        "hidden_size": 576,
        "num_heads": 9,
        "num_kv_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
    }
    return Calibration(
        "made-up", "float32", 2, "fp32", shape, 46080, 16, {"fp32": fit}, measured_at="test"
    )


class Recording(System):
    """Records (what, simulated time): budget changes, ticks and engine steps."""

    name = "recording"

    def __init__(self, engine, device, clock) -> None:
        super().__init__(engine, device, clock)
        self.events: list[tuple[str, float]] = []

    def on_step(self, stats) -> None:
        self.events.append(("step", stats.started_at_s))

    def set_budget_w(self, budget_w: float) -> None:
        self.events.append(("budget", self.clock()))

    def tick(self) -> dict:
        self.events.append(("tick", self.clock()))
        return {}


def _run(load: float) -> list[tuple[str, float]]:
    scenario = Scenario(
        "cut",
        4.0,
        lambda t: load,
        lambda t: 180.0 if t >= STEP_S else 300.0,
        seed=1,
        budget_steps_s=(STEP_S,),
    )
    systems: list[Recording] = []

    def make(engine, device, clock, policy) -> System:
        systems.append(Recording(engine, device, clock))
        return systems[0]

    policy = Policy(300.0, 2000.0, 400.0)
    run_scenario(scenario, make, _calibration(), 4.0, RequestMix(), policy, "fp32", drain_s=1.0)
    return systems[0].events


@pytest.mark.parametrize("load", [0.0, 0.6])
def test_a_budget_change_is_decided_on_before_the_engine_steps_again(load):
    events = _run(load)
    i = next(k for k, (what, _) in enumerate(events) if what == "budget")
    # As the daemon's loop wakes on a policy change: a tick at the same moment, before any
    # step at knobs chosen for the old budget (the next periodic tick is up to 0.25 s on,
    # and a long prefill step begun meanwhile runs wholly at the old clock).
    assert events[i + 1] == ("tick", events[i][1])
    if load:
        assert any(what == "step" for what, _ in events[:i])
    else:
        # An idle engine: the runner wakes at the step itself, not at its next 0.1 s advance.
        assert events[i][1] == pytest.approx(STEP_S, abs=1e-6)
