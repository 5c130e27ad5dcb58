"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

A handler validates the body (pydantic), renders and tokenizes the prompts off the event
loop, builds SamplingParams, and queues one engine request per choice (n per prompt,
each with its admission slot; choices.py); then it either collects the whole answer or
streams it as server-sent events in OpenAI's chunk format (logprobs and echo included),
ending with `data: [DONE]`. Every refusal happens before the response starts, so it
carries a real status code; a request over a bound of bounds.py is refused before any work.
A whole answer is assembled and encoded on a worker thread (json_pieces.py), so a
many-choice answer with logprobs does not stall the loop; so is a streamed echo's first
chunk. Grammars compile on the tokenization pool, at most
`server.max_concurrent_grammar_compiles` at once. A client that disconnects has its
sequences aborted.
This module formats and routes; it must not schedule, sample or touch tensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from wattserve.daemon.api.bounds import check_choices, check_priority, check_prompt_logprobs
from wattserve.daemon.api.chat_tools import (
    ToolPlan,
    fold_tool_system,
    plan_tools,
    template_messages,
)
from wattserve.daemon.api.choices import Choices, ChoiceSpec, start_choices
from wattserve.daemon.api.errors import APIError, error_body, error_response, from_invalid_request
from wattserve.daemon.api.generation import ClientGone, GenerationStream
from wattserve.daemon.api.json_pieces import encode_json
from wattserve.daemon.api.logprobs import CompletionLogprobs, TokenText, chat_content
from wattserve.daemon.api.schemas import (
    _SEED_MAX,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    _SamplingFields,
)
from wattserve.daemon.api.state import ServingState, Unavailable
from wattserve.daemon.api.structured import requested_guide
from wattserve.daemon.api.tools import CallDelta, ContentDelta, Delta, ToolCallReader, read_all
from wattserve.daemon.engine.engine import Engine
from wattserve.daemon.engine.request import (
    GuidedDecoding,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

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
    prompts = body.prompt_inputs()

    def tokenize() -> list[list[int]]:
        return [engine.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]

    return await _generate(request, state, engine, body, tokenize, "text_completion", "prompt")


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=_stream_doc("ChatCompletionChunk"),
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = serving(request)
    engine = require_engine(state)
    plan = chat_plan(state, engine, body)

    def render() -> list[list[int]]:
        return [render_chat(engine, template_messages(body.messages, plan), True, plan)]

    return await _generate(
        request, state, engine, body, render, "chat.completion", "messages", plan
    )


def chat_plan(
    state: ServingState, engine: Engine, body: ChatCompletionRequest | TokenizeChatRequest
) -> ToolPlan:
    """The request's tools plan (chat_tools.py); its refusals as OpenAI-shaped 400s."""
    try:
        return plan_tools(body, engine.tokenizer, state.cfg.api)
    except InvalidRequestError as e:
        state.metrics.requests.labels("rejected_invalid").inc()
        raise from_invalid_request(e) from None


def render_chat(
    engine: Engine,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    plan: ToolPlan | None = None,
) -> list[int]:
    """Apply the tokenizer's chat template (with the plan's tools) and tokenize; template
    failures are the caller's."""
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model has no chat template; use /v1/completions", param="messages"
        )

    def apply(turns: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(
            turns,
            tools=None if plan is None else plan.template_tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    # A template without a system role (Gemma 2) gets the tool list in the first user turn.
    folded = None if plan is None else fold_tool_system(messages, plan)
    first_error: Exception | None = None
    for turns in (messages, folded):
        if turns is None:
            break
        try:
            text = apply(turns)
        except Exception as e:  # jinja raises TemplateError (and others) for what it rejects
            first_error = first_error or e
            continue
        return engine.tokenize(text)
    raise InvalidRequestError(
        f"the chat template rejected the messages: {first_error}", param="messages"
    )


def sampling_params(
    body: _SamplingFields,
    max_tokens: int | None,
    prompt_len: int,
    engine: Engine,
    default_max_tokens: int,
    guided: GuidedDecoding | None = None,
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
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        assert isinstance(body, CompletionRequest)
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of must equal n (choices are not ranked)", "best_of")
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo else None
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
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=body.logit_bias_pairs,
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        guided=guided,
    )


def _choice_specs(
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    engine: Engine,
    default_max_tokens: int,
    guided: GuidedDecoding | None,
) -> list[ChoiceSpec]:
    """n choices per prompt, indexed prompt by prompt; sample j is seeded seed + j."""
    specs = []
    for p, ids in enumerate(prompts):
        params = sampling_params(body, max_tokens, len(ids), engine, default_max_tokens, guided)
        for j in range(body.n):
            seed = None if body.seed is None else (body.seed + j) % (_SEED_MAX + 1)
            specs.append(ChoiceSpec(p * body.n + j, p, ids, dataclasses.replace(params, seed=seed)))
    return specs


@dataclass
class _Shape:
    """How the answer is shaped beyond the text (logprobs, echo) and its helpers."""

    chat: bool
    logprobs: bool
    echo: bool
    prompt_only: bool  # completions max_tokens 0: the one token generated is dropped
    token_text: TokenText
    tools: ToolPlan | None  # tool calls may be in the answer: read them out
    prompt_texts: list[str]

    def reader(self) -> ToolCallReader | None:
        return None if self.tools is None else self.tools.new_reader()


def _completion_logprobs(
    shape: _Shape, spec: ChoiceSpec, out: RequestOutput, builder: CompletionLogprobs
) -> dict[str, Any] | None:
    if not shape.logprobs:
        return None
    entries: list[TokenLogprob | None] = []
    ids: list[int] = []
    if shape.echo and out.prompt_logprobs is not None:
        entries += out.prompt_logprobs
        ids += spec.prompt_token_ids[: len(out.prompt_logprobs)]
    if not shape.prompt_only and out.logprobs:
        entries += out.logprobs
        ids += out.token_ids
    return builder.block(entries, ids)


async def _generate(
    request: Request,
    state: ServingState,
    engine: Engine,
    body: CompletionRequest | ChatCompletionRequest,
    build_prompts: Callable[[], list[list[int]]],
    kind: str,
    prompt_param: str,
    tools: ToolPlan | None = None,
) -> Any:
    arrival_s = time.monotonic()
    model = check_model(state, engine, body.model)
    chat = isinstance(body, ChatCompletionRequest)
    if isinstance(body, ChatCompletionRequest):
        max_tokens, max_param = body.max_new_tokens, body.max_tokens_param
        echo, prompt_only = False, False
    else:
        max_tokens, max_param = body.max_tokens, "max_tokens"
        echo, prompt_only = body.echo, body.max_tokens == 0
        if prompt_only:
            max_tokens = 1  # the prompt's logprobs come with the first step; its token is dropped
    rename = {"prompt": prompt_param, "max_tokens": max_param}
    server = state.cfg.server
    try:
        if prompt_only and not echo:
            raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo)", "max_tokens")
        check_priority(server, body.priority)
        check_choices(server, len(_raw_prompts(body)) if not chat else 1, body.n)
        # Templating and tokenizing a long prompt takes a while: keep the loop responsive.
        prompts = await asyncio.to_thread(build_prompts)
        if echo and getattr(body, "logprobs", None) is not None:
            check_prompt_logprobs(server, [len(p) for p in prompts], body.n)
        guide = requested_guide(body)
        if tools is not None and tools.guide is not None:
            if guide is not None:
                raise InvalidRequestError(
                    f"a forced tool call cannot be combined with {guide[1]}", param=guide[1]
                )
            guide = (tools.guide, "tools")
        if guide is not None:
            # A schema the library cannot compile is refused here; compiling takes from
            # milliseconds to seconds, so not on the loop, and a few at a time so that
            # tokenizing keeps pool threads. The guide carries its matcher to the engine.
            async with state.grammar_compiles:
                compiled = await asyncio.to_thread(engine.grammars.compile, *guide)
            guide = (dataclasses.replace(guide[0], compiled=compiled), guide[1])
        specs = _choice_specs(
            body,
            prompts,
            max_tokens,
            engine,
            state.cfg.engine.default_max_tokens,
            None if guide is None else guide[0],
        )
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        choices = start_choices(state, specs, rid, arrival_s)
    except InvalidRequestError as e:
        state.metrics.requests.labels("rejected_invalid").inc()
        raise from_invalid_request(e, rename) from None
    except Unavailable as e:
        state.metrics.requests.labels(
            "rejected_overload" if e.reason == "overloaded" else "rejected_unavailable"
        ).inc()
        raise unavailable_error(e) from None
    text_of = TokenText(engine.tokenizer)
    shape = _Shape(
        chat=chat,
        logprobs=specs[0].params.logprobs is not None,
        echo=echo,
        prompt_only=prompt_only,
        token_text=text_of,
        tools=tools if tools is not None and tools.mode != "none" else None,
        prompt_texts=(
            [_prompt_text(engine, p, q) for p, q in zip(prompts, _raw_prompts(body), strict=True)]
            if echo
            else []
        ),
    )
    created = int(time.time())
    headers = {"X-Request-Id": rid}
    if body.stream:
        chunks = _sse_chunks(choices, shape, kind, rid, created, model, body.include_usage)
        return EngineEventStream(choices, chunks, headers=headers)  # type: ignore[arg-type]
    try:
        events = await _collect(choices, request)
    except ClientGone:
        return error_response(400, "the client closed the request", code="client_disconnected")
    finally:
        choices.close()
    for s in choices.streams:
        if s.finish_reason == "error":
            return error_response(500, s.error or "generation failed", code="engine_error")
    completion_tokens = 0 if prompt_only else choices.completion_tokens
    usage = {
        "prompt_tokens": choices.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": choices.prompt_tokens + completion_tokens,
    }

    def answer() -> bytes:
        payload = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": model,
            "choices": _assemble(choices, shape, events),
            "usage": usage,
        }
        return encode_json(payload)

    # 256 choices with echoed prompt logprobs are tens of megabytes of JSON: seconds of work.
    content = await asyncio.to_thread(answer)
    return Response(content, media_type="application/json", headers=headers)


def _raw_prompts(body: CompletionRequest | ChatCompletionRequest) -> list[str | list[int]]:
    return body.prompt_inputs() if isinstance(body, CompletionRequest) else []


def _prompt_text(engine: Engine, ids: list[int], raw: str | list[int]) -> str:
    return raw if isinstance(raw, str) else engine.tokenizer.decode(ids)


def _finish_reason(
    shape: _Shape, stream: GenerationStream, reader: ToolCallReader | None = None
) -> str | None:
    if shape.prompt_only:
        return "length"
    if reader is not None and reader.calls and stream.finish_reason == "stop":
        return "tool_calls"
    return stream.finish_reason


def _message(text: str, reader: ToolCallReader | None) -> dict[str, Any]:
    """The assistant message of a whole answer; tool calls read out when asked for."""
    if reader is None:
        return {"role": "assistant", "content": text}
    content, calls = read_all(reader, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message


def _delta_tool_call(d: CallDelta) -> dict[str, Any]:
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {
        "index": d.index,
        "id": d.id,
        "type": "function",
        "function": {"name": d.name, "arguments": d.arguments},
    }


async def _collect(choices: Choices, request: Request) -> dict[int, list[RequestOutput]]:
    """Every choice's events, by choice index, once all have finished; raises ClientGone if
    the client disconnects first. Only gathers: formatting is _assemble's, off the loop."""
    watcher = asyncio.create_task(choices.watch_disconnect(request.receive))
    events: dict[int, list[RequestOutput]] = {spec.index: [] for spec in choices.specs}
    try:
        async for index, out in choices.events():
            events[index].append(out)
    finally:
        watcher.cancel()
    return events


def _assemble(
    choices: Choices, shape: _Shape, events: dict[int, list[RequestOutput]]
) -> list[dict[str, Any]]:
    """The answer's choices from their events; runs on a worker thread (no loop objects)."""
    by_index = {
        spec.index: (spec, stream)
        for spec, stream in zip(choices.specs, choices.streams, strict=True)
    }
    texts: dict[int, list[str]] = {i: [] for i in by_index}
    lps: dict[int, list[dict[str, Any]]] = {i: [] for i in by_index}
    for index, outs in events.items():
        spec, _ = by_index[index]
        builder = CompletionLogprobs(shape.token_text)
        if shape.echo:
            texts[index].append(shape.prompt_texts[spec.prompt_index])
        for out in outs:
            if not shape.prompt_only:
                texts[index].append(out.text)
            if shape.logprobs:
                if shape.chat:
                    lps[index] += chat_content(out.logprobs or [], shape.token_text)
                else:
                    block = _completion_logprobs(shape, spec, out, builder)
                    if block is not None:
                        lps[index].append(block)
    result = []
    for index in sorted(by_index):
        _, stream = by_index[index]
        text = "".join(texts[index])
        logprobs: dict[str, Any] | None = None
        if shape.logprobs and shape.chat:
            logprobs = {"content": lps[index]}
        elif shape.logprobs:
            logprobs = {
                key: [v for block in lps[index] for v in block[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            }
        reader = shape.reader()
        message = _message(text, reader)
        reason = _finish_reason(shape, stream, reader)
        if shape.chat:
            result.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
            )
        else:
            result.append(
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
            )
    return result


def _sse_pieces(data: dict[str, Any]) -> bytes:
    """_sse for a large chunk, on a worker thread: encoded without one long GIL hold."""
    return b"data: " + encode_json(data) + b"\n\n"


def _sse(data: dict[str, Any] | str) -> bytes:
    text = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {text}\n\n".encode()


async def _sse_chunks(
    choices: Choices,
    shape: _Shape,
    kind: str,
    rid: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    chat = shape.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    by_index = {
        spec.index: (spec, stream)
        for spec, stream in zip(choices.specs, choices.streams, strict=True)
    }
    builders = {i: CompletionLogprobs(shape.token_text) for i in by_index}
    started: set[int] = set()

    def chunk(
        index: int,
        text: str | None,
        finish: str | None,
        logprobs: dict[str, Any] | None = None,
        role: bool = False,
        tool_call: CallDelta | None = None,
    ) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_call is not None:
                delta["tool_calls"] = [_delta_tool_call(tool_call)]
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish,
            }
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

    readers = {i: shape.reader() for i in by_index}

    def pieces(
        index: int, text: str, logprobs: dict[str, Any] | None, finished: bool
    ) -> list[dict[str, Any]]:
        """The chunks of one event: its text, or what the tool-call reader makes of it."""
        reader = readers[index]
        if reader is None:
            return [chunk(index, text, None, logprobs)] if text or logprobs is not None else []
        deltas: list[Delta] = reader.feed(text) + (reader.finish() if finished else [])
        out = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                out.append(chunk(index, d.text, None, logprobs))
            else:
                out.append(chunk(index, None, None, logprobs, tool_call=d))
            logprobs = None  # sent once, with the event's first chunk
        if logprobs is not None:  # the reader holds the text back; the logprobs go now
            out.append(chunk(index, None, None, logprobs))
        return out

    def render(
        index: int,
        spec: ChoiceSpec,
        out: RequestOutput,
        text: str,
        encode: Callable[[dict[str, Any]], bytes],
    ) -> list[bytes]:
        """One event's chunks, encoded; none for a failed choice (the loop answers that)."""
        logprobs: dict[str, Any] | None = None
        if shape.logprobs:
            if chat:
                entries = chat_content(out.logprobs or [], shape.token_text)
                logprobs = {"content": entries} if entries else None
            else:
                logprobs = _completion_logprobs(shape, spec, out, builders[index])
                if logprobs is not None and not logprobs["tokens"]:
                    logprobs = None
        if out.finished and by_index[index][1].finish_reason == "error":
            return []
        # A token that completes no character yet has nothing to show (unless logprobs).
        return [encode(p) for p in pieces(index, text, logprobs, finished=out.finished)]

    async for index, out in choices.events():
        spec, stream = by_index[index]
        text = "" if shape.prompt_only else out.text
        if index not in started:
            if chat:
                # With the choice's first event, not before: clients (vLLM's benchmark
                # among them) time the first token from the first chunk with a choice.
                yield _sse(chunk(index, "", None, role=True))
            if shape.echo:
                text = shape.prompt_texts[spec.prompt_index] + text
        started.add(index)

        if shape.echo and shape.logprobs and out.prompt_logprobs:
            # The echoed prompt's logprobs come with the choice's first event: up to
            # server.max_prompt_logprob_tokens of them, built and encoded off the loop.
            encoded = await asyncio.to_thread(render, index, spec, out, text, _sse_pieces)
        else:
            encoded = render(index, spec, out, text, _sse)
        for data in encoded:
            yield data
        if not out.finished:
            continue
        if stream.finish_reason == "error":
            choices.close()
            yield _sse(error_body(500, stream.error or "generation failed", code="engine_error"))
            break
        yield _sse(chunk(index, None, _finish_reason(shape, stream, readers[index])))
    else:
        if include_usage:
            completion_tokens = 0 if shape.prompt_only else choices.completion_tokens
            yield _sse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": choices.prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": choices.prompt_tokens + completion_tokens,
                    },
                }
            )
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
