"""Structured outputs: compile a request's guide into a grammar and mask logits by it.

Built on llguidance (chosen over xgrammar by wattserve/bench/grammar.py: xgrammar 0.2.9 let raw
control characters into length-bounded JSON strings; docs/api.md has the figures).
Grammars compiles a GuidedDecoding (JSON schema, any JSON object, regex, choice list,
Lark or GBNF grammar) for the served tokenizer, raising InvalidRequestError for what it cannot
compile; callers compile off the event loop. GrammarState is one request's matcher: the
engine thread fills its next-token bitmask, masks the row (disallowed -> -inf; EOS only
where the grammar may end) and advances it with the sampled token. This module must not
sample, schedule, or look at text beyond the grammar.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from wattserve.daemon.engine.request import GuidedDecoding, InvalidRequestError

CACHED_GRAMMARS = 64  # compiled matchers kept for reuse (copied per sequence)
# Compact JSON with json.dumps' separators and no free whitespace: a model that likes
# spaces could otherwise pad an answer until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """Grammar compilation for one tokenizer; thread-safe. The tokenizer table (~1 s on
    a 49k vocabulary) is built at the first compile, on the caller's thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: frozenset[int],
        cache_size: int = CACHED_GRAMMARS,
    ) -> None:
        self._tokenizer = tokenizer
        self.cache_size = cache_size
        self.vocab_size = vocab_size
        eos = getattr(tokenizer, "eos_token_id", None)
        self._eos = eos if isinstance(eos, int) else min(stop_token_ids, default=None)
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._executor: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _tok(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
                self._executor = llguidance.LLExecutor()
            return self._lltok

    def compile(self, guide: GuidedDecoding, param: str) -> Any:
        """A matcher at the start of the guide's grammar (kept for copying);
        InvalidRequestError naming `param` when the library cannot compile the guide."""
        key = (guide.kind, guide.value)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        import llguidance

        tok = self._tok()
        try:
            grammar = _grammar_text(llguidance.LLMatcher, guide)
        except ValueError as e:
            raise _invalid(guide, param, str(e)) from None
        try:
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        except (ValueError, RuntimeError) as e:
            raise _invalid(guide, param, str(e)) from None
        if matcher.is_error():
            raise _invalid(guide, param, matcher.get_error())
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def state(self, guide: GuidedDecoding) -> GrammarState:
        """A fresh matcher for one sequence (a copy of the compiled one). A guide that
        carries its compiled matcher is never compiled here: callers on the event loop
        compile off it first (the cache may have evicted the grammar since)."""
        compiled = guide.compiled
        if compiled is None:
            compiled = self.compile(guide, "response_format")
        return GrammarState(compiled.deep_copy())  # type: ignore[attr-defined]

    def fill_masks(self, states: list[GrammarState | None]) -> torch.Tensor | None:
        """[N, ceil(V/32)] int32 bitmask for a step's sampled rows (all ones where a row
        has no grammar), or None when no row has one. Engine thread only."""
        rows = [(s.matcher, i) for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        import llguidance.torch

        # The library writes host memory; apply_masks moves the mask to the logits' device.
        bitmask = torch.full(
            (len(states), (self.vocab_size + 31) // 32), -1, dtype=torch.int32, device="cpu"
        )
        llguidance.torch.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        return bitmask


def _grammar_text(matcher_cls: Any, guide: GuidedDecoding) -> str:
    if guide.kind == "json":
        return matcher_cls.grammar_from_json_schema(guide.value, defaults=_JSON_OPTIONS)
    if guide.kind == "json_object":
        return matcher_cls.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if guide.kind == "regex":
        return matcher_cls.grammar_from_regex(guide.value)
    if guide.kind == "choice":
        choices = json.loads(guide.value)
        # Lark string literals take JSON's escapes.
        return matcher_cls.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        )
    # "grammar": Lark (llguidance's dialect) or GBNF (llama.cpp's, as vLLM's xgrammar
    # backend takes it), which llguidance converts to Lark.
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(guide.value)
    except Exception as e:  # the converter's parse errors have no common base class
        raise ValueError(f"not a Lark or GBNF grammar: {e}") from None
    return matcher_cls.grammar_from_lark(lark)


def _invalid(guide: GuidedDecoding, param: str, reason: str) -> InvalidRequestError:
    reason = reason.strip().splitlines()[0] if reason.strip() else "invalid grammar"
    return InvalidRequestError(
        f"cannot compile the {guide.kind.replace('_', ' ')} constraint: {reason}",
        param=param,
        code="invalid_grammar",
    )


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def advance(self, token_id: int) -> bool:
        """Feed the sampled token; False when the grammar rejects it."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def terminated(self) -> bool:
        """Nothing may follow (the grammar is complete, or it took EOS)."""
        return bool(self.matcher.is_stopped())


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """logits: [N, V] float32; bitmask: [N, W] int32 (bit j of word w: token 32w + j may
    follow). Disallowed tokens become -inf; a new tensor (the input is left as it was)."""
    if bitmask is None:
        return logits
    n, vocab = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    allowed = bits.reshape(n, -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # a model vocabulary padded past the tokenizer's
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return logits.masked_fill(~allowed, -float("inf"))
