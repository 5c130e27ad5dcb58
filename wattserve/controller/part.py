"""The base of every guard and timescale: the limits (with the tuning) and the learned
models each one reads. It holds no state of its own; each part keeps its state in its own
dataclass. It must not import torch or the daemon, read a clock, or touch a device or an
engine.
"""

from __future__ import annotations

from wattserve.controller.learner import Learner
from wattserve.controller.limits import Limits


class Part:
    """Read-only references for a guard or a timescale (params are the limits' params)."""

    def __init__(self, limits: Limits, learner: Learner) -> None:
        self.params = limits.params
        self.limits = limits
        self.learner = learner

    def near_engine_cap(self, running: int) -> bool:
        """A running batch that fills guard_cap_share of the engine's largest max_num_seqs:
        once the cap is full every arrival queues for a slot."""
        return (
            running
            >= self.params.latency_guard.guard_cap_share * self.limits.engine.max_num_seqs_max
        )
