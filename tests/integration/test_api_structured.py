"""Structured outputs on a real server with the tiny random model, through the official
openai client: response_format (json_object, json_schema) and vLLM's guided_* and
structured_outputs names, streamed and not.

A random model writes nothing valid by itself, so every valid answer here is the grammar's
doing; the schemas are bounded (maxLength, enums, ranges, maxItems) so that each answer
completes well inside max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import jsonschema_rs
import openai
import pytest

from tests.api_server import api_config, running_server
from wattserve.daemon.engine.grammar import CACHED_GRAMMARS

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "kind": {"enum": ["cat", "dog", "bird"]},
        },
        "required": ["name", "age", "kind"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "digits": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 4,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["digits", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "visible": {"type": "boolean"},
                },
                "required": ["x", "visible"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["point", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "status": {"const": "ok"},
            "code": {"type": "integer", "minimum": 100, "maximum": 599},
            "note": {"type": ["string", "null"], "maxLength": 5},
        },
        "required": ["status", "code", "note"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
            "choice": {"anyOf": [{"type": "boolean"}, {"enum": ["x", "y"]}]},
        },
        "required": ["id", "choice"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(api_config(engine={"max_model_len": 512}), tiny_llama) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server):
    return server.engine.model_name


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


MESSAGES = [{"role": "user", "content": "Describe it as JSON."}]


def _streamed_completion_texts(stream) -> dict[int, tuple[str, str | None]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return {i: (texts[i], reasons.get(i)) for i in texts}


def test_100_generations_under_5_schemas_all_validate(oai, model) -> None:
    answers: list[tuple[int, str, str | None]] = []
    for i, schema in enumerate(SCHEMAS):
        chat = oai.chat.completions.create(
            model=model,
            messages=MESSAGES,
            n=10,
            seed=i,
            temperature=1.0,
            max_tokens=200,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"schema_{i}", "schema": schema, "strict": True},
            },
        )
        answers += [(i, c.message.content, c.finish_reason) for c in chat.choices]
        # vLLM's two spellings, through completions, streamed.
        extra = {"guided_json": schema} if i % 2 else {"structured_outputs": {"json": schema}}
        stream = oai.completions.create(
            model=model,
            prompt="JSON:",
            n=10,
            seed=100 + i,
            temperature=1.0,
            max_tokens=200,
            stream=True,
            extra_body=extra,
        )
        answers += [(i, t, r) for t, r in _streamed_completion_texts(stream).values()]
    assert len(answers) == 100
    texts = set()
    for i, text, reason in answers:
        assert reason == "stop", (i, text)
        jsonschema_rs.validate(SCHEMAS[i], json.loads(text))
        texts.add(text)
    assert len(texts) > 20  # sampled, not one answer repeated


def test_json_object_is_parseable(oai, model, tiny_llama) -> None:
    # Favour the tokens that close strings and objects so that a random model finishes.
    tok = tiny_llama.tokenizer
    closing = {str(t): 30 for s in ('"', "}") for t in tok.encode(s, add_special_tokens=False)}
    for stream in (False, True):
        kwargs = dict(
            model=model,
            messages=MESSAGES,
            n=8,
            seed=3,
            temperature=1.0,
            max_tokens=300,
            logit_bias=closing,
            response_format={"type": "json_object"},
        )
        if stream:
            texts: dict[int, str] = {}
            for chunk in oai.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            outputs = list(texts.values())
        else:
            chat = oai.chat.completions.create(**kwargs)
            assert {c.finish_reason for c in chat.choices} == {"stop"}
            outputs = [c.message.content for c in chat.choices]
        assert len(outputs) == 8
        for text in outputs:
            assert isinstance(json.loads(text), dict), text


def test_guided_choice_returns_one_of_the_choices(oai, model) -> None:
    choices = ["yes", "no", "maybe not", "日本語"]
    comp = oai.completions.create(
        model=model,
        prompt="Answer:",
        n=12,
        seed=1,
        temperature=1.0,
        max_tokens=50,
        extra_body={"guided_choice": choices},
    )
    got = [c.text for c in comp.choices]
    assert all(t in choices for t in got), got
    assert {c.finish_reason for c in comp.choices} == {"stop"}
    chat = oai.chat.completions.create(
        model=model,
        messages=MESSAGES,
        n=4,
        max_tokens=50,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.message.content in choices for c in chat.choices)


def test_guided_regex_matches(oai, model) -> None:
    # [0-9], not \d: the grammar's \d is Unicode's (Unicode 16: e.g. U+1CCF4, an outlined
    # digit, which Python 3.11's re, on Unicode 14, does not call a digit).
    pattern = r"[a-z]{2,5}-[0-9]{3}( [A-Z]+)?"
    comp = oai.completions.create(
        model=model,
        prompt="Code:",
        n=12,
        seed=2,
        temperature=1.0,
        max_tokens=60,
        extra_body={"guided_regex": pattern},
    )
    for c in comp.choices:
        assert c.finish_reason == "stop"
        assert re.fullmatch(pattern, c.text), c.text


@pytest.mark.parametrize(
    "grammar",
    [
        'start: ("yes" | "no") " " NUM\nNUM: /[0-9]{1,3}/',  # Lark
        'root ::= ("yes" | "no") " " [0-9] [0-9]? [0-9]?',  # GBNF
    ],
)
def test_guided_grammar_in_lark_or_gbnf(oai, model, grammar) -> None:
    comp = oai.completions.create(
        model=model,
        prompt="Say:",
        n=8,
        seed=4,
        temperature=1.0,
        max_tokens=20,
        extra_body={"guided_grammar": grammar},
    )
    for c in comp.choices:
        assert c.finish_reason == "stop"
        assert re.fullmatch(r"(yes|no) [0-9]{1,3}", c.text), c.text


def test_logprobs_are_those_of_the_constrained_distribution(oai, model) -> None:
    # One token can follow: its probability under the mask is 1 whatever the model says.
    comp = oai.completions.create(
        model=model,
        prompt="x",
        max_tokens=5,
        logprobs=3,
        extra_body={"guided_choice": ["a"]},
    )
    lp = comp.choices[0].logprobs
    assert comp.choices[0].text == "a"
    assert lp.token_logprobs[0] == pytest.approx(0.0, abs=1e-5)
    top = lp.top_logprobs[0]
    assert top["a"] == pytest.approx(0.0, abs=1e-5)
    # Masked tokens are -inf, sent as -9999.0 like any banned token.
    assert all(v == -9999.0 for t, v in top.items() if t != "a")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}},
                }
            },
            "response_format",
        ),
        ({"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_grammar": 'root ::= ( "a"'}, "guided_grammar"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
        ({"guided_regex": "a", "min_tokens": 2}, "min_tokens"),
    ],
)
def test_a_constraint_that_cannot_be_compiled_is_a_400(client, body, param) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_openai_client_sees_the_400(oai, model) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=model,
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"$ref": "#/nowhere"}},
            },
        )
    assert "cannot compile" in str(info.value)


def test_schema_fields_reach_openapi(client) -> None:
    spec = client.get("/openapi.json").json()
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice"):
        assert name in props
    assert "structured_outputs" in props


def test_grammar_compiles_are_bounded_and_never_run_on_the_loop(server) -> None:
    """Six requests with six regexes at once: at most server.max_concurrent_grammar_compiles
    compile together (each is held at a gate until the test has looked), /health answers
    meanwhile, and with a one-grammar cache (every queueing finds its grammar evicted) no
    compilation runs on the server's event-loop thread."""
    grammars = server.engine.grammars
    bound = server.daemon.state.cfg.server.max_concurrent_grammar_compiles
    real_compile = grammars.compile
    gate = threading.Event()
    lock = threading.Lock()
    seen = {"active": 0, "peak": 0}
    threads: set[str] = set()

    def held_compile(guide, param):
        with lock:
            threads.add(threading.current_thread().name)
            seen["active"] += 1
            seen["peak"] = max(seen["peak"], seen["active"])
        try:
            gate.wait(60)
            return real_compile(guide, param)
        finally:
            with lock:
                seen["active"] -= 1

    grammars.compile = held_compile
    grammars.cache_size = 1
    try:
        results = asyncio.run(_grammar_burst(server, gate, seen, bound))
    finally:
        del grammars.compile
        grammars.cache_size = CACHED_GRAMMARS
    health_status, answers = results
    assert health_status == 200
    assert seen["peak"] == bound, seen
    assert "in-process-daemon" not in threads, threads  # the daemon's loop thread
    for k, r in answers:
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert re.fullmatch(f"a{{{k}}}", choice["message"]["content"]), choice


async def _grammar_burst(server, gate: threading.Event, seen: dict[str, int], bound: int):
    async def ask(client: httpx.AsyncClient, k: int):
        body = {"messages": MESSAGES, "guided_regex": f"a{{{k}}}", "n": 2, "max_tokens": 12}
        return k, await client.post("/v1/chat/completions", json=body)

    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        tasks = [asyncio.create_task(ask(client, k)) for k in range(1, 7)]
        for _ in range(3000):
            if seen["active"] >= bound:
                break
            await asyncio.sleep(0.02)
        health = await client.get("/health")
        await asyncio.sleep(0.5)  # the other four reach the bound and wait there
        gate.set()
        return health.status_code, await asyncio.gather(*tasks)
