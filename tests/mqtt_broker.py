"""Private Mosquitto brokers and a recording subscriber, for the MQTT tests.

A Broker is one `mosquitto` process on a random loopback port with a generated config:
anonymous, or a password file plus an ACL, or TLS with client certificates. A Recorder is
a plain aiomqtt subscriber that keeps every message and waits for one matching a
condition, with bounded timeouts. The fixtures in tests/conftest.py build on these.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from wattserve.daemon.mqtt import StatusPayload

REPO = Path(__file__).resolve().parents[1]
# The ACL docs/mqtt.md documents; the auth broker runs on this very file.
ACL_EXAMPLE = REPO / "systemd" / "mosquitto-wattserve.acl"
TEST_TIMEOUT_S = 30.0
WAIT_S = 10.0
# One broker user per node (named like the node id, as the ACL's %u patterns need), the
# allocator, the site meter and a viewer.
USERS = {
    "acl": "acl-secret",
    "web": "web-secret",
    "batch": "batch-secret",
    "mallory": "mallory-secret",  # a node of the broker, but not of the site's fleet
    "fleet": "fleet-secret",
    "site-meter": "meter-secret",
    "viewer": "viewer-secret",
}


# ---- the broker ---------------------------------------------------------------------------


def mosquitto_path() -> str:
    found = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None
    )
    if found is None:
        pytest.fail("mosquitto is not installed: run `make test-services` (apt-get install)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


class Broker:
    """One private mosquitto; start() again after kill() reuses the port (state is lost)."""

    def __init__(
        self,
        root: Path,
        users: dict[str, str] | None = None,
        acl: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.root = root
        self.port = free_port()
        self.users = users
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        lines = [f"listener {self.port} 127.0.0.1", "persistence false", "log_dest stderr"]
        lines.append(f"user {getpass.getuser()}")  # as root, do not drop to `mosquitto`
        if users is not None:
            passwd = root / "passwd"
            passwd.write_text("")
            for name, password in users.items():
                subprocess.run(
                    ["mosquitto_passwd", "-b", str(passwd), name, password],
                    check=True,
                    capture_output=True,
                )
            lines += ["allow_anonymous false", f"password_file {passwd}"]
        else:
            lines.append("allow_anonymous true")
        if acl is not None:
            (root / "acl").write_text(acl)
            lines.append(f"acl_file {root / 'acl'}")
        if tls is not None:
            lines += [
                f"cafile {tls.ca}",
                f"certfile {tls.server_cert}",
                f"keyfile {tls.server_key}",
                "require_certificate true",
            ]
        self.conf = root / "mosquitto.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        self.log = root / "mosquitto.log"

    def start(self, timeout_s: float = WAIT_S) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [mosquitto_path(), "-c", str(self.conf)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"mosquitto did not listen within {timeout_s} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WAIT_S)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=WAIT_S)


# ---- helpers ------------------------------------------------------------------------------


def run(body: Callable[[], Awaitable[None]], timeout_s: float = TEST_TIMEOUT_S) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(body(), timeout_s)

    asyncio.run(bounded())


async def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@dataclass
class Received:
    topic: str
    payload: bytes
    qos: int
    retain: bool

    def json(self) -> Any:
        return json.loads(self.payload)


class Recorder:
    """A subscriber that records every message; wait_for() finds one matching a condition."""

    def __init__(self, broker: Broker, *topics: str, **client_args: Any) -> None:
        self.broker = broker
        self.topics = topics
        self.client_args = client_args
        self.messages: list[Received] = []
        self._new = asyncio.Event()
        self._client: aiomqtt.Client | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Recorder:
        self._client = aiomqtt.Client("127.0.0.1", self.broker.port, **self.client_args)
        await self._client.__aenter__()
        for topic in self.topics:
            await self._client.subscribe(topic, qos=1)
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None and self._client is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._client.__aexit__(None, None, None)

    async def _read(self) -> None:
        assert self._client is not None
        async for m in self._client.messages:
            payload = m.payload if isinstance(m.payload, bytes) else str(m.payload).encode()
            self.messages.append(Received(m.topic.value, payload, m.qos, m.retain))
            self._new.set()

    async def publish(self, topic: str, payload: bytes | str, **kw: Any) -> None:
        assert self._client is not None
        await self._client.publish(topic, payload, qos=1, **kw)

    def on(self, topic: str) -> list[Received]:
        return [m for m in self.messages if m.topic == topic]

    async def wait_for(
        self, topic: str, where: Callable[[Any], bool] = lambda _: True, timeout_s: float = WAIT_S
    ) -> Received:
        """The first message on `topic` whose JSON satisfies `where` (recorded or to come)."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            for m in self.messages[seen:]:
                if m.topic == topic and where(m.json()):
                    return m
            seen = len(self.messages)
            self._new.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                shown = [(m.topic, m.payload[:120]) for m in self.messages[-10:]]
                raise AssertionError(f"no matching message on {topic}; last: {shown}")
            try:
                await asyncio.wait_for(self._new.wait(), left)
            except TimeoutError:
                pass

    async def count(self, topic: str, n: int, timeout_s: float = WAIT_S) -> list[Received]:
        await wait_until(lambda: len(self.on(topic)) >= n, timeout_s)
        return self.on(topic)


def is_status(state: str, reason: str | None = None) -> Callable[[Any], bool]:
    return lambda p: p["state"] == state and (reason is None or p["offline_reason"] == reason)


async def expect_will(broker: Broker, sub: Recorder, status_topic: str, node_id: str) -> None:
    """The broker published the Last Will (`offline`, connection_lost, no phase) and keeps
    it retained for subscribers that come later."""
    will = await sub.wait_for(status_topic, is_status("offline", "connection_lost"))
    status = StatusPayload.model_validate_json(will.payload)
    assert status.node_id == node_id and status.phase is None
    async with Recorder(broker, status_topic) as late:
        retained = await late.wait_for(status_topic)
        assert retained.retain and retained.json()["offline_reason"] == "connection_lost"
