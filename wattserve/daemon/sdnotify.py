"""systemd service notification (the sd_notify protocol) and a progress-gated watchdog.

Notifier sends datagrams to $NOTIFY_SOCKET, a filesystem path or an abstract "@name"
socket, without libsystemd: EXTEND_TIMEOUT_USEC while the model loads, READY=1, a
one-line STATUS=, WATCHDOG=1 and STOPPING=1. Watchdog sends WATCHDOG=1 every half of
$WATCHDOG_USEC, but only while every registered liveness probe reports progress since
the previous tick, so a frozen loop stops the pings and systemd restarts the daemon.
Without $NOTIFY_SOCKET every call is a no-op that returns False.
This module must not raise on a failed send (the daemon serves on without systemd), must
not block its caller for long, and must not know what the probes watch: the server
registers them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping

log = logging.getLogger(__name__)

# A probe answers "has the thing I watch made progress since you last asked me?".
Probe = Callable[[], bool]

STATUS_MAX_CHARS = 200
_SEND_TIMEOUT_S = 1.0


def one_line(text: str, max_chars: int = STATUS_MAX_CHARS) -> str:
    """`text` with every run of whitespace (newlines included) made one space, cut to size."""
    flat = " ".join(text.split())
    return flat if len(flat) <= max_chars else flat[: max_chars - 3] + "..."


def status_line(
    model: str,
    requests_per_s: float | None = None,
    power_w: float | None = None,
    power_budget_w: float | None = None,
    phase: str | None = None,
) -> str:
    """The daemon's STATUS= summary, e.g. "ready: model m, 3.2 req/s, 412 W of 700 W budget"."""
    parts = [f"model {model}"]
    if requests_per_s is not None:
        parts.append(f"{requests_per_s:.1f} req/s")
    if power_w is not None and power_budget_w is not None:
        parts.append(f"{power_w:.0f} W of {power_budget_w:.0f} W budget")
    elif power_w is not None:
        parts.append(f"{power_w:.0f} W")
    elif power_budget_w is not None:
        parts.append(f"power n/a, {power_budget_w:.0f} W budget")
    text = ", ".join(parts)
    return one_line(f"{phase}: {text}" if phase else text)


def _socket_address(notify_socket: str) -> str | bytes | None:
    if notify_socket.startswith("@"):
        # Abstract namespace: a leading NUL byte, the name not NUL-terminated.
        return b"\0" + notify_socket[1:].encode()
    if notify_socket.startswith("/"):
        return notify_socket
    return None  # relative paths and vsock: addresses are not supported


class Notifier:
    """Sends sd_notify messages to one socket; every method returns whether it was sent.

    Thread-safe. The socket is created on first use and each message is one sendto(), so
    a socket that systemd re-created (daemon-reexec) is found again on the next message.
    """

    def __init__(self, notify_socket: str | None, watchdog_usec: int | None = None) -> None:
        """notify_socket: $NOTIFY_SOCKET ("/path" or "@abstract"); None disables everything.

        watchdog_usec: $WATCHDOG_USEC, the watchdog period systemd enforces, in microseconds;
        None (or 0) means no watchdog.
        """
        self._address = _socket_address(notify_socket) if notify_socket else None
        if notify_socket and self._address is None:
            log.warning("sd_notify: NOTIFY_SOCKET=%r is not supported; not notifying",
                        notify_socket)
        self._watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failing = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """The notifier systemd asked for in the environment (default: os.environ)."""
        env = os.environ if environ is None else environ
        watchdog_usec: int | None = None
        raw = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process the watchdog is meant for; a child that inherited
        # the variables must not ping on the parent's behalf.
        if raw.isdigit() and (not pid or pid == str(os.getpid())):
            watchdog_usec = int(raw)
        return cls(env.get("NOTIFY_SOCKET") or None, watchdog_usec)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def watchdog_period_s(self) -> float | None:
        """The period systemd enforces (WatchdogSec=), or None without a watchdog."""
        if not self.enabled or self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 1e6

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half the enforced period, or None without a watchdog."""
        period_s = self.watchdog_period_s
        return None if period_s is None else period_s / 2

    def notify(self, *assignments: str) -> bool:
        """Send "KEY=VALUE" assignments as one datagram; False when disabled or not sent."""
        for a in assignments:
            if "=" not in a or "\n" in a:
                raise ValueError(f"sd_notify assignment must be one KEY=VALUE line: {a!r}")
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(
                        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    )
                    # systemd drains its socket at once; a stuck receiver must not hang us.
                    self._sock.settimeout(_SEND_TIMEOUT_S)
                self._sock.sendto(payload, self._address)
            except OSError as e:
                # Log the first failure of a run of them; the next success resets it.
                level = logging.DEBUG if self._failing else logging.WARNING
                log.log(level, "sd_notify: cannot send %s: %s", assignments[0].split("=")[0], e)
                self._failing = True
                return False
        self._failing = False
        return True

    def extend_timeout(self, extra_s: float) -> bool:
        """Ask for `extra_s` more seconds for the current phase (start or stop) from now."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(1, round(extra_s * 1e6))}")

    def ready(self, status: str | None = None) -> bool:
        """Startup finished: READY=1 (with a STATUS= line, in the same datagram)."""
        return self.notify("READY=1", *self._status(status))

    def status(self, text: str) -> bool:
        """Set the one-line status `systemctl status` shows."""
        return self.notify(*self._status(text))

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown has begun: STOPPING=1 (with a STATUS= line, in the same datagram)."""
        return self.notify("STOPPING=1", *self._status(status))

    def ping_watchdog(self) -> bool:
        """WATCHDOG=1. The server calls this only through Watchdog, which checks progress."""
        return self.notify("WATCHDOG=1")

    @contextlib.asynccontextmanager
    async def extending_timeout(
        self, step_s: float = 60.0, max_total_s: float = 3600.0
    ) -> AsyncIterator[None]:
        """While the body runs, keep the start timeout at least `step_s` ahead.

        Sends EXTEND_TIMEOUT_USEC=step_s every step_s / 3, so one late message does not
        let the timeout lapse. It stops extending after `max_total_s`: a load that hangs
        for good then runs into TimeoutStartSec= instead of being extended forever.
        """
        if not self.enabled:
            yield
            return

        async def keep_extending() -> None:
            deadline_s = time.monotonic() + max_total_s
            while time.monotonic() < deadline_s:
                self.extend_timeout(step_s)
                await asyncio.sleep(step_s / 3)

        task = asyncio.create_task(keep_extending(), name="sd_notify-extend-timeout")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def report_status(self, summary: Callable[[], str], interval_s: float = 5.0) -> None:
        """Send STATUS=summary() every `interval_s` until cancelled; returns at once if disabled.

        A summary that raises is logged and skipped: the status line is cosmetic.
        """
        if not self.enabled:
            return
        while True:
            try:
                text = summary()
            except Exception:  # noqa: BLE001 - never let the status line take the loop down
                log.exception("sd_notify: status summary failed")
            else:
                self.status(text)
            await asyncio.sleep(interval_s)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    @staticmethod
    def _status(text: str | None) -> tuple[str, ...]:
        return () if text is None else (f"STATUS={one_line(text)}",)


class ProgressProbe:
    """A liveness probe over a progress counter: progressed if the counter moved, or idle.

    read_progress: a counter the watched loop increases (e.g. engine steps taken).
    idle: True while the loop is alive with nothing to do, so a counter that stands still
    is no sign of a hang (e.g. the engine thread runs and no request is pending).
    The baseline is read at construction; each call compares with the previous one.
    """

    def __init__(
        self, read_progress: Callable[[], int], idle: Callable[[], bool] | None = None
    ) -> None:
        self._read = read_progress
        self._idle = idle
        self._last = read_progress()

    def __call__(self) -> bool:
        now = self._read()
        moved = now != self._last
        self._last = now
        return moved or (self._idle is not None and self._idle())


class Watchdog:
    """Pings WATCHDOG=1 every interval while all liveness probes report progress.

    Run `run()` as a task on the server's event loop after READY=1 and cancel it after
    the engine stopped: a blocked event loop then stops the pings too. Each tick asks
    every probe (so each one's baseline moves on) and pings only if all said yes; after a
    freeze, at most one more ping is sent, within one interval.
    """

    def __init__(self, notifier: Notifier, interval_s: float | None = None) -> None:
        """interval_s: ping period; default half of $WATCHDOG_USEC (None: no watchdog)."""
        self._notifier = notifier
        self._interval_s = interval_s if interval_s is not None else notifier.watchdog_interval_s
        self._probes: dict[str, Probe] = {}
        self.stalled: tuple[str, ...] = ()  # probes that reported no progress at the last tick
        self.pings_sent = 0

    @property
    def enabled(self) -> bool:
        return self._notifier.enabled and self._interval_s is not None

    @property
    def interval_s(self) -> float | None:
        return self._interval_s

    def add_probe(self, name: str, probe: Probe) -> None:
        """Register a liveness probe; names appear in the log when a probe stalls."""
        if name in self._probes:
            raise ValueError(f"watchdog probe {name!r} is already registered")
        self._probes[name] = probe

    def tick(self) -> bool:
        """Ask every probe; send WATCHDOG=1 if all progressed. Returns whether it was sent."""
        stalled = tuple(name for name, probe in self._probes.items() if not _ask(name, probe))
        if stalled and stalled != self.stalled:
            log.warning(
                "watchdog: no progress in %s; withholding WATCHDOG=1 (systemd restarts "
                "the service if this lasts)",
                ", ".join(stalled),
            )
        elif not stalled and self.stalled:
            log.info("watchdog: progress again in %s", ", ".join(self.stalled))
        self.stalled = stalled
        if stalled:
            return False
        sent = self._notifier.ping_watchdog()
        self.pings_sent += sent
        return sent

    async def run(self) -> None:
        """Tick every interval until cancelled; returns at once when there is no watchdog."""
        if not self.enabled:
            return
        assert self._interval_s is not None
        while True:
            await asyncio.sleep(self._interval_s)
            self.tick()


def _ask(name: str, probe: Probe) -> bool:
    try:
        return bool(probe())
    except Exception:  # noqa: BLE001 - a broken probe counts as no progress
        log.exception("watchdog: probe %s failed", name)
        return False
