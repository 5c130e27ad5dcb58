"""What a caller hands the engine and what it gets back, validated at the door.

Plain data: sampling parameters with their checks, the per-request output event, and
the error raised for bad input. No torch, no tokenizer, no scheduling here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Literal

_MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows

FinishReason = Literal["stop", "length", "abort", "error"]
GuideKind = Literal["json", "json_object", "regex", "choice", "grammar"]
_GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class InvalidRequestError(ValueError):
    """Bad input, rejected before it reaches the engine. `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class GuidedDecoding:
    """A structured-output constraint (wattserve/daemon/engine/grammar.py compiles it).

    value: the JSON schema as JSON text ("json"), the regex ("regex"), the choices as a
    JSON list of strings ("choice"), Lark or GBNF ("grammar"); empty for "json_object".
    compiled: the matcher Grammars.compile made for it, carried so that queueing the request
    never compiles again (a cache eviction meanwhile would do it on the caller's thread).
    """

    kind: GuideKind
    value: str = ""
    compiled: object = field(default=None, compare=False, repr=False)


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
    # Logit processing, applied before temperature (see wattserve/daemon/engine/logits.py).
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # >1 discourages prompt and output tokens (CTRL); 1 off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many are generated
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob + top k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided: GuidedDecoding | None = None  # structured outputs: tokens outside it are masked

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
        if isinstance(values.get("logit_bias"), dict):
            values["logit_bias"] = tuple((int(k), v) for k, v in values["logit_bias"].items())
        params = cls(**values)
        params.validate()
        return params

    # The three below are read for every row of every step: each is worked out once (a
    # cached_property writes the instance's __dict__, which a frozen dataclass allows).
    @functools.cached_property
    def penalized(self) -> bool:
        """True when any penalty changes the logits (rows without one skip that work)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @functools.cached_property
    def greedy(self) -> bool:
        # Temperatures this small make logits / T overflow; they mean greedy anyway.
        return self.temperature < _MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @functools.cached_property
    def processes_logits(self) -> bool:
        """True when logits.process may change this row (penalties, logit_bias, min_tokens)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2]", param=name)
        _check_float("repetition_penalty", self.repetition_penalty)
        # Bounded away from 0: logits divided by a denormal penalty overflow to inf.
        if not 0.01 <= self.repetition_penalty <= 10.0:
            raise InvalidRequestError(
                "repetition_penalty must be in [0.01, 10]", param="repetition_penalty"
            )
        for t, bias in self.logit_bias:
            _check_int("logit_bias", t, minimum=0)
            _check_float("logit_bias", bias)
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", param="min_p")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens must be <= max_tokens", param="min_tokens")
        if self.guided is not None:
            if self.guided.kind not in _GUIDE_KINDS:
                raise InvalidRequestError(f"unknown guide kind {self.guided.kind!r}", "guided")
            if self.min_tokens:
                # The grammar may allow only EOS where min_tokens bans it: nothing is left.
                raise InvalidRequestError(
                    "min_tokens cannot be combined with structured outputs", param="min_tokens"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise InvalidRequestError(f"{name} must be <= {MAX_LOGPROBS}", param=name)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer", param=name)
    if value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}", param=name)


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number", param=name)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability (natural log) and its top alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    # One entry per token in token_ids, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # On the first event of a request that asked: one entry per prompt token, None first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
