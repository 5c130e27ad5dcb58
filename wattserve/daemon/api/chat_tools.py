"""Tools in a chat request: the prompt they render into, the grammar of a forced call,
and the reader that parses the answer.

plan_tools() turns `tools`, `tool_choice` and `parallel_tool_calls` into a ToolPlan:
- the prompt: the tool list goes to the chat template (`apply_chat_template(tools=...)`);
  a template that does not use `tools` gets, by default (`api.tools_without_template =
  "system_message"`), a system message written here that lists the tools and asks for
  Hermes-style `<tool_call>` blocks; with "refuse" such a request is a 400. With
  tool_choice "none" the tools are left out of the prompt, so the model cannot call one.
- the grammar: a named function is decoded under its parameters' JSON schema (the answer
  is the arguments); "required" under a list of `{"name", "arguments"}` objects, anyOf
  over the tools (at most one item with `parallel_tool_calls: false`).
- the reader (wattserve/daemon/api/tools.py): for "auto", `api.tool_parser` or, with "auto", the
  format the template shows (Llama 3's python tag or `"parameters"` key, else Hermes).
template_messages() turns the request's messages, tool calls and results included, into
what the template takes; for a template that refuses a system turn (Gemma 2), the tool
list's system message is folded into the first user turn (fold_tool_system).
This module must not generate, compile grammars or parse text.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from wattserve.daemon.api.schemas import (
    AssistantTurn,
    ChatCompletionRequest,
    ChatMessage,
    TokenizeChatRequest,
    ToolDefinition,
    ToolTurn,
)
from wattserve.daemon.api.tools import (
    HERMES_CLOSE,
    HERMES_OPEN,
    PYTHON_TAG,
    ForcedReader,
    ParserName,
    RequiredReader,
    ToolCallReader,
    new_reader,
)
from wattserve.daemon.config import ApiConfig
from wattserve.daemon.engine.request import GuidedDecoding, InvalidRequestError

Mode = Literal["none", "auto", "required", "named"]

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    renders_tools: bool  # the template in use reads `tools` (and tool messages)
    template_tools: list[dict[str, Any]] | None  # for apply_chat_template(tools=...)
    system_text: str | None  # the tool list as a system message (template without tools)
    guide: GuidedDecoding | None  # forced calls
    parser: ParserName
    forced_name: str | None

    def new_reader(self) -> ToolCallReader | None:
        """A reader for one choice's answer; None when no call can be in it."""
        if self.mode == "none":
            return None
        if self.mode == "named":
            assert self.forced_name is not None
            return ForcedReader(self.forced_name)
        if self.mode == "required":
            return RequiredReader()
        return new_reader(self.parser)


def template_source(tokenizer: Any, with_tools: bool) -> str | None:
    """The chat template rendering would use (a tool_use variant when tools are given)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.get_chat_template(tools=[{}] if with_tools else None)
    except ValueError:
        return None


@functools.lru_cache(maxsize=16)
def template_uses_tools(source: str) -> bool:
    """True when the template reads the `tools` variable (so it renders them)."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError:  # a tag of transformers' own (e.g. {% generation %})
        return re.search(r"\btools\b", source) is not None


def _template_parser(source: str | None) -> ParserName:
    if source and HERMES_OPEN not in source and (PYTHON_TAG in source or '"parameters"' in source):
        return "llama3"
    return "hermes"


def plan_tools(
    body: ChatCompletionRequest | TokenizeChatRequest, tokenizer: Any, cfg: ApiConfig
) -> ToolPlan:
    """The request's tool plan; InvalidRequestError for what cannot be served."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidRequestError(f"two tools are named {dup!r}", param="tools")
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    mode: Mode = "named" if not isinstance(choice, str) else choice  # type: ignore[assignment]
    forced_name = None if isinstance(choice, str) else choice.function.name
    if mode in ("required", "named") and not tools:
        raise InvalidRequestError(
            "tool_choice requires a function but no tools were given", param="tool_choice"
        )
    if forced_name is not None and forced_name not in names:
        raise InvalidRequestError(
            f"tool_choice names {forced_name!r}, which is not in tools", param="tool_choice"
        )
    offered = bool(tools) and mode != "none"
    source = template_source(tokenizer, with_tools=offered)
    renders = source is not None and template_uses_tools(source)
    if not offered:
        return ToolPlan("none", renders, None, None, None, "hermes", None)
    if not renders and cfg.tools_without_template == "refuse":
        raise InvalidRequestError(
            "this model's chat template does not render tools (api.tools_without_template "
            '= "refuse"); use tool_choice "none"',
            param="tools",
            code="tools_unsupported",
        )
    parser: ParserName
    if cfg.tool_parser != "auto":
        parser = cfg.tool_parser
    else:
        parser = _template_parser(source) if renders else "hermes"
    openai_tools = [t.model_dump(exclude_none=True) for t in tools]
    return ToolPlan(
        mode=mode,
        renders_tools=renders,
        template_tools=openai_tools if renders else None,
        system_text=None if renders else _system_text(tools),
        guide=_forced_guide(tools, forced_name, body.parallel_tool_calls)
        if mode != "auto"
        else None,
        parser=parser,
        forced_name=forced_name,
    )


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS


def _forced_guide(
    tools: list[ToolDefinition], forced_name: str | None, parallel: bool | None
) -> GuidedDecoding:
    if forced_name is not None:
        tool = next(t for t in tools if t.function.name == forced_name)
        return GuidedDecoding("json", json.dumps(_parameters(tool)))
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if parallel is False:
        schema["maxItems"] = 1
    return GuidedDecoding("json", json.dumps(schema))


def _system_text(tools: list[ToolDefinition]) -> str:
    listed = "\n".join(
        json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools
    )
    return (
        "You may call the functions listed below (one JSON schema per line) when they help:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "For each call, write a block on its own:\n"
        f'{HERMES_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
        f"{HERMES_CLOSE}\n"
        "If no function is needed, answer in plain text."
    )


def _arguments_value(arguments: str) -> Any:
    """Templates index the arguments as a mapping; OpenAI sends them as JSON text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_messages(messages: list[ChatMessage], plan: ToolPlan) -> list[dict[str, Any]]:
    """Messages as the chat template takes them. A template that does not render tools
    gets past calls as `<tool_call>` text and results as user `<tool_response>` text."""
    renders_tools = plan.renders_tools
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if isinstance(m, AssistantTurn) and m.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _arguments_value(c.function.arguments)}
                for c in m.tool_calls
            ]
            if renders_tools:
                out.append(
                    {
                        "role": "assistant",
                        "content": text,
                        "tool_calls": [
                            {"id": c.id, "type": "function", "function": f}
                            for c, f in zip(m.tool_calls, calls, strict=True)
                        ],
                    }
                )
            else:
                blocks = [
                    f"{HERMES_OPEN}\n{json.dumps(f, ensure_ascii=False)}\n{HERMES_CLOSE}"
                    for f in calls
                ]
                out.append({"role": "assistant", "content": "\n".join([text, *blocks]).strip()})
        elif isinstance(m, ToolTurn):
            if renders_tools:
                entry = {"role": "tool", "content": text, "tool_call_id": m.tool_call_id}
                if m.name:
                    entry["name"] = m.name
                out.append(entry)
            else:
                out.append(
                    {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
                )
        else:
            out.append({"role": role, "content": text})
    if plan.system_text is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + plan.system_text}
        else:
            out.insert(0, {"role": "system", "content": plan.system_text})
    return out


def fold_tool_system(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]] | None:
    """The messages with the plan's own tool-list system turn (the request sent none)
    folded into the first user turn, as templates without a system role do themselves;
    None when the first turn is not that one, or no user turn follows it."""
    if plan.system_text is None or len(messages) < 2:
        return None
    first, second = messages[0], messages[1]
    if first != {"role": "system", "content": plan.system_text} or second["role"] != "user":
        return None
    merged = {**second, "content": f"{plan.system_text}\n\n{second['content']}"}
    return [merged, *messages[2:]]
