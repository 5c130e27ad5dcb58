"""Single writer: which of several allocator instances publishes grants.

A retained claim on `<prefix>/_fleet/leader`, renewed every period by the leader, with an
MQTT 5 message expiry of claim_ttl_s (cleared at a clean stop), is the broker-side lock.
(No Last Will: a dying standby's Will would clear the leader's claim.) A standby
that has seen no live claim for claim_ttl_s publishes its own and waits confirm_s; it leads
only if the last claim the broker delivered (in the broker's order, the same for every
subscriber) is its own. A leader that sees another's newer claim steps down. Pure: times
are passed in; the service publishes and subscribes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    STANDBY = "standby"
    CLAIMING = "claiming"
    LEADER = "leader"


@dataclass(frozen=True)
class LeaderAction:
    publish_claim: bool  # publish (or renew) this instance's claim now
    role: Role


class Leadership:
    def __init__(self, instance_id: str, claim_ttl_s: float, confirm_s: float) -> None:
        if confirm_s <= 0 or claim_ttl_s <= confirm_s:
            raise ValueError("need 0 < confirm_s < claim_ttl_s")
        self.instance_id = instance_id
        self.claim_ttl_s = claim_ttl_s
        self.confirm_s = confirm_s
        self.role = Role.STANDBY
        self._last_claim: tuple[str, float] | None = None  # (instance, received at)
        self._claimed_at_s: float | None = None
        self._listen_until_s = -float("inf")

    def on_connect(self, now_s: float) -> None:
        """A (re)connection: listen for confirm_s first, so that a retained claim that the
        broker is about to deliver is seen before this instance claims for itself."""
        self._listen_until_s = now_s + self.confirm_s

    def on_claim(self, instance_id: str | None, now_s: float) -> None:
        """A claim delivered by the broker (None: cleared, by a Will or an expiry)."""
        self._last_claim = None if instance_id is None else (instance_id, now_s)
        if self.role is Role.LEADER and instance_id not in (None, self.instance_id):
            self.role = Role.STANDBY  # someone else's claim came after ours: step down
            self._claimed_at_s = None

    def tick(self, now_s: float) -> LeaderAction:
        claim = self._last_claim
        if self.role is Role.STANDBY:
            if now_s < self._listen_until_s:
                return LeaderAction(False, self.role)
            other_alive = (
                claim is not None
                and claim[0] != self.instance_id
                and now_s - claim[1] < self.claim_ttl_s
            )
            if other_alive:
                return LeaderAction(False, self.role)
            self.role, self._claimed_at_s = Role.CLAIMING, now_s
            return LeaderAction(True, self.role)
        if self.role is Role.CLAIMING:
            assert self._claimed_at_s is not None
            if now_s - self._claimed_at_s < self.confirm_s:
                return LeaderAction(False, self.role)
            if claim is not None and claim[0] == self.instance_id:
                self.role = Role.LEADER
                return LeaderAction(True, self.role)
            self.role, self._claimed_at_s = Role.STANDBY, None
            return LeaderAction(False, self.role)
        return LeaderAction(True, self.role)  # leader: renew every tick
