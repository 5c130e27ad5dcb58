"""The attach loop against the fake server on the virtual GPU: its estimates and decisions,
bypass detection, and the faults (server down, metrics missing or renamed, a restart)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from wattserve.attach.admission import Admission
from wattserve.attach.build import build_runner
from wattserve.attach.feed import AttachFeed
from wattserve.attach.front import RequestTiming
from wattserve.attach.gpus import GpuGroup
from wattserve.attach.names import BY_KIND
from wattserve.attach.runner import (
    METRICS_MISSING,
    OK,
    SERVER_DOWN,
    http_fetcher,
    synthetic_steps,
)
from wattserve.bench.attach_fake import FakeServer, serve_in_thread
from wattserve.controller.policy import Knobs
from wattserve.daemon.config import ControllerConfig, DeviceConfig
from wattserve.daemon.device import open_device

DATA = Path(__file__).resolve().parent.parent / "data" / "attach"
FIXTURES = {"vllm": "vllm-0.32.0-cpu.metrics", "sglang": "sglang-00ae9c1.metrics"}


class Clock:
    """The runner's clock: windows of a known length, whatever the machine's load."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture(params=["vllm", "sglang"])
def fake(request):
    names = BY_KIND[request.param]
    server = FakeServer((DATA / FIXTURES[request.param]).read_text(), names)
    with serve_in_thread(server.app) as url:
        server.url = url
        yield server


def _runner(fake, tmp_path, admission=None, gpus=1, mode="auto", **cfg):
    devices = [
        open_device(
            DeviceConfig(backend="virtual", mode="control", state_dir=tmp_path, virtual_seed=i)
        )
        for i in range(gpus)
    ]
    group = GpuGroup(devices)
    config = ControllerConfig(
        **{"mode": mode, "power_budget_w": 300, "ttft_slo_ms": 500, "tpot_slo_ms": 100, **cfg}
    )
    clock = Clock()
    runner = build_runner(
        config,
        fake.names,
        http_fetcher(fake.url),
        group,
        admission=admission,
        max_num_seqs=64,
        server_url=fake.url,
        clock=clock,
    )
    return runner, group, clock


def _load(url: str, requests: int, max_tokens: int = 20) -> threading.Thread:
    def go() -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            for _ in range(requests):
                body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as s:
                    for _ in s.iter_lines():
                        pass

    t = threading.Thread(target=go)
    t.start()
    return t


def _steps(runner, clock, n: int, pause_s: float = 0.2, window_s: float = 1.0) -> list:
    out = []
    for _ in range(n):
        time.sleep(pause_s)
        clock.now_s += window_s
        out.append(runner.step())
    return out


def test_estimates_and_decisions_from_the_servers_metrics(fake, tmp_path) -> None:
    fake.state.first_token_s, fake.state.token_s = 0.01, 0.005
    runner, group, clock = _runner(fake, tmp_path)
    try:
        loads = [_load(fake.url, 30) for _ in range(3)]
        decisions = _steps(runner, clock, 6)
        for t in loads:
            t.join()
        w = runner.last_window
        assert decisions[0] is None  # one scrape is no window yet
        assert w is not None and w.generation_tok_s > 0
        # The mean comes from the histogram's _sum and _count deltas: exact.
        assert 0.004 <= w.itl_mean_s <= 0.006
        assert w.ttft_p50_s is not None and w.ttft_p50_s <= 0.1
        # The controller learns from the synthetic steps and acts on the GPU.
        assert runner.control.controller.counters.decisions  # it decided
        applied = [d for d in decisions if d is not None and d.apply]
        assert applied and applied[-1].knobs.sm_clock_mhz is not None
        assert group.read().sm_clock_lock_mhz == (applied[-1].knobs.sm_clock_mhz,) * 2
        assert group.read().power_limit_w == pytest.approx(applied[-1].knobs.power_limit_w)
        assert runner.status()["attached"]["health"] == OK
        assert "not offered" in runner.status()["knobs"]["quantization"]
    finally:
        group.close()


def test_tensor_parallel_gpus_share_one_budget_and_one_clock(fake, tmp_path) -> None:
    runner, group, clock = _runner(fake, tmp_path, gpus=2)
    try:
        loads = [_load(fake.url, 20)]
        decisions = _steps(runner, clock, 3)
        loads[0].join()
        knobs = [d for d in decisions if d is not None and d.apply][-1].knobs
        reads = [d.read() for d in group.devices]
        assert {r.sm_clock_lock_mhz for r in reads} == {(knobs.sm_clock_mhz,) * 2}
        assert sum(r.power_limit_w for r in reads) == pytest.approx(knobs.power_limit_w)
        assert group.read().power_w == pytest.approx(sum(r.power_w for r in reads), rel=0.2)
    finally:
        group.close()


def test_server_down_holds_the_restored_settings_and_recovers(fake, tmp_path) -> None:
    runner, group, clock = _runner(fake, tmp_path)
    try:
        _steps(runner, clock, 3)
        assert group.read().sm_clock_lock_mhz is not None  # the controller set a clock
        good_url = runner._fetch
        runner._fetch = http_fetcher("http://127.0.0.1:9")  # nothing listens there
        assert _steps(runner, clock, 2) == [None, None]
        status = runner.status()["attached"]
        assert status["health"] == SERVER_DOWN and "refused" in status["detail"]
        assert group.read().sm_clock_lock_mhz is None  # back to what it was before
        runner._fetch = good_url
        _steps(runner, clock, 3)
        assert runner.health == OK
        assert group.read().sm_clock_lock_mhz is not None
    finally:
        group.close()


@pytest.mark.parametrize("fault", ["hidden", "renamed"])
def test_missing_or_renamed_metric_is_a_status_not_a_crash(fake, tmp_path, fault) -> None:
    runner, group, clock = _runner(fake, tmp_path)
    try:
        _steps(runner, clock, 2)
        assert group.read().sm_clock_lock_mhz is not None
        family = fake.names.waiting
        if fault == "hidden":
            fake.state.hidden.add(family)
        else:
            fake.state.renamed[family] = family + "_v2"
        assert _steps(runner, clock, 2) == [None, None]
        status = runner.status()["attached"]
        assert status["health"] == METRICS_MISSING
        assert status["missing_metrics"] == [family]
        assert group.read().sm_clock_lock_mhz is None
    finally:
        group.close()


def test_counters_reset_by_a_restart_rebase_the_window(fake, tmp_path) -> None:
    runner, group, clock = _runner(fake, tmp_path)
    try:
        t = _load(fake.url, 10)
        _steps(runner, clock, 3)
        t.join()
        before = runner.engine.counters.generation_tokens
        assert before > 0
        fake.state.restart()
        assert _steps(runner, clock, 1) == [None]
        assert runner.counter_resets == 1 and runner.health == OK
        t = _load(fake.url, 5)
        t.join()
        decision = _steps(runner, clock, 1)[0]
        assert decision is not None
        assert runner.last_window.generation_tok_s > 0
        # The controller's totals only go up across the restart.
        assert runner.engine.counters.generation_tokens > before
    finally:
        group.close()


def test_traffic_bypassing_the_front_is_detected(fake, tmp_path) -> None:
    admission = Admission(64)
    runner, group, clock = _runner(fake, tmp_path, admission=admission)
    try:
        _steps(runner, clock, 4)
        assert runner.status()["bypass"]["detected"] is False
        fake.state.extra_running = 3  # someone talks to the server directly
        _steps(runner, clock, 4)
        status = runner.status()
        assert status["bypass"] == {"detected": True, "excess_seqs": 3.0}
        assert status["knobs"]["admission"]["reliable"] is False
        fake.state.extra_running = 0
        _steps(runner, clock, 4)
        assert runner.status()["knobs"]["admission"]["reliable"] is True
    finally:
        group.close()


def test_the_admission_cap_lifted_at_a_fault_comes_back_after_it(fake, tmp_path) -> None:
    admission = Admission(64)
    runner, group, clock = _runner(fake, tmp_path, admission=admission, mode="manual")
    try:
        runner.control.set_manual_knobs(
            Knobs(max_num_seqs=5, max_num_batched_tokens=8192, quant_level="native")
        )
        _steps(runner, clock, 2)
        assert admission.max_num_seqs == 5
        fake.state.hidden.add(fake.names.running)
        _steps(runner, clock, 1)
        assert admission.max_num_seqs == 64  # lifted while the metrics are missing
        fake.state.hidden.clear()
        _steps(runner, clock, 2)
        assert admission.max_num_seqs == 5
    finally:
        group.close()


@pytest.mark.parametrize("fake", ["vllm"], indirect=True)
@pytest.mark.parametrize("budget_w", [160, 600])
def test_learning_starts_below_the_top_clock_only_where_the_board_cannot_hold(
    fake, tmp_path, budget_w
) -> None:
    # The virtual H200's power limit goes down to 200 W: 160 W is below it, 600 W is not.
    # Slow tokens: the first windows hold fewer steps than half of learning's.
    fake.state.first_token_s, fake.state.token_s = 0.05, 0.2
    runner, group, clock = _runner(fake, tmp_path, power_budget_w=budget_w)
    try:
        loads = [_load(fake.url, 1, max_tokens=5) for _ in range(2)]
        decisions = _steps(runner, clock, 3)
        loads[0].join()
        learning = [d for d in decisions if d is not None and d.reason.startswith("learning")]
        assert learning
        top = runner.control.controller.device.sm_clock_max_mhz
        # The first learning decision (its second half is at half the top clock anyway).
        first = learning[0].knobs.sm_clock_mhz
        assert first <= top // 2 if budget_w == 160 else first == top
    finally:
        group.close()


def test_a_modelled_gpu_stretches_the_steps_the_controller_learns_from(fake, tmp_path) -> None:
    """Where the runner books the server's work on a virtual GPU (the bench), the server is
    not slowed by the GPU's clock: the steps fed to the controller carry the stretch the
    virtual GPU gave the last window at the clock decided after it."""
    fake.state.first_token_s, fake.state.token_s = 0.01, 0.005
    runner, group, clock = _runner(fake, tmp_path)
    runner._flops_per_token, runner._weight_bytes_per_step = 16e9, 16e9
    try:
        group.devices[0].lock_sm_clocks_mhz(345, 345)  # the virtual H200's lowest clock
        runner.control.tick = lambda: None  # hold that clock: no decision moves it
        t = _load(fake.url, 30)
        _steps(runner, clock, 3)
        t.join()
        stretch = runner._stretch
        assert stretch > 1.0  # booked at 345 MHz: slower than at the top clock
        window_stats = runner.last_window
        steps = synthetic_steps(window_stats, 2000.0, stretch)
        plain = synthetic_steps(window_stats, 2000.0)
        assert steps and len(steps) == len(plain)
        assert steps[0].duration_s == pytest.approx(plain[0].duration_s * stretch)
        assert steps[-1].started_at_s + steps[-1].duration_s == pytest.approx(2000.0)
    finally:
        group.close()


def test_nvml_books_nothing_so_the_steps_are_as_measured(fake, tmp_path) -> None:
    runner, group, clock = _runner(fake, tmp_path)  # no flops per token: nothing booked
    try:
        t = _load(fake.url, 10)
        _steps(runner, clock, 3)
        t.join()
        assert runner._stretch == 1.0
    finally:
        group.close()


def test_the_attach_feed_shows_the_window_the_front_saw_and_the_decisions(fake, tmp_path) -> None:
    feed = AttachFeed(period_s=0.1)
    group = GpuGroup(
        [open_device(DeviceConfig(backend="virtual", mode="control", state_dir=tmp_path))]
    )
    clock = Clock()
    runner = build_runner(
        ControllerConfig(mode="auto", power_budget_w=300, ttft_slo_ms=500, tpot_slo_ms=100),
        fake.names,
        http_fetcher(fake.url),
        group,
        admission=Admission(64),
        max_num_seqs=64,
        server_url=fake.url,
        clock=clock,
        sinks=(feed.on_decision,),
    )
    try:
        feed.follow(runner)
        t = _load(fake.url, 10)
        _steps(runner, clock, 3)
        t.join()
        # Two requests the front saw end (one past the 500 ms TTFT SLO), one aborted.
        feed.on_request(RequestTiming(0.1, 0.01, 10, aborted=False))
        feed.on_request(RequestTiming(0.9, 0.01, 10, aborted=False))
        feed.on_request(RequestTiming(None, None, None, aborted=True))
        snap = feed.snapshot()
        assert snap.serving.requests_finished == 2
        assert snap.latency.slo_attainment_ratio == pytest.approx(0.5)
        assert snap.serving.energy_window_j is not None and snap.serving.energy_window_j > 0
        assert snap.knobs.sm_clock_lock_mhz is not None  # the controller's clock
        assert snap.policy["power_budget_w"] == 300
        # The controller's decisions are the feed's events (the page's event list).
        assert any(e.kind == "decision" for e in feed.recent_events())
        # The next window starts empty.
        assert feed.snapshot().serving.requests_finished == 0
    finally:
        group.close()
