"""The live feed without a server: snapshots, windows per consumer, events, subscriptions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from wattserve.controller.controller import ControllerState, Decision, Reason
from wattserve.controller.policy import ControlMode, Knobs
from wattserve.daemon.api.state import ServingState
from wattserve.daemon.config import load_config
from wattserve.daemon.device.protocol import Telemetry
from wattserve.daemon.feed import FeedItem, LiveFeed, Subscription
from wattserve.daemon.mqtt.payloads import EventPayload, TelemetryPayload


@dataclass
class _Counters:
    generation_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class _Engine:
    counters: _Counters = field(default_factory=_Counters)
    quant_level: str = "fp32"
    num_running: int = 2
    num_waiting: int = 1
    kv: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(usage=0.25))
    limits: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(
            max_num_seqs=8, max_num_batched_tokens=256, decode_interval_ms=0.0
        )
    )


class _Sampler:
    def __init__(self) -> None:
        self.reading = Telemetry(timestamp_s=0.0, power_w=300.0, energy_j=1000.0)

    def latest(self) -> Telemetry:
        return self.reading


def _state() -> ServingState:
    state = ServingState(load_config(None, {"mqtt": {"enabled": False}}), None)
    state.engine = _Engine()  # type: ignore[assignment]
    state.device_sampler = _Sampler()
    return state


def _decision(seq: int, changed: tuple[str, ...], reason: Reason, apply: bool = True) -> Decision:
    return Decision(
        at_s=float(seq),
        seq=seq,
        state=ControllerState.TRACKING,
        mode=ControlMode.AUTO if apply else ControlMode.OBSERVE,
        knobs=Knobs(max_num_seqs=8, max_num_batched_tokens=256, sm_clock_mhz=1200),
        changed=changed,
        apply=apply,
        reason_code=reason,
        reason=f"reason {seq}",
        effective_budget_w=300.0,
    )


def test_each_consumer_has_its_own_window():
    state = _state()
    feed = LiveFeed(state)
    feed.open_window("mqtt")
    feed.snapshot("live")
    feed.snapshot("mqtt")  # both rate baselines at 1000 J, 0 tokens
    state.engine.counters.generation_tokens = 100
    state.device_sampler.reading = Telemetry(timestamp_s=1.0, power_w=300.0, energy_j=1050.0)
    feed.record_request(ttft_s=0.5, tpot_s=0.05)
    live = feed.snapshot("live")
    assert live.serving.energy_window_j == 50.0
    assert live.serving.energy_per_token_j == 0.5
    assert live.latency.ttft_p99_ms == 500.0 and live.latency.slo_attainment_ratio == 1.0
    assert live.knobs.max_num_seqs == 8 and live.serving.requests_waiting == 1
    assert live.policy["power_budget_w"] == state.policy.power_budget_w
    # The MQTT window still holds the request and the energy: live did not steal them.
    mqtt = feed.snapshot("mqtt")
    assert mqtt.latency.ttft_p99_ms == 500.0 and mqtt.serving.energy_window_j == 50.0
    # And the next live window is empty again.
    assert feed.snapshot("live").latency.ttft_p99_ms is None


def test_a_request_finished_before_a_consumers_first_tick_is_counted_by_it():
    # A consumer's first tick can come after the first requests finish (the MQTT tick runs
    # every telemetry_interval_ms from its start; a tiny model serves three requests in less).
    state = _state()
    feed = LiveFeed(state)
    feed.open_window("mqtt")
    feed.record_request(ttft_s=0.2, tpot_s=None)
    state.engine.counters.generation_tokens = 8
    first = feed.snapshot("mqtt")
    assert first.serving.requests_finished == 1
    assert first.latency.ttft_p50_ms == 200.0
    # Its rates cover the time since the window was opened, not a later baseline.
    assert first.window_s is not None and first.window_s > 0
    assert (first.serving.generation_tokens_per_s or 0) > 0
    assert feed.snapshot("mqtt").serving.requests_finished == 0


def test_a_window_is_opened_once_and_only_opened_windows_are_closed():
    feed = LiveFeed(_state())
    feed.open_window("mqtt")
    with pytest.raises(ValueError, match="already open"):
        feed.open_window("mqtt")
    with pytest.raises(KeyError):
        feed.snapshot("never-opened")


def test_decisions_publish_only_on_change_and_are_counted():
    state = _state()
    feed = LiveFeed(state)
    feed.on_decision(_decision(1, ("sm_clock_mhz",), Reason.OPTIMIZE))
    feed.on_decision(_decision(2, (), Reason.OPTIMIZE))  # same reason, nothing changed
    feed.on_decision(_decision(3, (), Reason.STEADY))  # reason changed
    feed.on_decision(_decision(4, (), Reason.STEADY, apply=False))  # mode changed: advice
    events = feed.recent_events()
    assert [e.data["seq"] for e in events] == [1, 3, 4]
    assert events[-1].message.startswith("advice")
    metrics = state.metrics.render().decode()
    assert 'wattserve_controller_decisions_total{reason="optimize"} 1.0' in metrics
    assert 'wattserve_events_total{kind="decision"} 3.0' in metrics


def test_quantization_switch_and_stale_device_become_events():
    state = _state()
    feed = LiveFeed(state)
    feed._watch_transitions(feed.snapshot())
    state.engine.quant_level = "int8"
    state.device_sampler.reading = Telemetry(timestamp_s=1.0, stale=True)
    feed._watch_transitions(feed.snapshot())
    kinds = {e.kind: e for e in feed.recent_events()}
    assert kinds["quantization_switch"].data == {"from": "fp32", "to": "int8"}
    assert kinds["device_fault"].data["stale"] is True


def test_slow_subscriber_loses_oldest_telemetry_not_events():
    sub = Subscription(max_items=3)
    sub.put(FeedItem("event", EventPayload(kind="start", message="up")))
    for i in range(4):
        sub.put(FeedItem("telemetry", TelemetryPayload(window_s=float(i + 1))))

    async def drain() -> list[FeedItem]:
        out = []
        while (item := await sub.get(0.01)) is not None:
            out.append(item)
        return out

    items = asyncio.run(drain())
    assert sub.dropped == 2
    assert [i.kind for i in items] == ["event", "telemetry", "telemetry"]
    assert [i.payload.window_s for i in items[1:]] == [3.0, 4.0]


def test_run_fans_out_to_listeners_and_subscribers():
    state = _state()
    feed = LiveFeed(state, period_s=0.01)
    seen: list[TelemetryPayload] = []
    events: list[EventPayload] = []
    feed.add_listener(on_telemetry=seen.append, on_event=events.append)

    async def main() -> list[FeedItem]:
        task = asyncio.create_task(feed.run())
        got = []
        async with feed.subscribe() as sub:
            await asyncio.sleep(0.05)
            feed.publish_event("start", "serving")
            while len(got) < 4 and (item := await sub.get(1.0)) is not None:
                got.append(item)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return got

    got = asyncio.run(main())
    assert len(seen) >= 3 and [e.kind for e in events] == ["start"]
    assert {i.kind for i in got} <= {"telemetry", "event"} and len(got) == 4
    assert len(feed.history()) == len(seen)
