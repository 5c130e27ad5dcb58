"""wattserve.daemon.sdnotify against a fake NOTIFY_SOCKET the test binds (path and abstract)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import pytest

from tests.fake_notify_socket import fake_notify_socket
from wattserve.daemon.sdnotify import Notifier, ProgressProbe, Watchdog, one_line, status_line

WAIT_S = 5.0


@pytest.fixture(params=["path", "abstract"])
def any_notify(request):
    with fake_notify_socket(request.param) as fake:
        yield fake


@pytest.fixture()
def notify():
    with fake_notify_socket("path") as fake:
        yield fake


def test_without_notify_socket_everything_is_a_noop() -> None:
    n = Notifier.from_environ({})
    assert not n.enabled and n.watchdog_interval_s is None
    assert not n.ready("x") and not n.status("x") and not n.stopping()
    assert not n.extend_timeout(10) and not n.ping_watchdog()
    w = Watchdog(n)
    w.add_probe("p", lambda: True)
    assert not w.enabled

    async def body() -> None:
        await asyncio.wait_for(w.run(), 1)  # returns at once
        await asyncio.wait_for(n.report_status(lambda: "s"), 1)
        async with n.extending_timeout(step_s=0.01):
            await asyncio.sleep(0.01)

    asyncio.run(body())
    # WATCHDOG_USEC alone (no socket) gives no watchdog either.
    assert Notifier.from_environ({"WATCHDOG_USEC": "1000000"}).watchdog_interval_s is None


def test_lifecycle_messages_arrive_in_order(any_notify) -> None:
    notify = any_notify
    n = Notifier.from_environ({"NOTIFY_SOCKET": notify.address})
    assert n.enabled
    assert n.extend_timeout(90)
    assert n.ready("ready: model m")
    assert n.status("serving\n 3 req/s")
    assert n.ping_watchdog()
    assert n.stopping("draining")
    notify.wait_for("STOPPING=1", WAIT_S)
    n.close()
    assert [d.assignments for d in notify.datagrams] == [
        ("EXTEND_TIMEOUT_USEC=90000000",),
        ("READY=1", "STATUS=ready: model m"),
        ("STATUS=serving 3 req/s",),
        ("WATCHDOG=1",),
        ("STOPPING=1", "STATUS=draining"),
    ]


def test_notify_rejects_malformed_assignments() -> None:
    n = Notifier("/nonexistent/socket")
    with pytest.raises(ValueError):
        n.notify("READY")
    with pytest.raises(ValueError):
        n.notify("STATUS=a\nREADY=1")


def test_send_failure_returns_false_and_logs_once(tmp_path, caplog) -> None:
    n = Notifier(str(tmp_path / "absent"))
    assert n.enabled
    with caplog.at_level(logging.DEBUG, logger="wattserve.daemon.sdnotify"):
        assert not n.ready()
        assert not n.status("x")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "READY" in warnings[0].getMessage()


def test_environment_parsing() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "30000000"}
    n = Notifier.from_environ(env)
    assert n.watchdog_period_s == 30.0 and n.watchdog_interval_s == 15.0
    n = Notifier.from_environ({**env, "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_interval_s == 15.0
    # The watchdog belongs to another process (we inherited its environment): no pings.
    assert Notifier.from_environ({**env, "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert Notifier.from_environ({**env, "WATCHDOG_USEC": "soon"}).watchdog_interval_s is None
    assert Notifier.from_environ({**env, "WATCHDOG_USEC": "0"}).watchdog_interval_s is None
    assert not Notifier.from_environ({"NOTIFY_SOCKET": "relative/path"}).enabled
    assert not Notifier.from_environ({"NOTIFY_SOCKET": ""}).enabled


def test_status_is_one_short_line() -> None:
    assert one_line("a\n\tb  c\r\n") == "a b c"
    long = one_line("x" * 1000)
    assert len(long) == 200 and long.endswith("...")
    assert (
        status_line("smol", requests_per_s=3.21, power_w=412.4, power_budget_w=700, phase="ready")
        == "ready: model smol, 3.2 req/s, 412 W of 700 W budget"
    )
    assert status_line("smol", power_budget_w=700) == "model smol, power n/a, 700 W budget"
    assert status_line("smol", power_w=80) == "model smol, 80 W"


def test_progress_probe_counts_progress_or_idleness() -> None:
    count = [5]
    idle = [False]
    probe = ProgressProbe(lambda: count[0], idle=lambda: idle[0])
    assert not probe()  # baseline taken at construction: no step since
    count[0] += 1
    assert probe()
    assert not probe()  # no step since the previous call
    idle[0] = True
    assert probe()  # nothing to do is not a hang
    strict = ProgressProbe(lambda: count[0])
    assert not strict()


def test_tick_pings_only_when_every_probe_progressed(notify, caplog) -> None:
    n = Notifier(notify.address, watchdog_usec=2_000_000)
    w = Watchdog(n)
    assert w.enabled and w.interval_s == 1.0
    answers = {"engine": True, "controller": True}
    w.add_probe("engine", lambda: answers["engine"])
    w.add_probe("controller", lambda: answers["controller"])
    with pytest.raises(ValueError):
        w.add_probe("engine", lambda: True)
    assert w.tick()
    answers["controller"] = False
    with caplog.at_level(logging.WARNING, logger="wattserve.daemon.sdnotify"):
        assert not w.tick()
        assert not w.tick()
    assert w.stalled == ("controller",)
    stalls = [r for r in caplog.records if "no progress in controller" in r.getMessage()]
    assert len(stalls) == 1  # logged when it starts, not at every tick
    answers["controller"] = True
    assert w.tick() and w.stalled == ()
    notify.wait_for("WATCHDOG=1", WAIT_S)
    time.sleep(0.1)
    assert notify.assignments() == ["WATCHDOG=1", "WATCHDOG=1"]
    assert w.pings_sent == 2


def test_a_probe_that_raises_counts_as_stalled(notify) -> None:
    w = Watchdog(Notifier(notify.address, watchdog_usec=1_000_000))

    def broken() -> bool:
        raise RuntimeError("boom")

    w.add_probe("broken", broken)
    assert not w.tick() and w.stalled == ("broken",)


def test_frozen_loop_stops_watchdog_within_one_interval(notify) -> None:
    """A loop thread bumps a counter; once it freezes, at most one more ping, within one
    interval, then none; when it runs again, pings resume."""
    period_s = 0.4
    interval_s = period_s / 2
    n = Notifier(notify.address, watchdog_usec=int(period_s * 1e6))
    counter = [0]
    running = threading.Event()
    running.set()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if running.is_set():
                counter[0] += 1
            time.sleep(0.005)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    w = Watchdog(n)
    assert w.interval_s == interval_s
    w.add_probe("engine loop", ProgressProbe(lambda: counter[0]))
    marks: dict[str, float] = {}

    async def scenario() -> None:
        task = asyncio.create_task(w.run())
        await asyncio.sleep(interval_s * 3.5)
        running.clear()
        marks["frozen"] = time.monotonic()
        await asyncio.sleep(interval_s * 4)
        marks["resumed"] = time.monotonic()
        running.set()
        await asyncio.sleep(interval_s * 3)
        task.cancel()

    try:
        asyncio.run(scenario())
    finally:
        stop.set()
        thread.join(2)
    pings = [d.received_s for d in notify.datagrams if d.assignments == ("WATCHDOG=1",)]
    before = [t for t in pings if t < marks["frozen"]]
    during = [t for t in pings if marks["frozen"] <= t < marks["resumed"]]
    after = [t for t in pings if t >= marks["resumed"]]
    assert len(before) >= 2, pings
    # One ping may still cover progress made before the freeze; it comes within one interval.
    assert len(during) <= 1, (marks, pings)
    assert all(t <= marks["frozen"] + interval_s + 0.1 for t in during), (marks, pings)
    assert len(after) >= 1, (marks, pings)
    assert w.stalled == ()


def test_extending_timeout_repeats_while_the_body_runs(notify) -> None:
    n = Notifier(notify.address)
    counts = {}

    async def body() -> None:
        # A "model load" that lasts until four extensions arrived (bounded): how many
        # arrive in a fixed time depends on how busy the machine is, the order does not.
        start = time.monotonic()
        async with n.extending_timeout(step_s=0.15, max_total_s=60):
            deadline = start + 30
            while len(notify.assignments()) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        counts["at_exit"] = len(notify.datagrams)
        counts["body_s"] = time.monotonic() - start
        await asyncio.sleep(0.3)
        counts["later"] = len(notify.datagrams)

    asyncio.run(body())
    sent = notify.assignments()
    assert len(sent) >= 4 and set(sent) == {"EXTEND_TIMEOUT_USEC=150000"}, sent
    # One every step / 3 = 50 ms at most often (a sleep never ends early)...
    assert len(sent) <= counts["body_s"] / 0.05 + 2, (sent, counts)
    # ...and none after the body ended (one may have been on its way).
    assert counts["later"] <= counts["at_exit"] + 1, counts


def test_extending_timeout_gives_up_after_max_total(notify) -> None:
    n = Notifier(notify.address)

    async def body() -> None:
        # Sends at 0 and 0.1 s; at 0.2 s the 0.15 s allowance is spent.
        async with n.extending_timeout(step_s=0.3, max_total_s=0.15):
            await asyncio.sleep(0.6)  # a load that hangs

    asyncio.run(body())
    assert 2 <= len(notify.assignments()) <= 3
    last = notify.datagrams[-1].received_s
    assert time.monotonic() - last >= 0.3


def test_report_status_repeats_and_survives_a_failing_summary(notify, caplog) -> None:
    n = Notifier(notify.address)
    calls = [0]

    def summary() -> str:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("no telemetry yet")
        return f"tick {calls[0]}\nsecond line"

    async def body() -> None:
        task = asyncio.create_task(n.report_status(summary, interval_s=0.05))
        await asyncio.sleep(0.22)
        task.cancel()

    with caplog.at_level(logging.ERROR, logger="wattserve.daemon.sdnotify"):
        asyncio.run(body())
    time.sleep(0.05)
    sent = notify.assignments()
    assert sent[:2] == ["STATUS=tick 1 second line", "STATUS=tick 3 second line"]
    assert "status summary failed" in caplog.text
