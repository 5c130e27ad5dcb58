"""Fleet signing keys and signed messages for the fleet tests (docs/fleet.md, *Trust*)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wattserve.daemon.mqtt.payloads import DemandPayload, GrantPayload, Topics
from wattserve.fleet.signing import KeyRing, sign


def key_of(node: str) -> bytes:
    """A fixed test key per node: 64 hex characters."""
    return (node.encode().hex() * 64)[:64].encode()


def write_key(root: Path, node: str, key: bytes | None = None, mode: int = 0o600) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{node}.key"
    path.write_bytes((key if key is not None else key_of(node)) + b"\n")
    path.chmod(mode)
    return path


def ring(node: str) -> KeyRing:
    return KeyRing(key_of(node))


def signed_grant(node: str, key: bytes | None = None, prefix: str = "wattserve", **fields: Any):
    """A GrantPayload for node signed for its grant topic (with key, else node's own)."""
    topic = Topics.for_node(prefix, node).grant
    payload = GrantPayload(node_id=fields.pop("node_id", node), **fields)
    return sign(payload, topic, KeyRing(key if key is not None else key_of(node)))


def signed_demand(node: str, now_s: float, epoch: int, key: bytes | None = None, **fields: Any):
    """A DemandPayload for node, issued at now_s, valid 3 s, signed for its demand topic."""
    topic = Topics.for_node("wattserve", node).demand
    base: dict[str, Any] = dict(
        node_id=node,
        epoch=epoch,
        issued_at_unix_s=now_s,
        expires_at_unix_s=now_s + 3.0,
        need_w=300.0,
        goodput_per_w=1.0,
        floor_w=150.0,
        ceiling_w=700.0,
        power_w=300.0,
    )
    payload = DemandPayload(**{**base, **fields})
    return sign(payload, topic, KeyRing(key if key is not None else key_of(node)))
