"""A fake $NOTIFY_SOCKET for tests: a datagram socket the test binds, as systemd would.

It binds a filesystem path (in a short private directory: socket paths are limited to
108 bytes) or an abstract "@name", records every datagram with its arrival time on a
reader thread, and gives the messages back as lists of "KEY=VALUE" assignments.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Datagram:
    received_s: float  # time.monotonic() at arrival
    assignments: tuple[str, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(a.split("=", 1)[0] for a in self.assignments)


class FakeNotifySocket:
    def __init__(self, sock: socket.socket, address: str) -> None:
        self.address = address  # the value for $NOTIFY_SOCKET
        self._sock = sock
        self._received: list[Datagram] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="fake-notify", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        self._sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                self._received.append(Datagram(time.monotonic(), tuple(data.decode().split("\n"))))
                self._cond.notify_all()

    @property
    def datagrams(self) -> list[Datagram]:
        with self._cond:
            return list(self._received)

    def assignments(self) -> list[str]:
        """Every assignment received so far, in order, datagrams flattened."""
        return [a for d in self.datagrams for a in d.assignments]

    def wait_for(self, assignment: str, timeout_s: float) -> Datagram:
        """The first datagram holding `assignment` ("READY=1") or a key prefix ("STATUS=")."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for d in self._received:
                    if any(
                        a == assignment or (assignment.endswith("=") and a.startswith(assignment))
                        for a in d.assignments
                    ):
                        return d
                left = deadline - time.monotonic()
                if left <= 0:
                    got = [d.assignments for d in self._received]
                    raise AssertionError(f"no {assignment!r} within {timeout_s} s; got {got}")
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


@contextmanager
def fake_notify_socket(kind: str = "path") -> Iterator[FakeNotifySocket]:
    """Bind a fake notify socket; kind is "path" or "abstract"."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tmpdir = None
    try:
        if kind == "path":
            tmpdir = tempfile.mkdtemp(prefix="ws-notify-", dir="/tmp")
            address = os.path.join(tmpdir, "notify")
            sock.bind(address)
        elif kind == "abstract":
            name = f"wattserve-test-{secrets.token_hex(8)}"
            sock.bind(b"\0" + name.encode())
            address = "@" + name
        else:
            raise ValueError(kind)
        fake = FakeNotifySocket(sock, address)
        try:
            yield fake
        finally:
            fake.close()
    finally:
        sock.close()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
