"""vLLM's /tokenize and /detokenize: the token ids generation would see, and back.

/tokenize takes a completions prompt or chat messages (rendered with the chat template,
tools included, exactly as /v1/chat/completions renders them) and returns the ids with
their count and the context length; /detokenize turns ids into text. Tokenizing runs
off the event loop. It must not generate or queue anything in the engine.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from wattserve.daemon.api.chat_tools import template_messages
from wattserve.daemon.api.errors import from_invalid_request
from wattserve.daemon.api.openai import chat_plan, check_model, render_chat, require_engine, serving
from wattserve.daemon.api.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from wattserve.daemon.engine.request import InvalidRequestError

router = APIRouter(tags=["tokenize"])


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(
    body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request
) -> TokenizeResponse:
    state = serving(request)
    engine = require_engine(state)
    check_model(state, engine, body.model)
    if isinstance(body, TokenizeChatRequest):
        plan = chat_plan(state, engine, body)
        messages = template_messages(body.messages, plan)
        add = body.add_generation_prompt
        try:
            ids = await asyncio.to_thread(render_chat, engine, messages, add, plan)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from None
    else:
        ids = await asyncio.to_thread(engine.tokenize, body.prompt)
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = serving(request)
    engine = require_engine(state)
    check_model(state, engine, body.model)
    vocab = engine.model.shape.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise from_invalid_request(
            InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
        )
    text = await asyncio.to_thread(engine.tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)
