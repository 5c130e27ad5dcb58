"""HMAC-SHA256 on fleet messages: what is signed, signing, verifying, and replay checks.

A grant is signed with its node's key by the allocator, a demand by the node with its own
key (docs/fleet.md, *Trust*). The signature covers the topic and every field of the
payload but the signature itself (node id, epoch, issued-at, expires-at included), as
canonical JSON. A KeyRing holds the current key and, during a rotation, the previous
one; either verifies, only the current one signs. Pure: keys and times are passed in;
reading key files is wattserve.fleet.keys's job. It must not log or read a clock.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

# A key shorter than this is too easy to guess offline from one captured message.
MIN_KEY_BYTES = 16

_Signed = TypeVar("_Signed", bound=BaseModel)


@dataclass(frozen=True)
class KeyRing:
    """One node's keys: current signs and verifies; previous (a rotation) only verifies."""

    current: bytes
    previous: bytes | None = None

    def __post_init__(self) -> None:
        for key in (self.current, self.previous):
            if key is not None and len(key) < MIN_KEY_BYTES:
                raise ValueError(f"a fleet key must be at least {MIN_KEY_BYTES} bytes")

    def __repr__(self) -> str:  # never print key material
        return f"KeyRing(previous={'set' if self.previous else 'unset'})"


def canonical_bytes(topic: str, payload: BaseModel) -> bytes:
    """What is signed: the topic and the payload's fields but `sig`, as sorted JSON."""
    fields = payload.model_dump(mode="json", by_alias=True, exclude={"sig"})
    return json.dumps(
        [topic, fields], sort_keys=True, separators=(",", ":"), allow_nan=False
    ).encode()


def _mac(key: bytes, topic: str, payload: BaseModel) -> str:
    return hmac.new(key, canonical_bytes(topic, payload), hashlib.sha256).hexdigest()


def sign(payload: _Signed, topic: str, keys: KeyRing) -> _Signed:
    """The payload with its `sig` set, for publishing on topic."""
    return payload.model_copy(update={"sig": _mac(keys.current, topic, payload)})


def verify(payload: BaseModel, topic: str, keys: KeyRing) -> bool:
    """Whether payload's `sig` is a valid signature for topic under either key."""
    sig = getattr(payload, "sig", "")
    if not isinstance(sig, str) or not sig:
        return False
    candidates = [keys.current] + ([keys.previous] if keys.previous is not None else [])
    # Every key is tried, so the time taken does not say which one matched.
    matches = [hmac.compare_digest(_mac(key, topic, payload), sig) for key in candidates]
    return any(matches)


def freshness_error(
    issued_s: float, expires_s: float, now_s: float, *, skew_s: float, max_life_s: float
) -> str | None:
    """Why a message with this issued-at / expires-at is refused at now_s (the receiver's
    clock), or None: issued in the future beyond the clock skew, already expired, expiring
    before it was issued, or issued longer ago than max_life_s plus the skew."""
    if issued_s > now_s + skew_s:
        return f"issued {issued_s - now_s:.1f} s in the future (skew above {skew_s:g} s)"
    if expires_s <= now_s:
        return "expired"
    if expires_s < issued_s:
        return "expires before it was issued"
    if now_s - issued_s > max_life_s + skew_s:
        return f"issued {now_s - issued_s:.1f} s ago, more than {max_life_s + skew_s:g} s"
    return None
