"""bench quant's speed table as the quantization timescale reads it: the order in which
levels are tried (the fastest measured decode first, then the lightest weights), which
level it ranks faster than another, and whose prefill it measured much slower. An order
and a veto only: what the controller keeps is decided from its own measurements. Pure:
it must not import torch or the daemon, read a clock, or touch a device or an engine.
"""

from __future__ import annotations

from wattserve.controller.policy import QuantOption


class SpeedTable:
    def __init__(self, options: tuple[QuantOption, ...]) -> None:
        self._levels = {o.level: o for o in options}

    def order(self, level: str) -> tuple[float, int]:
        """The sort key: minus the decode speed (0.0: not in the table), weight bytes."""
        opt = self._levels.get(level)
        speed = opt.decode_tok_s if opt is not None and opt.decode_tok_s else 0.0
        return (-speed, opt.weight_bytes if opt is not None else 0)

    def faster(self, level: str, than: str) -> bool:
        """The table ranks `level` faster than `than`, or has no speed for it."""
        return self.order(level)[0] < self.order(than)[0] or self.order(level)[0] == 0.0

    def measured_faster(self, level: str, than: str) -> bool:
        """The table has decode speeds for both and ranks `level` faster."""
        mine, theirs = self.order(level)[0], self.order(than)[0]
        return mine < 0.0 and theirs < 0.0 and mine < theirs

    def prefill_slower(self, level: str, than: str, factor: float) -> bool:
        """Whether the table's prefill speed of `level` is below `than`'s by more than
        `factor` (False where either is not in the table)."""
        mine, theirs = self._levels.get(level), self._levels.get(than)
        if mine is None or theirs is None or not mine.prefill_tok_s or not theirs.prefill_tok_s:
            return False
        return theirs.prefill_tok_s > factor * mine.prefill_tok_s
