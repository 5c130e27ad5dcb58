"""Engine logprobs (TokenLogprob) in OpenAI's response shapes: chat and completions.

Token strings are each id decoded on its own; `bytes` are their UTF-8 bytes. A logprob of
-inf (a banned token) is sent as -9999.0, since JSON has no infinity. It must not compute
probabilities (the engine does) nor assemble whole responses (openai.py does).
"""

from __future__ import annotations

import math
from typing import Any

from wattserve.daemon.engine.request import TokenLogprob

_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


class TokenText:
    """Token id -> its text, cached for one response."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def chat_content(entries: list[TokenLogprob], text: TokenText) -> list[dict[str, Any]]:
    """choices[].logprobs.content entries, one per token."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": _value(logprob), "bytes": list(s.encode())}

    return [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
        for e in entries
    ]


class CompletionLogprobs:
    """Builds completions' {tokens, token_logprobs, top_logprobs, text_offset}; keeps the
    running text offset across the chunks of one choice."""

    def __init__(self, text: TokenText, offset: int = 0) -> None:
        self._text = text
        self.offset = offset

    def block(self, entries: list[TokenLogprob | None], token_ids: list[int]) -> dict[str, Any]:
        """entries[i] is token_ids[i]'s logprob, or None (an echoed prompt's first token)."""
        tokens, values, tops, offsets = [], [], [], []
        for tid, e in zip(token_ids, entries, strict=True):
            s = self._text(tid)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
            if e is None:
                values.append(None)
                tops.append(None)
            else:
                values.append(_value(e.logprob))
                tops.append({self._text(t): _value(lp) for t, lp in e.top})
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
