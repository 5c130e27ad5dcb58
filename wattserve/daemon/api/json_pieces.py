"""JSON text of a large answer, encoded in pieces so that no one call holds the GIL for long.

A whole answer with many choices and logprobs can be tens of megabytes. json.dumps encodes
a value in one C call that never lets another thread run, so even on a worker thread it
would stall the event loop for the whole encoding. Here dicts and lists near the top are
walked in Python and the long lists inside (a choice's tokens, logprobs, alternatives)
are encoded in slices: the interpreter may switch threads between any two pieces. The text
is the same as json.dumps(value, ensure_ascii=False, separators=(",", ":"),
allow_nan=False) gives, which is what Starlette's JSONResponse sends. This module must not
know what an answer means.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# Containers are walked down to this depth (answer -> choices -> choice -> logprobs ->
# their lists); below it, lists are encoded SLICE_ITEMS items at a time.
WALK_DEPTH = 4
SLICE_ITEMS = 256

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_json(value: Any) -> bytes:
    """The compact UTF-8 JSON of value; call it on a worker thread for a large value."""
    return "".join(_pieces(value, 0)).encode()


def _pieces(value: Any, depth: int) -> Iterator[str]:
    if isinstance(value, dict) and depth < WALK_DEPTH:
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            # The encoder would turn a non-string key into its text; answers only use str.
            yield ("," if i else "") + _encoder.encode(str(key)) + ":"
            yield from _pieces(item, depth + 1)
        yield "}"
    elif isinstance(value, list) and depth < WALK_DEPTH:
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _pieces(item, depth + 1)
        yield "]"
    elif isinstance(value, list) and len(value) > SLICE_ITEMS:
        yield "["
        for start in range(0, len(value), SLICE_ITEMS):
            if start:
                yield ","
            yield _encoder.encode(value[start : start + SLICE_ITEMS])[1:-1]
        yield "]"
    else:
        yield _encoder.encode(value)
