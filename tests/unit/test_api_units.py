"""Unit tests of the API's pieces that need no server: bodies, errors, admission, token, Host."""

from __future__ import annotations

import math

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from wattserve.controller.schema import PolicyModel as Policy
from wattserve.daemon.api.app import create_app
from wattserve.daemon.api.errors import validation_error_response
from wattserve.daemon.api.middleware import host_without_port
from wattserve.daemon.api.schemas import ChatCompletionRequest, CompletionRequest, KnobsUpdate
from wattserve.daemon.api.state import Phase, ServingState, Unavailable, resolve_api_token
from wattserve.daemon.config import ConfigError, load_config


def _param_of(exc: ValidationError) -> str:
    response = validation_error_response(RequestValidationError(exc.errors()))
    import json

    body = json.loads(response.body)
    assert response.status_code == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["param"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": math.nan}, "temperature"),
        ({"prompt": "x", "temperature": math.inf}, "temperature"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "stop": ""}, "stop"),
        ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "x", "length_penalty": 0.5}, "length_penalty"),
        ({"prompt": "x", "max_token": 3}, "max_token"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a"] * 17}, "prompt"),
        ({"prompt": [-1]}, "prompt.0"),
        ({}, "prompt"),
    ],
)
def test_completion_body_errors_name_the_param(body: dict, param: str) -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    assert _param_of(e.value) == param


def test_completion_prompt_forms() -> None:
    assert CompletionRequest(prompt="hi").prompt_inputs() == ["hi"]
    assert CompletionRequest(prompt=["hi", "yo"]).prompt_inputs() == ["hi", "yo"]
    assert CompletionRequest(prompt=[1, 2]).prompt_inputs() == [[1, 2]]
    assert CompletionRequest(prompt=[[3, 4], [5]]).prompt_inputs() == [[3, 4], [5]]
    # vLLM's beam-search extras pass at their "off" values: its clients send them so.
    req = CompletionRequest(
        prompt="x", use_beam_search=False, length_penalty=1.0, early_stopping=False, best_of=1
    )
    assert req.stop_tuple == ()
    assert CompletionRequest(prompt="x", stop="END").stop_tuple == ("END",)


def test_chat_body() -> None:
    req = ChatCompletionRequest(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        max_completion_tokens=5,
        max_tokens=9,
    )
    assert req.messages[0].text() == "ab"
    assert (req.max_new_tokens, req.max_tokens_param) == (5, "max_completion_tokens")
    for bad, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages.0"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools.0.function",
        ),
    ]:
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest.model_validate(bad)
        assert _param_of(e.value) == param, bad


def test_control_bodies() -> None:
    Policy(power_budget_w=300, ttft_slo_ms=1000, tpot_slo_ms=100, mode="auto")
    with pytest.raises(ValidationError):
        Policy(power_budget_w=-1, ttft_slo_ms=1000, tpot_slo_ms=100, mode="auto")
    with pytest.raises(ValidationError):
        Policy(power_budget_w=math.inf, ttft_slo_ms=1000, tpot_slo_ms=100, mode="auto")
    with pytest.raises(ValidationError):
        Policy(power_budget_w=300, ttft_slo_ms=1000, tpot_slo_ms=100, mode="turbo")
    with pytest.raises(ValidationError):
        KnobsUpdate(max_num_seqs=0)


class _FakeLimits:
    max_num_seqs = 2


class _FakeEngine:
    limits = _FakeLimits()
    fault = None  # the loop thread is alive


def test_admission_states() -> None:
    cfg = load_config(None, {"server": {"max_waiting_requests": 1}})
    state = ServingState(cfg, api_token=None)
    with pytest.raises(Unavailable) as e:
        state.admit()
    assert e.value.reason == "not_ready"
    state.engine = _FakeEngine()  # type: ignore[assignment]
    state.phase = Phase.READY
    for _ in range(3):  # running cap 2 + 1 waiting
        state.admit()
    with pytest.raises(Unavailable) as e:
        state.admit()
    assert e.value.reason == "overloaded" and e.value.retry_after_s >= 1
    state.release(e2e_s=7.2)
    state.admit()  # the freed slot is taken again: full once more
    with pytest.raises(Unavailable) as e:
        state.admit()
    assert e.value.retry_after_s == 8  # about one mean request latency (7.2 s), rounded up
    state.phase = Phase.DRAINING
    with pytest.raises(Unavailable) as e:
        state.admit()
    assert e.value.reason == "draining"


def test_api_token_sources(tmp_path) -> None:
    cfg = load_config(None, {})
    assert resolve_api_token(cfg, {}) is None
    assert resolve_api_token(cfg, {"WATTSERVE_API_TOKEN": "abc"}) == "abc"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    cfg = load_config(None, {"server": {"api_token_file": str(token_file)}})
    assert resolve_api_token(cfg, {}) == "from-file"
    cfg = load_config(
        None, {"server": {"api_token": "from-config", "api_token_file": str(token_file)}}
    )
    assert resolve_api_token(cfg, {}) == "from-config"
    with pytest.raises(ConfigError, match="empty"):
        resolve_api_token(cfg, {"WATTSERVE_API_TOKEN": "  "})
    missing = load_config(None, {"server": {"api_token_file": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="api_token_file"):
        resolve_api_token(missing, {})


def test_host_without_port() -> None:
    assert host_without_port("LocalHost:8000") == "localhost"
    assert host_without_port("[::1]:8000") == "[::1]"
    assert host_without_port("127.0.0.1") == "127.0.0.1"
    assert host_without_port("") == ""


def test_openapi_documents_400_and_error_body_not_422() -> None:
    app = create_app(ServingState(load_config(None, {}), api_token=None))
    schema = app.openapi()
    ops = [op for item in schema["paths"].values() for op in item.values()]
    assert ops and all("422" not in op["responses"] for op in ops)
    assert all(op["responses"]["default"]["content"]["application/json"] for op in ops)
    assert "ErrorResponse" in schema["components"]["schemas"]
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
        "/v1/status",
        "/v1/control/policy",
        "/v1/control/knobs",
    } <= set(schema["paths"])


def test_docs_can_be_turned_off() -> None:
    app = create_app(ServingState(load_config(None, {"server": {"docs_enabled": False}}), None))
    assert app.openapi_url is None and app.docs_url is None


def test_loop_delivery_crosses_to_the_loop_once_per_step():
    import asyncio
    import threading

    from wattserve.daemon.api.generation import LoopDelivery
    from wattserve.daemon.engine.request import RequestOutput

    loop = asyncio.new_event_loop()
    crossings = []
    real = loop.call_soon_threadsafe

    def counting(callback, *args):
        crossings.append(callback)
        return real(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    got: dict[str, list[str]] = {"a": [], "b": []}
    on_loop: list[bool] = []

    def sink_for(name):
        def sink(out: RequestOutput) -> None:
            on_loop.append(threading.current_thread() is threading.main_thread())
            got[name].append(out.text)

        return sink

    def broken(out: RequestOutput) -> None:
        raise RuntimeError("a sink's bug")

    step = [
        (sink_for("a"), RequestOutput("a", [1], "x")),
        (broken, RequestOutput("c", [9], "?")),  # costs the others nothing
        (sink_for("b"), RequestOutput("b", [2], "y")),
        (sink_for("a"), RequestOutput("a", [3], "z", finished=True)),
    ]
    worker = threading.Thread(target=LoopDelivery(loop), args=(step,))
    worker.start()
    worker.join()
    assert len(crossings) == 1 and not got["a"]  # one hop for the whole step, nothing run yet
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    assert got == {"a": ["x", "z"], "b": ["y"]} and on_loop == [True, True, True]
    LoopDelivery(loop)(step)  # a closed loop: the engine thread hears nothing


def test_a_stream_event_queue_keeps_order_and_survives_a_cancelled_get():
    import asyncio

    from wattserve.daemon.api.generation import EventQueue

    async def scenario() -> list:
        q = EventQueue()
        q.put_nowait("early")  # before anyone waits
        got = [await q.get()]
        getter = asyncio.create_task(q.get())
        await asyncio.sleep(0)  # it waits now
        q.put_nowait("woken")
        got.append(await getter)
        cancelled = asyncio.create_task(q.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        q.put_nowait("after")  # nobody waits: kept, not lost on the dead future
        q.put_nowait(None)
        got += [await q.get(), await q.get(), q.qsize()]
        return got

    assert asyncio.run(scenario()) == ["early", "woken", "after", None, 0]
