"""Incremental detokenization with stop strings matched across token boundaries.

Turns one request's token stream into text deltas: a delta is released only once the
bytes decode to whole characters (multi-byte UTF-8 split over tokens waits for its
last piece), and text that could still be the start of a stop string is held back.
It must not decide anything but text: finish reasons belong to the engine.

A token's cost does not grow with the request's history, and only the text not handed out
yet (plus the few characters a stop string could reach back into) is kept. A transformers
fast tokenizer whose decode adds nothing to its tokenizers backend's streams through the
backend's own incremental decoder (tokenizers' DecodeStream: one call a token, ~0.7 us
for SmolLM2's here against ~2.4 us for two window decodes); any other tokenizer decodes a
window of its last few token ids through its decode().
"""

from __future__ import annotations

import functools
from collections.abc import Callable

# Prompt tokens kept as left context so the first generated token decodes with the
# spacing it has in context (sentencepiece tokenizers drop a leading space otherwise).
_CONTEXT_TOKENS = 4


def text_stream(
    tokenizer, context_ids: list[int], skip_special_tokens: bool
) -> Callable[[int], str | None]:
    """step(token_id) -> the text that token completes (None or "": none yet), as
    tokenizer.decode(context_ids + every id so far, skip_special_tokens=...) grows, without
    the context's own text."""
    backend = _backend(tokenizer)
    if backend is not None:
        try:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        except (ImportError, TypeError):  # a tokenizers release without it, or without ids=
            pass
        else:
            return functools.partial(stream.step, backend)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return _WindowDecoder(decode, context_ids).step


class _WindowDecoder:
    """Incremental text through a whole-list decode(): each step decodes the ids since the
    last released text (and the few before them, for context), so its cost stays flat."""

    def __init__(self, decode: Callable[[list[int]], str], context_ids: list[int]) -> None:
        self._decode = decode
        self._ids: list[int] = list(context_ids)
        self._read = len(self._ids)  # ids[:_read] are released (or context)
        # The text of ids[:_read], which only changes when text is released: each step
        # then decodes once, the window with its new token.
        self._before: str | None = None

    def step(self, token_id: int) -> str | None:
        ids = self._ids
        ids.append(token_id)
        before = self._before
        if before is None:
            before = self._before = self._decode(ids[: self._read])
        after = self._decode(ids)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None  # no complete character yet
        # The ids before the window of the next decode are never read again.
        self._ids = ids[self._read :]
        self._read = len(self._ids)
        self._before = None
        return after[len(before) :]


def _backend(tokenizer):
    """The tokenizers library's Tokenizer when the transformers tokenizer's decode is
    exactly its decode (a fast tokenizer with the stock decode and no space clean-up);
    else None."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    if (
        cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not PreTrainedTokenizerFast._decode
    ):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers skips the clean-up for a BPE model unless told to corrupt it.
        skipped = type(backend.model).__name__ == "BPE" and not getattr(
            tokenizer,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            False,
        )
        if not skipped:
            return None
    return backend


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._next_text = text_stream(
            tokenizer, prompt_token_ids[-_CONTEXT_TOKENS:], skip_special_tokens
        )
        # The text so far is text[:_base] (handed out, and too far back for a stop string
        # to reach into) + _buf; _emitted counts the characters handed out.
        self._buf = ""
        self._base = 0
        self._emitted = 0
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._include_stop = include_stop

    @property
    def text_length(self) -> int:
        """Characters of text so far (cut at a stop string once one is found)."""
        return self._base + len(self._buf)

    def add(self, token_id: int) -> bool:
        """Append one token; True when a stop string now appears (text is cut before it, or
        after it with include_stop)."""
        piece = self._next_text(token_id)
        if not piece:
            return False  # no complete character yet
        start = self._base + len(self._buf)
        self._buf += piece
        if not self._stop:
            return False
        base, buf = self._base, self._buf
        window = max(0, start - self._max_stop + 1) - base  # >= 0: see take()
        hits = [(i, s) for i, s in ((buf.find(s, window), s) for s in self._stop) if i >= 0]
        if hits:
            at, stop = min(hits)
            self._buf = buf[: at + (len(stop) if self._include_stop else 0)]
            return True
        return False

    def step(self, token_id: int) -> str | None:
        """add() then take(): the text to send now, or None when a stop string appeared
        (take(final=True) then gives what is left)."""
        if not self._stop and not self._buf:  # nothing held back: text goes out as it comes
            piece = self._next_text(token_id)
            if not piece:
                return ""
            self._base += len(piece)
            self._emitted = self._base
            return piece
        if self.add(token_id):
            return None
        return self.take()

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop - 1, self.text_length), 0, -1):
            tail = self._buf[-k:]  # _buf holds at least the last _max_stop - 1 characters
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def take(self, final: bool = False) -> str:
        """Text not handed out yet; on `final`, everything left."""
        length = self._base + len(self._buf)
        upto = length if final or not self._stop else length - self._holdback()
        if upto <= self._emitted:
            return ""
        base = self._base
        delta = self._buf[self._emitted - base : upto - base]
        self._emitted = upto
        # Keep what a stop string found by a later add() could start in.
        keep_from = max(base, upto - max(0, self._max_stop - 1))
        self._buf = self._buf[keep_from - base :]
        self._base = keep_from
        return delta
