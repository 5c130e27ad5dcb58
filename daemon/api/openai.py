"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

A handler validates the body (pydantic), renders and tokenizes the prompt off the event
loop, builds SamplingParams, takes an admission slot and queues the request; then it
either collects the whole answer or streams it as server-sent events in OpenAI's chunk
format, ending with `data: [DONE]`. Every refusal happens before the response starts,
so it carries a real status code. A client that disconnects has its sequence aborted.
This module formats and routes; it must not schedule, sample or touch tensors.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from daemon.api.errors import APIError, error_body, error_response, from_invalid_request
from daemon.api.generation import ClientGone, GenerationStream, start_generation
from daemon.api.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    _SamplingFields,
)
from daemon.api.state import ServingState, Unavailable
from daemon.engine.engine import Engine
from daemon.engine.request import InvalidRequestError, SamplingParams

router = APIRouter(tags=["openai"])

_MIN_TEMPERATURE = 1e-6
_MIN_TOP_P = 1e-6


def _stream_doc(chunk_model: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI for the `stream: true` answer: each event's data is a chunk, an error or [DONE]."""
    payload = {
        "anyOf": [
            {"$ref": f"#/components/schemas/{chunk_model}"},
            {"$ref": "#/components/schemas/ErrorResponse"},
        ]
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": payload,
                    },
                ]
            }
        },
    }
    return {
        200: {
            "description": "The answer; with `stream: true`, server-sent events, one chunk "
            "each, ending `data: [DONE]`.",
            "content": {"text/event-stream": {"schema": event}},
        }
    }


def serving(request: Request) -> ServingState:
    return request.app.state.serving


def unavailable_error(exc: Unavailable) -> APIError:
    headers = {"Retry-After": str(exc.retry_after_s)}
    if exc.reason == "draining":
        headers["Connection"] = "close"  # this process is going away: do not keep the socket
    return APIError(503, exc.message, code=exc.reason, headers=headers)


def require_engine(state: ServingState) -> Engine:
    if state.engine is None:
        raise unavailable_error(Unavailable("not_ready", "the model is still loading", 5))
    return state.engine


def check_model(state: ServingState, engine: Engine, model: str | None) -> str:
    served = state.served_model_name or engine.model_name
    if model is not None and model not in (served, engine.model_name):
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
    return served


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = serving(request)
    engine = require_engine(state)
    created = int(state.created_at_s)
    name = state.served_model_name or engine.model_name
    return ModelList(data=[ModelCard(id=name, created=created, max_model_len=engine.max_model_len)])


@router.post(
    "/v1/completions", response_model=CompletionResponse, responses=_stream_doc("CompletionChunk")
)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = serving(request)
    engine = require_engine(state)
    prompt = body.prompt_input()

    def tokenize() -> list[int]:
        return engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)

    return await _generate(request, state, engine, body, tokenize, "text_completion", "prompt")


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=_stream_doc("ChatCompletionChunk"),
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = serving(request)
    engine = require_engine(state)
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]

    def render() -> list[int]:
        return render_chat(engine, messages)

    return await _generate(request, state, engine, body, render, "chat.completion", "messages")


def render_chat(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    """Apply the tokenizer's chat template and tokenize; template failures are the caller's."""
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model has no chat template; use /v1/completions", param="messages"
        )
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja raises TemplateError (and others) for messages it rejects
        raise InvalidRequestError(
            f"the chat template rejected the messages: {e}", param="messages"
        ) from None
    return engine.tokenize(text)


def sampling_params(
    body: _SamplingFields,
    max_tokens: int | None,
    prompt_len: int,
    engine: Engine,
    default_max_tokens: int,
) -> SamplingParams:
    if max_tokens is None:
        # Unset means "a sensible answer": the configured default, clipped to the context.
        max_tokens = max(1, min(default_max_tokens, engine.max_model_len - prompt_len))
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    # Limits that mean "greedy" / "top-1" are sent as such: in float32, logits divided by
    # a denormal temperature overflow and a denormal top_p rounds to 0, masking every token.
    if temperature < _MIN_TEMPERATURE:
        temperature = 0.0
    if top_p < _MIN_TOP_P:
        top_p, top_k = 1.0, 1
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=body.seed,
        stop=body.stop_tuple,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        priority=body.priority,
    )


async def _generate(
    request: Request,
    state: ServingState,
    engine: Engine,
    body: CompletionRequest | ChatCompletionRequest,
    build_prompt: Callable[[], list[int]],
    kind: str,
    prompt_param: str,
) -> Any:
    arrival_s = time.monotonic()
    model = check_model(state, engine, body.model)
    if isinstance(body, ChatCompletionRequest):
        max_tokens, max_param = body.max_new_tokens, body.max_tokens_param
    else:
        max_tokens, max_param = body.max_tokens, "max_tokens"
    rename = {"prompt": prompt_param, "max_tokens": max_param}
    try:
        # Templating and tokenizing a long prompt takes a while: keep the loop responsive.
        ids = await asyncio.to_thread(build_prompt)
        params = sampling_params(
            body, max_tokens, len(ids), engine, state.cfg.engine.default_max_tokens
        )
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        stream = start_generation(state, ids, params, rid, arrival_s)
    except InvalidRequestError as e:
        state.metrics.requests.labels("rejected_invalid").inc()
        raise from_invalid_request(e, rename) from None
    except Unavailable as e:
        state.metrics.requests.labels(
            "rejected_overload" if e.reason == "overloaded" else "rejected_unavailable"
        ).inc()
        raise unavailable_error(e) from None
    created = int(time.time())
    headers = {"X-Request-Id": rid}
    if body.stream:
        chunks = _sse_chunks(stream, kind, rid, created, model, body.include_usage)
        return EngineEventStream(stream, chunks, headers=headers)
    try:
        text = await _collect(stream, request)
    except ClientGone:
        return error_response(400, "the client closed the request", code="client_disconnected")
    finally:
        stream.close()
    if stream.finish_reason == "error":
        return error_response(500, stream.error or "generation failed", code="engine_error")
    usage = {
        "prompt_tokens": stream.prompt_tokens,
        "completion_tokens": stream.completion_tokens,
        "total_tokens": stream.prompt_tokens + stream.completion_tokens,
    }
    if kind == "chat.completion":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": stream.finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": stream.finish_reason}
    payload = {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
    return JSONResponse(payload, headers=headers)


async def _collect(stream: GenerationStream, request: Request) -> str:
    """Await the whole answer; raises ClientGone if the client disconnects first."""
    watcher = asyncio.create_task(_watch_disconnect(request.receive, stream))
    parts: list[str] = []
    try:
        while True:
            out = await stream.next_event()
            parts.append(out.text)
            if out.finished:
                return "".join(parts)
    finally:
        watcher.cancel()


async def _watch_disconnect(receive: Receive, stream: GenerationStream) -> None:
    # The body was read already: the next message is http.disconnect, whenever it comes.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.client_gone()
            return


def _sse(data: dict[str, Any] | str) -> bytes:
    text = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {text}\n\n".encode()


async def _sse_chunks(
    stream: GenerationStream, kind: str, rid: str, created: int, model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    chat = kind == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            out["usage"] = None
        return out

    if chat:
        yield _sse(chunk("", None, role=True))
    while True:
        out = await stream.next_event()
        if not out.finished:
            if out.text:  # a token that completes no character yet has nothing to show
                yield _sse(chunk(out.text, None))
            continue
        if stream.finish_reason == "error":
            yield _sse(error_body(500, stream.error or "generation failed", code="engine_error"))
            break
        if out.text:
            yield _sse(chunk(out.text, None))
        yield _sse(chunk(None, stream.finish_reason))
        if include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": stream.prompt_tokens,
                        "completion_tokens": stream.completion_tokens,
                        "total_tokens": stream.prompt_tokens + stream.completion_tokens,
                    },
                }
            )
        break
    yield _sse("[DONE]")


class EngineEventStream(StreamingResponse):
    """An SSE response that always closes its engine request, however the response ends.

    Starlette cancels the body iterator when the client disconnects; if that happens
    before the iterator ever ran, no `finally` inside it would run, so the close lives here.
    """

    def __init__(
        self, stream: GenerationStream, chunks: AsyncIterator[bytes], headers: dict[str, str]
    ) -> None:
        super().__init__(
            chunks,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()
