"""The attached server seen as the engine the control loop steers (its SteerableEngine).

Its queues and token counters are the last scrape's; its one knob is the front's admission
cap (max_num_seqs), and only when the front is on. Quantization is not offered: the
server's weights are its own, and switching them would mean restarting it. It must not
fetch metrics itself (the runner hands it each scrape) nor decide anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wattserve.attach.admission import Admission

QUANT_LEVEL = "native"
QUANT_NOT_OFFERED = (
    "quantization is not offered by attach: the server loaded its own weights, and a "
    "switch would restart it"
)


@dataclass(frozen=True)
class AttachedLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_interval_ms: float = 0.0


@dataclass(frozen=True)
class AttachedCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)


class AttachedEngine:
    """The server's queues and counters, and the admission cap when there is a front."""

    def __init__(
        self, admission: Admission | None, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.admission = admission
        self._limits = AttachedLimits(max_num_seqs, max_num_batched_tokens)
        self.num_running = 0
        self.num_waiting = 0
        self.counters = AttachedCounters()

    @property
    def limits(self) -> AttachedLimits:
        return self._limits

    def set_limits(
        self,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        decode_interval_ms: float | None = None,
    ) -> AttachedLimits:
        """Only max_num_seqs acts (the front's cap); the server's batch size is its own."""
        if max_num_seqs is not None:
            self._limits = AttachedLimits(max_num_seqs, self._limits.max_num_batched_tokens)
            if self.admission is not None:
                self.admission.set_max_num_seqs(max_num_seqs)
        return self._limits

    @property
    def quant_level(self) -> str:
        return QUANT_LEVEL

    def set_quant_level(self, level: str) -> str:
        if level != QUANT_LEVEL:
            raise ValueError(QUANT_NOT_OFFERED)
        return QUANT_LEVEL

    def observe(
        self, running: float, waiting: float, prompt_tokens: float, generation_tokens: float
    ) -> None:
        """The latest scrape (counters as the loop accumulates them across restarts)."""
        self.num_running = int(round(running))
        self.num_waiting = int(round(waiting))
        self.counters = AttachedCounters(int(prompt_tokens), int(generation_tokens))
