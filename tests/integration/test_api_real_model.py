"""One chat through the whole stack with the real SmolLM2-135M-Instruct model.

The official openai client asks a question with a one-word answer that this small model
gets right; greedy decoding makes the answer reproducible.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.api_server import api_config, running_server

pytestmark = pytest.mark.real_model


def test_real_model_answers_sensibly(real_model) -> None:
    cfg = api_config(engine={"kv_cache_bytes": 64 << 20, "max_model_len": 1024})
    with running_server(cfg, real_model) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        text = answer.choices[0].message.content
        assert "Paris" in text, text
        assert answer.choices[0].finish_reason in ("stop", "length")
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 32}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def test_real_model_calls_tools(real_model) -> None:
    # SmolLM2's template does not render tools: they reach it through wattserve's system
    # message (api.tools_without_template = "system_message"); forced calls are decoded
    # under the function's schema, and the model fills in the city from the question.
    cfg = api_config(engine={"kv_cache_bytes": 64 << 20, "max_model_len": 2048})
    with running_server(cfg, real_model) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        ask = dict(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER, CLOCK],
            temperature=0,
            max_tokens=60,
        )
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in (named, "required"):
            answer = client.chat.completions.create(tool_choice=choice, **ask).choices[0]
            assert answer.finish_reason == "tool_calls"
            (call,) = answer.message.tool_calls
            assert call.function.name == "get_weather"
            arguments = json.loads(call.function.arguments)
            assert arguments["city"] == "Paris", arguments
            assert arguments["unit"] in ("celsius", "fahrenheit")
        streamed = ""
        for chunk in client.chat.completions.create(tool_choice=named, stream=True, **ask):
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                streamed += delta_call.function.arguments or ""
        assert json.loads(streamed) == arguments
        auto = client.chat.completions.create(**ask).choices[0]
        assert auto.finish_reason in ("stop", "length", "tool_calls")
        assert auto.message.content or auto.message.tool_calls
