"""What a caller hands the engine and what it gets back, validated at the door.

Plain data: sampling parameters with their checks, the per-request output event, and
the error raised for bad input. No torch, no tokenizer, no scheduling here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

_MIN_SAMPLING_TEMPERATURE = 1e-5

FinishReason = Literal["stop", "length", "abort", "error"]


class InvalidRequestError(ValueError):
    """Bad input, rejected before it reaches the engine. `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings. temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0  # lower is served first

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """Build from a mapping, rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise InvalidRequestError(f"unknown parameter {key!r}", param=key)
        values = dict(values)
        if isinstance(values.get("stop"), str):
            values["stop"] = (values["stop"],)
        for key in ("stop", "stop_token_ids"):
            if key in values and values[key] is not None:
                values[key] = tuple(values[key])
        params = cls(**values)
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        # Temperatures this small make logits / T overflow; they mean greedy anyway.
        return self.temperature < _MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0", param="temperature")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        _check_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        _check_int("priority", self.priority, minimum=-(2**31))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", param="stop")
        if len(self.stop) > 16:
            raise InvalidRequestError("at most 16 stop strings", param="stop")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer", param=name)
    if value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}", param=name)


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number", param=name)


@dataclass
class RequestOutput:
    """One event for one request: new tokens/text, and on the last one why it ended."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
