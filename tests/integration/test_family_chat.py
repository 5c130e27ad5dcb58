"""Each served model family's chat template through /v1/chat/completions (issue 49).

One tiny random-weight model per family (tests/tiny_model.py, tests/tiny_moe_model.py),
its tokenizer trained with the family's turn markers as special tokens and saved with the
family's chat template as chat_template.jinja (tests/data/chat_templates/, each naming the
real template it follows), loaded by the engine's loader and served in process, one server
per family. What is checked against transformers' apply_chat_template on the fixture:
- the prompt the server tokenized is the template's, id for id, and its usage counts it;
- a system turn: rendered as the template renders it, or (Gemma 2, whose template refuses
  it) a 400 naming the system role, after which the server still answers;
- tools: rendered by the template where it reads them (Qwen3's Hermes list, Llama 3.1's
  JSON list), else listed by the server's fallback system text (folded into the first user
  turn where the template refuses a system turn); a forced call comes back as tool_calls,
  and an answer in the family's call format is read by the family's parser;
- an image content part (Gemma 3 checkpoints carry a vision tower, which is not served)
  gets an OpenAI-shaped 400 naming images, and the next text request is served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest

from tests.api_server import api_config, running_server
from tests.tiny_model import CHAT_TEMPLATE, build_tokenizer, make_family_dir
from tests.tiny_moe_model import make_tiny_moe_dir

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
MAX_POSITIONS = 2048  # room for a tool list: the test tokenizer is ~1 token a character


@dataclass(frozen=True)
class FamilyChat:
    template: str  # file under tests/data/chat_templates
    specials: tuple[str, ...]  # the family's turn markers, special tokens of the tokenizer
    bos: str | None  # None: the test tokenizer's own
    eos: str
    renders_tools: bool  # the template reads `tools`
    tool_answer: str  # an answer calling add(a=5, b=6) in the format the parser reads


HERMES_ANSWER = '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 6}}\n</tool_call>'
LLAMA3_ANSWER = '{"name": "add", "parameters": {"a": 5, "b": 6}}'
GEMMA = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
TULU = ("<|system|>", "<|user|>", "<|assistant|>")
FAMILIES: dict[str, FamilyChat] = {
    "llama": FamilyChat(
        "llama3.jinja",
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        True,
        LLAMA3_ANSWER,
    ),
    "qwen3": FamilyChat("qwen3.jinja", (), None, "<|im_end|>", True, HERMES_ANSWER),
    "gemma2": FamilyChat("gemma2.jinja", GEMMA, "<bos>", "<end_of_turn>", False, HERMES_ANSWER),
    "gemma3": FamilyChat("gemma3.jinja", GEMMA, "<bos>", "<end_of_turn>", False, HERMES_ANSWER),
    "phi3": FamilyChat("phi3.jinja", (*TULU, "<|end|>"), None, "<|end|>", False, HERMES_ANSWER),
    "olmo2": FamilyChat(
        "olmo2.jinja", TULU, "<|endoftext|>", "<|endoftext|>", False, HERMES_ANSWER
    ),
    "granite": FamilyChat(
        "granite.jinja",
        ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
        "<|end_of_text|>",
        "<|end_of_text|>",
        False,
        HERMES_ANSWER,
    ),
    "mixtral": FamilyChat("mixtral.jinja", ("<s>", "</s>"), "<s>", "</s>", False, HERMES_ANSWER),
    # Qwen3-30B-A3B ships Qwen3's template.
    "qwen3_moe": FamilyChat("qwen3.jinja", (), None, "<|im_end|>", True, HERMES_ANSWER),
}
# Families whose template refuses a system turn (the others render or fold it).
REFUSES_SYSTEM = {"gemma2"}

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
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
CHAT = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi, how can i help"},
    {"role": "user", "content": "What is 5 plus 6?"},
]
SYSTEM = {"role": "system", "content": "You answer in one word."}


@dataclass
class Served:
    family: str
    spec: FamilyChat
    template: str
    tokenizer: Any
    client: httpx.Client

    def expected_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """transformers' rendering of the fixture template, tokenized."""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )

    def chat(self, **body) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json={"model": self.family, **body})

    def prompt_ids(self, **body) -> list[int]:
        response = self.client.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    def prompt_text(self, **body) -> str:
        ids = self.prompt_ids(**body)
        return self.client.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def _model_dir(root: Path, family: str, spec: FamilyChat) -> Path:
    tok = build_tokenizer(extra_special=spec.specials)
    if spec.bos is not None:
        tok.bos_token = spec.bos
    tok.eos_token = spec.eos
    tok.chat_template = None  # the template is the fixture file, as checkpoints ship it
    if family in ("mixtral", "qwen3_moe"):
        path = make_tiny_moe_dir(root, family, layers=2, tokenizer=tok, max_positions=MAX_POSITIONS)
    else:
        name = "llama-llama3" if family == "llama" else family
        path = make_family_dir(root, name, tokenizer=tok, max_position_embeddings=MAX_POSITIONS)
    (path / "chat_template.jinja").write_text((TEMPLATES / spec.template).read_text())
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory, cache_dir):
    from wattserve.daemon.engine.loader import load_model

    family = request.param
    spec = FAMILIES[family]
    path = _model_dir(tmp_path_factory.mktemp("chat") / family, family, spec)
    loaded = load_model(str(path), cache_dir)
    template = (TEMPLATES / spec.template).read_text()
    assert loaded.tokenizer.chat_template == template  # the loader read the fixture
    cfg = api_config(
        engine={
            "served_model_name": family,
            "max_model_len": MAX_POSITIONS,
            "kv_cache_bytes": 16 << 20,
        }
    )
    with (
        running_server(cfg, loaded) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as client,
    ):
        yield Served(family, spec, template, loaded.tokenizer, client)


def test_chat_is_rendered_with_the_family_template(served) -> None:
    expected = served.expected_ids(CHAT)
    chatml = served.tokenizer.apply_chat_template(
        CHAT, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, return_dict=False
    )
    # Qwen3's template is ChatML, like the test tokenizer's own, until tools or thinking
    # come in; every other family's differs from it.
    assert (expected == chatml) == (served.spec.template == "qwen3.jinja")
    assert served.prompt_ids(messages=CHAT) == expected
    response = served.chat(messages=CHAT, max_tokens=4, temperature=0)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    assert answer["usage"]["prompt_tokens"] == len(expected)
    assert 1 <= answer["usage"]["completion_tokens"] <= 4


def test_a_system_turn_is_rendered_or_refused_as_the_template_does(served) -> None:
    messages = [SYSTEM, *CHAT]
    try:
        expected = served.expected_ids(messages)
    except jinja2.TemplateError as e:
        expected, refusal = None, str(e)
    assert (expected is None) == (served.family in REFUSES_SYSTEM)
    response = served.chat(messages=messages, max_tokens=2)
    if expected is None:
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        assert refusal in error["message"] and "System role" in refusal
        response = served.chat(messages=CHAT, max_tokens=2)  # still serving
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(expected)
        # Gemma 3 and Mixtral fold it into the first user turn; the others give it a turn.
        assert served.prompt_text(messages=messages).count(SYSTEM["content"]) == 1


def test_tools_are_rendered_by_the_template_or_the_fallback(served) -> None:
    with_tools = served.expected_ids(CHAT, tools=[ADD])
    response = served.chat(messages=CHAT, tools=[ADD], max_tokens=2)
    assert response.status_code == 200, response.text
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    text = served.prompt_text(messages=CHAT, tools=[ADD])
    assert '"name": "add"' in text
    if served.spec.renders_tools:
        assert with_tools != served.expected_ids(CHAT)
        assert prompt_tokens == len(with_tools)
    else:
        # The template ignores tools: the server lists them itself, in Hermes format.
        assert with_tools == served.expected_ids(CHAT)
        assert "<tools>\n" + json.dumps(ADD) + "\n</tools>" in text
        assert prompt_tokens > len(with_tools) + len(json.dumps(ADD)) // 4
    if served.family in REFUSES_SYSTEM:
        # Only the server's own tool list is folded into the user turn; a system turn the
        # request sent is still refused, as without tools.
        refused = served.chat(messages=[SYSTEM, *CHAT], tools=[ADD], max_tokens=2)
        assert refused.status_code == 400
        assert "System role not supported" in refused.json()["error"]["message"]


def _calls(answer: dict) -> list[tuple[str, dict]]:
    message = answer["choices"][0]["message"]
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]


def test_forced_and_answered_calls_come_back_as_tool_calls(served) -> None:
    forced = served.chat(
        messages=CHAT,
        tools=[ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=100,
        seed=3,
    )
    assert forced.status_code == 200, forced.text
    ((name, arguments),) = _calls(forced.json())
    assert name == "add" and set(arguments) == {"a", "b"}
    assert all(isinstance(v, int) and -99 <= v <= 99 for v in arguments.values())
    assert forced.json()["choices"][0]["finish_reason"] == "tool_calls"
    # "auto": an answer in the family's own call format, read by its parser.
    auto = served.chat(
        messages=CHAT, tools=[ADD], max_tokens=100, guided_choice=[served.spec.tool_answer]
    )
    assert auto.status_code == 200, auto.text
    assert _calls(auto.json()) == [("add", {"a": 5, "b": 6})]
    assert auto.json()["choices"][0]["message"]["content"] is None
    assert auto.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_an_image_part_is_refused_and_serving_goes_on(served) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    content = [{"type": "text", "text": "What is in this picture?"}, image]
    response = served.chat(messages=[{"role": "user", "content": content}], max_tokens=2)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages.0.content.1.type"
    assert "image inputs are not supported" in error["message"]
    response = served.chat(messages=CHAT, max_tokens=2)
    assert response.status_code == 200, response.text
