"""Telemetry sampling on a dedicated thread.

Reads the device at a configured rate (default 10 Hz), never faster than the device's
own update period, keeps the latest snapshot, and hands each one to write-only sinks
(metrics, MQTT). A snapshot older than two sampling periods comes back marked stale.
This module must not decide anything from the telemetry and must not call setters.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from wattserve.daemon.device.protocol import Device, Telemetry

log = logging.getLogger(__name__)

Sink = Callable[[Telemetry], None]


def sampling_period_s(rate_hz: float, device_update_period_s: float) -> float:
    """The sampling period: 1 / rate_hz, but never shorter than the device's update period."""
    if not rate_hz > 0:
        raise ValueError(f"sample rate must be > 0 Hz, got {rate_hz!r}")
    return max(1.0 / rate_hz, device_update_period_s)


class TelemetrySampler:
    """Samples one device on its own thread; latest() is safe from any thread."""

    def __init__(self, device: Device, rate_hz: float = 10.0, sinks: Sequence[Sink] = ()) -> None:
        self._device = device
        update_s = device.capabilities().update_period_s
        self.period_s = sampling_period_s(rate_hz, update_s)
        if self.period_s > 1.0 / rate_hz:
            log.info(
                "device: %.1f Hz is faster than the device updates (every %.3f s); "
                "sampling at %.1f Hz",
                rate_hz,
                update_s,
                1.0 / self.period_s,
            )
        self._sinks = tuple(sinks)
        self._latest: Telemetry | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error: str | None = None

    @property
    def rate_hz(self) -> float:
        return 1.0 / self.period_s

    def sample_once(self) -> Telemetry:
        """Read the device now, keep the snapshot, and hand it to the sinks."""
        telemetry = self._device.read()
        with self._lock:
            self._latest = telemetry
        for sink in self._sinks:
            try:
                sink(telemetry)
            except Exception:  # a broken sink must not stop sampling
                log.exception("device: telemetry sink %r failed", sink)
        return telemetry

    def latest(self) -> Telemetry | None:
        """The newest snapshot, marked stale when older than two sampling periods."""
        with self._lock:
            telemetry = self._latest
        if telemetry is None:
            return None
        if not telemetry.stale and self._device.now_s() - telemetry.timestamp_s > 2 * self.period_s:
            return dataclasses.replace(telemetry, stale=True)
        return telemetry

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("sampler already started")
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="wattserve-device-sampler", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("device: sampler thread did not stop within %.1f s", timeout_s)
            self._thread = None

    def _run(self) -> None:
        # Deadlines on the wall clock (not sleep(period)) so read time does not add drift.
        next_s = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
                self._last_error = None
            except Exception as e:  # keep sampling; latest() turns stale meanwhile
                message = f"{type(e).__name__}: {e}"
                if message != self._last_error:
                    log.error("device: telemetry read failed: %s", message)
                    self._last_error = message
            next_s += self.period_s
            now_s = time.monotonic()
            if next_s < now_s:  # fell behind (a slow read): skip, don't burst
                next_s = now_s
            self._stop.wait(next_s - now_s)
