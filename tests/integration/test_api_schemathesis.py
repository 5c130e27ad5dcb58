"""Property-based run of schemathesis against the app's own OpenAPI schema.

Valid and invalid requests are generated for every operation and sent to a real server
(tiny model, short context so any accepted generation is short). Checks: no 5xx, every
status documented, every body and content type as the schema says. The number of
examples is bounded so the run stays well under a minute.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api_server import api_config, running_server
from wattserve.daemon.api.app import create_app
from wattserve.daemon.api.state import ServingState
from wattserve.daemon.config import load_config

TOKEN = "schemathesis-token"
MAX_EXAMPLES = 25


@pytest.fixture(scope="module")
def prop_server(tiny_llama):
    cfg = api_config(
        engine={"max_model_len": 64, "default_max_tokens": 8}, server={"max_body_bytes": 256 * 1024}
    )
    with running_server(cfg, tiny_llama, environ={"WATTSERVE_API_TOKEN": TOKEN}) as srv:
        yield srv


# The document the app serves at /openapi.json; it does not depend on the model.
schema = schemathesis.openapi.from_dict(
    create_app(ServingState(load_config(None, {}), api_token=None)).openapi()
)


def _with_tools(raw: dict[str, Any], tool_choice: str) -> dict[str, Any]:
    """The schema with `tools` (non-empty) and `tool_choice` required in chat requests, so
    that every generated chat request exercises them (optional fields are often left out).
    A named choice would almost never name a generated tool, and a structured-output field
    next to a forced call is a 400 (tests/integration/test_api_tools.py checks both), so
    here tool_choice is fixed (one run per value: generation would keep to the first value
    of an enum) and those fields are left out, so that requests reach generation."""
    doc = copy.deepcopy(raw)
    body = doc["components"]["schemas"]["ChatCompletionRequest"]
    props = body["properties"]
    props["tools"] = {**props["tools"]["anyOf"][0], "minItems": 1}
    props["tool_choice"] = {"const": tool_choice}
    for name in (
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    ):
        del props[name]
    body["required"] = [*body["required"], "tools", "tool_choice"]
    return doc


def _tools_schema(tool_choice: str) -> Any:
    raw = _with_tools(schema.raw_schema, tool_choice)
    return schemathesis.openapi.from_dict(raw).include(path="/v1/chat/completions")


@pytest.fixture(scope="module")
def tools_server(tiny_llama):
    # Room for the tool list in the prompt (the tiny tokenizer is ~1 char/token).
    cfg = api_config(
        engine={"max_model_len": 512, "default_max_tokens": 8},
        server={"max_body_bytes": 256 * 1024},
    )
    with running_server(cfg, tiny_llama) as srv:
        yield srv


def _check(case: Any, server: Any) -> None:
    case.call_and_validate(
        base_url=server.base_url,
        timeout=30,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )


_TOOLS_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    database=None,
)


@_tools_schema("auto").parametrize()
@_TOOLS_SETTINGS
def test_chat_with_tools_auto_conforms(case, tools_server) -> None:
    _check(case, tools_server)


@_tools_schema("required").parametrize()
@_TOOLS_SETTINGS
def test_chat_with_tools_required_conforms(case, tools_server) -> None:
    _check(case, tools_server)


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure here reproduces
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_api_conforms_to_its_schema(case, prop_server) -> None:
    case.call_and_validate(
        base_url=prop_server.base_url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )


def test_property_run_uses_the_served_schema(prop_server) -> None:
    served = httpx.get(prop_server.base_url + "/openapi.json").json()
    assert served == schema.raw_schema
