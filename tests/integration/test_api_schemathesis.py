"""Property-based run of schemathesis against the app's own OpenAPI schema.

Valid and invalid requests are generated for every operation and sent to a real server
(tiny model, short context so any accepted generation is short). Checks: no 5xx, every
status documented, every body and content type as the schema says. The number of
examples is bounded so the run stays well under a minute.
"""

from __future__ import annotations

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

from daemon.api.app import create_app
from daemon.api.state import ServingState
from daemon.config import load_config
from tests.api_server import api_config, running_server

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
