"""Per-sender message rate limits for the allocator: one token bucket per node.

Pure: the time is passed in. It must not log or drop anything itself: it only answers
whether a message is within its sender's rate, and counts those that were not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    time_s: float
    dropped: int = 0


class RateLimiter:
    """rate_per_s messages a second per key on average, bursts of up to burst."""

    def __init__(self, rate_per_s: float, burst: float) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("need rate_per_s > 0 and burst >= 1")
        self.rate_per_s, self.burst = rate_per_s, burst
        self._buckets: dict[str, _Bucket] = {}

    def allow(self, key: str, now_s: float) -> bool:
        """Take one token from key's bucket; False (and counted) when it is empty."""
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(self.burst, now_s)
        # A clock that stepped back refills nothing (and takes nothing away).
        b.tokens = min(self.burst, b.tokens + max(0.0, now_s - b.time_s) * self.rate_per_s)
        b.time_s = max(b.time_s, now_s)
        if b.tokens >= 1:
            b.tokens -= 1
            return True
        b.dropped += 1
        return False

    def take_dropped(self, key: str) -> int:
        """Messages dropped for key since the last call."""
        b = self._buckets.get(key)
        if b is None:
            return 0
        dropped, b.dropped = b.dropped, 0
        return dropped
