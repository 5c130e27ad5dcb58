"""Tools in chat completions on a real server with the tiny random model, through the
official openai client: tool_choice none / auto / required / a named function, streamed
and not, tool turns in the history, and the refusals.

A random model writes no tool call by itself. Forced calls (required, named) are valid
only because they are decoded under the tools' JSON schema: that is what is checked,
over many sampled answers. For "auto" the answer is steered with guided_choice to a text
that holds calls, so that what is checked is the reading of calls out of real output.
The tiny model's template does not render tools (the fallback system message is used);
a second server gets a template that does, in a Llama-3-like format.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import httpx
import jsonschema_rs
import openai
import pytest

from tests.api_server import api_config, running_server
from tests.tiny_model import make_tiny_model_dir

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather at a place.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters
TOOLS = [WEATHER, ADD, PING]
SCHEMAS = {
    t["function"]["name"]: t["function"].get(
        "parameters", {"type": "object", "additionalProperties": False}
    )
    for t in TOOLS
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

# A Llama-3-like template that renders tools and tool turns (written for this test).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}"
    '{% endfor %}\nCall one as <|python_tag|>{"name": ..., "parameters": ...}<|im_end|>\n'
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<|python_tag|>{{ {'name': "
    "c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory, cache_dir):
    """The tiny model with room for tool lists (its byte-level tokenizer is ~1 char/token)."""
    from wattserve.daemon.engine.loader import load_model

    path = make_tiny_model_dir(tmp_path_factory.mktemp("long") / "llama", max_positions=4096)
    return load_model(str(path), cache_dir)


def _config(**sections):
    return api_config(engine={"max_model_len": 4096, "kv_cache_bytes": 32 << 20}, **sections)


@pytest.fixture(scope="module")
def server(tiny_long):
    with running_server(_config(), tiny_long) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tool_template_server(tiny_long):
    tokenizer = copy.deepcopy(tiny_long.tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    loaded = dataclasses.replace(tiny_long, tokenizer=tokenizer)
    with running_server(_config(), loaded) as srv:
        yield srv


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema_rs.validate(SCHEMAS[name], json.loads(arguments))


def _stream_calls(stream) -> dict[int, dict]:
    """choice index -> {content, calls: [{id, name, arguments}], finish}, from the deltas;
    checks that each call's first delta carries id, type and name."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            entry = out.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            entry["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in entry["calls"]:
                    assert d.id and d.type == "function" and d.function.name, d
                    entry["calls"][d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None, d
                entry["calls"][d.index]["arguments"] += d.function.arguments or ""
            if c.finish_reason is not None:
                entry["finish"] = c.finish_reason
    for entry in out.values():
        entry["calls"] = [entry["calls"][i] for i in sorted(entry["calls"])]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_gives_valid_arguments(oai, stream) -> None:
    kwargs = dict(
        model="llama",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        n=8,
        seed=1,
        temperature=1.0,
        max_tokens=100,
    )
    if stream:
        answers = _stream_calls(oai.chat.completions.create(stream=True, **kwargs))
        calls = [(a["calls"], a["finish"]) for a in answers.values()]
    else:
        chat = oai.chat.completions.create(**kwargs)
        calls = [
            (
                [
                    {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                    for t in c.message.tool_calls
                ],
                c.finish_reason,
            )
            for c in chat.choices
        ]
        assert all(c.message.content is None for c in chat.choices)
    assert len(calls) == 8
    for call_list, finish in calls:
        assert finish == "tool_calls"
        assert len(call_list) == 1 and call_list[0]["name"] == "add"
        assert call_list[0]["id"].startswith("call_")
        _check_call("add", call_list[0]["arguments"])
    assert len({c[0][0]["arguments"] for c in calls}) > 1  # sampled, not one answer


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_one_of_the_tools(oai, stream) -> None:
    for parallel in (False, None):
        kwargs = dict(
            model="llama",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            n=8,
            seed=2,
            temperature=1.0,
            max_tokens=300,
        )
        if parallel is not None:
            kwargs["parallel_tool_calls"] = parallel
        if stream:
            answers = list(
                _stream_calls(oai.chat.completions.create(stream=True, **kwargs)).values()
            )
        else:
            chat = oai.chat.completions.create(**kwargs)
            answers = [
                {
                    "calls": [
                        {"name": t.function.name, "arguments": t.function.arguments}
                        for t in c.message.tool_calls or []
                    ],
                    "finish": c.finish_reason,
                }
                for c in chat.choices
            ]
        assert len(answers) == 8
        names = set()
        for a in answers:
            assert a["finish"] == "tool_calls", a
            assert len(a["calls"]) >= 1
            if parallel is False:
                assert len(a["calls"]) == 1
            for call in a["calls"]:
                _check_call(call["name"], call["arguments"])
                names.add(call["name"])
        assert len(names) > 1  # the anyOf lets each tool be chosen


def test_none_leaves_tools_out(oai, client) -> None:
    chat = oai.chat.completions.create(
        model="llama", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, seed=0
    )
    assert chat.choices[0].message.tool_calls is None
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.choices[0].finish_reason in ("stop", "length")
    # The prompt is the one without tools; with "auto" they are listed in it.
    plain = client.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    none = client.post(
        "/tokenize", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    ).json()["count"]
    auto = client.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()["count"]
    assert none == plain
    assert auto > plain + 20
    assert chat.usage.prompt_tokens == plain


AUTO_ANSWER = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
    "\n</tool_call>"
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_calls_out_of_the_answer(oai, stream) -> None:
    kwargs = dict(
        model="llama",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=200,
        extra_body={"guided_choice": [AUTO_ANSWER]},
    )
    if stream:
        (answer,) = _stream_calls(oai.chat.completions.create(stream=True, **kwargs)).values()
        content, calls, finish = answer["content"], answer["calls"], answer["finish"]
    else:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [
            {"name": t.function.name, "arguments": t.function.arguments}
            for t in choice.message.tool_calls
        ]
    assert content == "Checking."
    assert finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather", "add"]
    assert [json.loads(c["arguments"]) for c in calls] == [
        {"city": "Paris", "unit": "c"},
        {"a": 1, "b": 2},
    ]


def test_auto_without_a_call_is_plain_content(oai) -> None:
    for stream in (False, True):
        kwargs = dict(
            model="llama",
            messages=MESSAGES,
            tools=TOOLS,
            max_tokens=50,
            extra_body={"guided_choice": ["It is sunny <tool_c"]},
        )
        if stream:
            (answer,) = _stream_calls(oai.chat.completions.create(stream=True, **kwargs)).values()
            assert answer["calls"] == [] and answer["finish"] == "stop"
            assert answer["content"] == "It is sunny <tool_c"
        else:
            choice = oai.chat.completions.create(**kwargs).choices[0]
            assert choice.message.tool_calls is None and choice.finish_reason == "stop"
            assert choice.message.content == "It is sunny <tool_c"


def test_history_with_tool_turns_is_accepted(oai, client) -> None:
    first = oai.chat.completions.create(
        model="llama",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        seed=4,
    )
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [
        *MESSAGES,
        message,  # the client's own message object, sent back as it is
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = oai.chat.completions.create(
        model="llama", messages=history, tools=TOOLS, max_tokens=8, seed=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The fallback renders the call and the result as text the model can read.
    dumped = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in history]
    ids = client.post("/tokenize", json={"messages": dumped, "tools": TOOLS}).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert f'"name": "get_weather", "arguments": {call.function.arguments}' in text


def test_template_with_tools_renders_them_and_reads_llama3_calls(tool_template_server) -> None:
    oai = openai.OpenAI(
        base_url=tool_template_server.base_url + "/v1", api_key="unused", max_retries=0
    )
    with httpx.Client(base_url=tool_template_server.base_url, timeout=60) as client:
        history = [
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ]
        ids = client.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
        text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "Tools:" + json.dumps(WEATHER) in text  # through the template,
    assert "<tools>" not in text  # not the fallback
    assert '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}' in text
    answer = '<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}}'
    for stream in (False, True):
        kwargs = dict(
            model="llama",
            messages=history,
            tools=TOOLS,
            max_tokens=100,
            extra_body={"guided_choice": [answer]},
        )
        if stream:
            (got,) = _stream_calls(oai.chat.completions.create(stream=True, **kwargs)).values()
            calls, content, finish = got["calls"], got["content"] or None, got["finish"]
        else:
            choice = oai.chat.completions.create(**kwargs).choices[0]
            content, finish = choice.message.content, choice.finish_reason
            calls = [
                {"name": t.function.name, "arguments": t.function.arguments}
                for t in choice.message.tool_calls
            ]
        assert content is None and finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("add", {"a": 5, "b": 6})
        ]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", None),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", None),
        ({"tools": [WEATHER, WEATHER]}, "tools", None),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "no-such-type"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "invalid_grammar",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            None,
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, None, None),
        ({"tool_choice": "sometimes"}, None, None),
        (
            {"messages": [*MESSAGES, {"role": "tool", "content": "3"}]},  # no tool_call_id
            None,
            None,
        ),
        ({"messages": [{"role": "assistant", "content": None}]}, None, None),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, None, None),
    ],
)
def test_bad_tool_requests_are_400(client, body, param, code) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **body},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_refuse_config_gives_tools_unsupported(tiny_long) -> None:
    cfg = _config(api={"tools_without_template": "refuse"})
    with running_server(cfg, tiny_long) as srv, httpx.Client(base_url=srv.base_url) as client:
        for choice in ("auto", "required", {"type": "function", "function": {"name": "add"}}):
            r = client.post(
                "/v1/chat/completions",
                json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice},
            )
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "tools_unsupported"
            assert r.json()["error"]["param"] == "tools"
        ok = client.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2},
        )
        assert ok.status_code == 200
