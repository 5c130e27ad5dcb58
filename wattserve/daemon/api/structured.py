"""Structured outputs at the API edge: which constraint a request asks for, by name.

OpenAI's `response_format` (json_object, json_schema) and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` all become one
GuidedDecoding (or None), with the name of the field it came from for error messages.
At most one may be given. Compiling is the engine's Grammars (called off the event loop
by the handler); this module must not compile, generate or format responses.
"""

from __future__ import annotations

import json
from typing import Any

from wattserve.daemon.engine.request import GuidedDecoding, InvalidRequestError


def requested_guide(body: Any) -> tuple[GuidedDecoding, str] | None:
    """(guide, the parameter it came from), or None; InvalidRequestError if several."""
    found: list[tuple[GuidedDecoding, str]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append((GuidedDecoding("json_object"), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        found.append((GuidedDecoding("json", _schema_text(schema)), "response_format"))
    if body.guided_json is not None:
        found.append((GuidedDecoding("json", _schema_text(body.guided_json)), "guided_json"))
    if body.guided_regex is not None:
        found.append((GuidedDecoding("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        found.append((GuidedDecoding("choice", json.dumps(body.guided_choice)), "guided_choice"))
    if body.guided_grammar is not None:
        found.append((GuidedDecoding("grammar", body.guided_grammar), "guided_grammar"))
    so = body.structured_outputs
    if so is not None:
        given = [
            (kind, value)
            for kind, value in (
                ("json", None if so.json_ is None else _schema_text(so.json_)),
                ("regex", so.regex),
                ("choice", None if so.choice is None else json.dumps(so.choice)),
                ("grammar", so.grammar),
                ("json_object", "" if so.json_object else None),
            )
            if value is not None
        ]
        if not given:
            raise InvalidRequestError(
                "structured_outputs needs one of json, regex, choice, grammar, json_object",
                param="structured_outputs",
            )
        found += [(GuidedDecoding(kind, value), "structured_outputs") for kind, value in given]  # type: ignore[arg-type]
    if len(found) > 1:
        names = ", ".join(dict.fromkeys(param for _, param in found))
        raise InvalidRequestError(
            f"give one structured-output constraint, not several ({names})", param=found[1][1]
        )
    return found[0] if found else None


def _schema_text(schema: dict[str, Any] | str | bool) -> str:
    """A schema as JSON text: vLLM also accepts it already serialised."""
    return schema if isinstance(schema, str) else json.dumps(schema)
