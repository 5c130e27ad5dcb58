"""PUT /v1/control/knobs stays within the configured bounds: [engine] caps and the decode
pacing bound, refused with an OpenAI-shaped 400 naming the param before anything changes.
A real daemon on loopback (tiny random Llama, virtual GPU in observe mode)."""

from __future__ import annotations

import httpx
import pytest

from tests.api_server import api_config, running_server
from wattserve.daemon.config import ConfigError, load_config
from wattserve.daemon.engine.scheduler import DECODE_INTERVAL_MAX_MS, EngineLimits

TOKEN = "knobs-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def refused(r: httpx.Response, param: str, key: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == "above_configured_bound"
    assert key in error["message"]


def test_knobs_above_the_configured_caps_are_refused_and_change_nothing(tiny_llama) -> None:
    cfg = api_config(
        engine={"max_num_seqs": 8, "max_num_batched_tokens": 128},
        controller={"decode_interval_max_ms": 200.0},
        device={"backend": "virtual"},
    )
    with running_server(cfg, tiny_llama, environ={"WATTSERVE_API_TOKEN": TOKEN}) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=30, headers=AUTH) as client:
            before = client.get("/v1/control/knobs").json()
            assert (before["max_num_seqs"], before["max_num_batched_tokens"]) == (8, 128)
            put = client.put
            refused(
                put("/v1/control/knobs", json={"max_num_seqs": 9}),
                "max_num_seqs",
                "engine.max_num_seqs",
            )
            r = put("/v1/control/knobs", json={"max_num_batched_tokens": 129})
            refused(r, "max_num_batched_tokens", "engine.max_num_batched_tokens")
            r = put("/v1/control/knobs", json={"decode_interval_ms": 200.5})
            refused(r, "decode_interval_ms", "controller.decode_interval_max_ms")
            # Refused as a whole: the valid parts of the body are not applied either.
            r = put("/v1/control/knobs", json={"quant_level": "bf16", "max_num_seqs": 64})
            refused(r, "max_num_seqs", "engine.max_num_seqs")
            assert client.get("/v1/control/knobs").json() == before
            assert srv.engine.quant_status()["requested"] == before["quant_level"]

            # At the bounds: accepted.
            r = put("/v1/control/knobs", json={"max_num_seqs": 8, "decode_interval_ms": 200})
            assert r.status_code == 200, r.text
            assert srv.engine.limits.decode_interval_ms == 200.0


def test_the_engine_itself_refuses_a_decode_interval_that_could_starve_the_watchdog() -> None:
    assert EngineLimits(8, 128, DECODE_INTERVAL_MAX_MS).decode_interval_ms == DECODE_INTERVAL_MAX_MS
    for bad in (DECODE_INTERVAL_MAX_MS + 1, 60_000.0, float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="decode_interval_ms"):
            EngineLimits(8, 128, bad)


def test_the_configured_pacing_bound_cannot_exceed_the_engine_s() -> None:
    with pytest.raises(ConfigError, match="controller.decode_interval_max_ms"):
        load_config(None, {"controller": {"decode_interval_max_ms": DECODE_INTERVAL_MAX_MS + 1}})
