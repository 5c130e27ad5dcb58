"""Tool calls read out of generated text, whole or as it streams.

A ToolCallReader is fed one choice's text piece by piece and returns deltas: plain
content, or a tool call (its header with id and name first, then its arguments as JSON
text). The same reader serves non-streamed answers (feed everything, then finish), so
both shapes always agree. Readers:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in
  the text (a JSON list of such objects inside one block is several calls); the text
  outside the blocks is content.
- llama3: the whole answer is one JSON object `{"name": ..., "parameters": {...}}` (or
  several separated by `;`), optionally after `<|python_tag|>`; anything else is content.
- forced (tool_choice names a function): the whole answer is that function's arguments,
  streamed as they come.
- required (tool_choice "required"): the whole answer is a JSON list of
  `{"name", "arguments"}` objects, read when it is complete.

Text that looks like a call but does not parse stays content, so nothing is lost. This
module only reads text: it must not render prompts, build grammars or format responses.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

ParserName = Literal["hermes", "llama3"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallDelta:
    """Part of tool call `index`: the header (id and name set, arguments "") or a piece of
    its arguments (id and name None)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


Delta = ContentDelta | CallDelta


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def calls_from_json(value: Any, argument_keys: tuple[str, ...]) -> list[ToolCall] | None:
    """A decoded call object (or list of them) as ToolCalls; None if it is not one."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = next((item[k] for k in argument_keys if k in item), {})
        if isinstance(args, str):
            try:
                json.loads(args)  # already JSON text (some models quote the arguments)
            except ValueError:
                return None
            text = args
        elif isinstance(args, dict):
            text = json.dumps(args, ensure_ascii=False)
        else:
            return None
        calls.append(ToolCall(new_call_id(), item["name"], text))
    return calls or None


def _parse_calls(text: str, argument_keys: tuple[str, ...]) -> list[ToolCall] | None:
    try:
        return calls_from_json(json.loads(text), argument_keys)
    except ValueError:
        return None


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallReader:
    """Base: numbering of calls and the deltas that announce one."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Delta]:
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        """The deltas still held back once the answer is complete."""
        raise NotImplementedError

    def _emit_call(self, call: ToolCall) -> list[Delta]:
        index = len(self.calls)
        self.calls.append(call)
        return [
            CallDelta(index, call.id, call.name, ""),
            CallDelta(index, None, None, call.arguments),
        ]


class _Content:
    """Content text with its trailing whitespace held back: whitespace that only separates
    calls (or ends the answer) is dropped, so the content is None when there is no text."""

    def __init__(self) -> None:
        self._pending = ""

    def add(self, text: str) -> list[Delta]:
        text = self._pending + text
        body = text.rstrip()
        self._pending = text[len(body) :]
        return [ContentDelta(body)] if body else []

    def take_pending(self) -> str:
        pending, self._pending = self._pending, ""
        return pending


class HermesReader(ToolCallReader):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._in_call = False
        self._content = _Content()
        self._space_before = ""  # whitespace before the open block: kept if it is no call

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while True:
            if not self._in_call:
                start = self._buf.find(HERMES_OPEN)
                if start < 0:
                    keep = _held_prefix(self._buf, HERMES_OPEN)
                    cut = len(self._buf) - keep
                    out += self._content.add(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                out += self._content.add(self._buf[:start])
                self._space_before = self._content.take_pending()
                self._buf = self._buf[start + len(HERMES_OPEN) :]
                self._in_call = True
            end = self._buf.find(HERMES_CLOSE)
            if end < 0:
                return out
            out += self._close(self._buf[:end], closed=True)
            self._buf = self._buf[end + len(HERMES_CLOSE) :]
            self._in_call = False

    def _close(self, body: str, closed: bool) -> list[Delta]:
        calls = _parse_calls(body.strip(), ("arguments", "parameters"))
        if calls is None:
            raw = HERMES_OPEN + body + (HERMES_CLOSE if closed else "")
            return self._content.add(self._space_before + raw)
        return [d for call in calls for d in self._emit_call(call)]

    def finish(self) -> list[Delta]:
        if self._in_call:  # ended (EOS, max_tokens) inside an open block
            out = self._close(self._buf, closed=False)
        else:
            out = self._content.add(self._buf)
        self._buf = ""
        self._in_call = False
        return out


class Llama3Reader(ToolCallReader):
    """Undecided until the first non-blank text: `{` or the python tag means a call."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode: Literal["undecided", "call", "text"] = "undecided"
        self._content = _Content()

    def feed(self, text: str) -> list[Delta]:
        if self._mode == "text":
            return self._content.add(text)
        self._buf += text
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self._mode = "call"
            else:
                self._mode = "text"
                out = self._content.add(self._buf)
                self._buf = ""
                return out
        return []

    def finish(self) -> list[Delta]:
        text, self._buf = self._buf, ""
        if self._mode != "call":
            return self._content.add(text)
        body = text.strip().removeprefix(PYTHON_TAG)
        calls = self._split_calls(body)
        if calls is None:
            return self._content.add(text)
        return [d for call in calls for d in self._emit_call(call)]

    @staticmethod
    def _split_calls(body: str) -> list[ToolCall] | None:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while True:
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
            if pos == len(body):
                return calls or None
            try:
                value, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return None
            found = calls_from_json(value, ("parameters", "arguments"))
            if found is None:
                return None
            calls += found


class ForcedReader(ToolCallReader):
    """The answer is the arguments of one named function (decoded under its schema)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._args: list[str] = []

    def _header(self) -> list[Delta]:
        if self.calls:
            return []
        self.calls.append(ToolCall(new_call_id(), self._name, ""))
        return [CallDelta(0, self.calls[0].id, self._name, "")]

    def feed(self, text: str) -> list[Delta]:
        out = self._header()
        if text:
            self._args.append(text)
            out.append(CallDelta(0, None, None, text))
        return out

    def finish(self) -> list[Delta]:
        out = self._header()
        self.calls[0] = ToolCall(self.calls[0].id, self._name, "".join(self._args))
        return out


class RequiredReader(ToolCallReader):
    """The answer is a JSON list of calls (decoded under the tools' schema), read whole."""

    def __init__(self) -> None:
        super().__init__()
        self._buf: list[str] = []

    def feed(self, text: str) -> list[Delta]:
        self._buf.append(text)
        return []

    def finish(self) -> list[Delta]:
        text = "".join(self._buf)
        self._buf = []
        calls = _parse_calls(text, ("arguments",))
        if calls is None:  # cut short (max_tokens, a stop string): hand back the text
            return [ContentDelta(text)] if text else []
        return [d for call in calls for d in self._emit_call(call)]


def new_reader(parser: ParserName) -> ToolCallReader:
    return HermesReader() if parser == "hermes" else Llama3Reader()


def read_all(reader: ToolCallReader, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole answer."""
    deltas = reader.feed(text) + reader.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    return (content or None), list(reader.calls)
