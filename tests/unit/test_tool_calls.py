"""Tool-call readers (wattserve/daemon/api/tools.py): what they read out of text, whole or in
pieces, and that every way of cutting the text into pieces gives the same answer."""

from __future__ import annotations

import json

import pytest

from wattserve.daemon.api.tools import (
    CallDelta,
    ContentDelta,
    ForcedReader,
    HermesReader,
    Llama3Reader,
    RequiredReader,
    read_all,
)


def _fed(reader, pieces: list[str]) -> tuple[str | None, list[tuple[str, dict]]]:
    """Content and (name, arguments) as a streaming client would assemble them."""
    deltas = [d for p in pieces for d in reader.feed(p)] + reader.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta)) or None
    calls: dict[int, list] = {}
    for d in deltas:
        if isinstance(d, CallDelta):
            if d.index not in calls:
                assert d.id is not None and d.id.startswith("call_") and d.name
                assert d.arguments == ""  # the header comes first, alone
                calls[d.index] = [d.name, ""]
            else:
                assert d.id is None and d.name is None
                calls[d.index][1] += d.arguments
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


def _whole(reader, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = read_all(reader, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


HERMES_CASES = [
    ("Hello there.", ("Hello there.", [])),
    (
        'Let me look.\n<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>\n',
        ("Let me look.", [("w", {"city": "Oslo"})]),
    ),
    (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>[{"name": "b", "arguments": {"x": 1}}, {"name": "c", "parameters": {}}]'
        "</tool_call>",
        (None, [("a", {}), ("b", {"x": 1}), ("c", {})]),
    ),
    # Arguments already as JSON text; a block left open at the end still counts.
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": [1]}"}', (None, [("a", {"k": [1]})])),
    # Not a call: kept as content, whitespace and all.
    ("x <tool_call>{broken</tool_call> y", ("x <tool_call>{broken</tool_call> y", [])),
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),
    ("a <tool_ca", ("a <tool_ca", [])),
    ("2 < 3 <tool", ("2 < 3 <tool", [])),
]


@pytest.mark.parametrize(("text", "expected"), HERMES_CASES)
def test_hermes_reader(text, expected) -> None:
    assert _whole(HermesReader(), text) == expected
    for cut in range(len(text) + 1):
        assert _fed(HermesReader(), [text[:cut], text[cut:]]) == expected, cut
    assert _fed(HermesReader(), list(text)) == expected


LLAMA3_CASES = [
    ('{"name": "f", "parameters": {"x": 1}}', (None, [("f", {"x": 1})])),
    (
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": "z"}}',
        (None, [("f", {}), ("g", {"y": "z"})]),
    ),
    ("  The answer is 4.", ("  The answer is 4.", [])),
    ('{"not": "a call"}', ('{"not": "a call"}', [])),
    ('{"name": "f", "parameters": {"x": ', ('{"name": "f", "parameters": {"x":', [])),
]


@pytest.mark.parametrize(("text", "expected"), LLAMA3_CASES)
def test_llama3_reader(text, expected) -> None:
    assert _whole(Llama3Reader(), text) == expected
    for cut in range(len(text) + 1):
        assert _fed(Llama3Reader(), [text[:cut], text[cut:]]) == expected, cut


def test_forced_reader_streams_the_arguments() -> None:
    reader = ForcedReader("add")
    first = reader.feed("")
    assert len(first) == 1 and first[0].name == "add" and first[0].arguments == ""
    assert reader.feed('{"a": ') == [CallDelta(0, None, None, '{"a": ')]
    reader.feed("1}")
    assert reader.finish() == []
    assert [(c.name, c.arguments) for c in reader.calls] == [("add", '{"a": 1}')]
    assert reader.calls[0].id == first[0].id
    empty = ForcedReader("f")  # no text at all (cut at once): still one call, no arguments
    assert [d.name for d in empty.finish()] == ["f"]
    assert [(c.name, c.arguments) for c in empty.calls] == [("f", "")]


def test_required_reader_reads_the_list_whole() -> None:
    text = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    reader = RequiredReader()
    assert reader.feed(text[:10]) == [] and reader.feed(text[10:]) == []
    content, calls = _fed(RequiredReader(), [text])
    assert (content, calls) == (None, [("a", {"x": 1}), ("b", {})])
    # Cut short (max_tokens): no call, the text comes back as content.
    assert _fed(RequiredReader(), [text[:20]]) == (text[:20], [])


def test_call_ids_are_unique() -> None:
    text = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "a", "arguments": {}}]</tool_call>'
    _, calls = read_all(HermesReader(), text)
    assert len({c.id for c in calls}) == 2
