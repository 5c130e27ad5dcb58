"""Incremental detokenization with stop strings matched across token boundaries.

Turns one request's token stream into text deltas: a delta is released only once the
bytes decode to whole characters (multi-byte UTF-8 split over tokens waits for its
last piece), and text that could still be the start of a stop string is held back.
It must not decide anything but text: finish reasons belong to the engine.
"""

from __future__ import annotations

# Prompt tokens kept as left context so the first generated token decodes with the
# spacing it has in context (sentencepiece tokenizers drop a leading space otherwise).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""
        self._emitted = 0
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._include_stop = include_stop
        self._skip_special = skip_special_tokens

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> bool:
        """Append one token; True when a stop string now appears (text is cut before it, or
        after it with include_stop)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # no complete character yet
        start = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        if not self._stop:
            return False
        window = max(0, start - self._max_stop + 1)
        hits = [(i, s) for i, s in ((self.text.find(s, window), s) for s in self._stop) if i >= 0]
        if hits:
            at, stop = min(hits)
            self.text = self.text[: at + (len(stop) if self._include_stop else 0)]
            return True
        return False

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def take(self, final: bool = False) -> str:
        """Text not handed out yet; on `final`, everything left."""
        upto = len(self.text) if final else len(self.text) - self._holdback()
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
