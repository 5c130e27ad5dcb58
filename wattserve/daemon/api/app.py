"""The FastAPI app factory: routes, guards, error handlers and the OpenAPI document.

`create_app(state)` builds one app around one ServingState (kept on `app.state.serving`);
nothing is global, so tests can build as many apps as they like. The OpenAPI document
is adjusted to what the app really answers: validation failures are 400 (not FastAPI's
422) and every operation documents the OpenAI-shaped error body as its default response.
The app must not load models or own threads; wattserve/daemon/server.py does that.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi

from wattserve.daemon.api import control, dashboard, openai, tokenize
from wattserve.daemon.api.errors import ErrorResponse, install_error_handlers
from wattserve.daemon.api.middleware import BodyLimitMiddleware, HostAllowlistMiddleware
from wattserve.daemon.api.schemas import ChatCompletionChunk, CompletionChunk
from wattserve.daemon.api.state import ServingState

_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def allowed_hosts(state: ServingState, bound_host: str | None = None) -> list[str]:
    hosts = list(state.cfg.server.allowed_hosts)
    host = bound_host or state.cfg.server.host
    # A wildcard bind address is not a name a client would send in Host.
    if host not in ("0.0.0.0", "::", ""):
        hosts.append(f"[{host}]" if ":" in host and not host.startswith("[") else host)
    return hosts


def create_app(state: ServingState, bound_host: str | None = None) -> FastAPI:
    docs = state.cfg.server.docs_enabled
    app = FastAPI(
        title="wattserve",
        summary="Power-aware LLM inference daemon: OpenAI-compatible local API",
        version="0.1.0",
        docs_url="/docs" if docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.serving = state
    state.metrics.bind(lambda: state.engine, lambda: state.in_flight, lambda: state.is_ready)
    state.metrics.bind_device(lambda: state)

    def count_invalid(request: Request) -> None:
        if request.url.path in _GENERATION_PATHS:
            state.metrics.requests.labels("rejected_invalid").inc()

    install_error_handlers(app, on_invalid_body=count_invalid)
    app.include_router(openai.router)
    app.include_router(tokenize.router)
    app.include_router(control.router)
    if state.cfg.server.dashboard_enabled:
        app.include_router(dashboard.build_router(state))

    @app.get(
        "/metrics",
        tags=["ops"],
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.serving.metrics.render(), media_type=_PROMETHEUS_TEXT)

    # Added last = runs first: the Host check precedes reading any body.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=state.cfg.server.max_body_bytes)
    app.add_middleware(HostAllowlistMiddleware, allowed_hosts=allowed_hosts(state, bound_host))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _adjusted_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _adjusted_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    # Models referenced only from hand-written parts of the document (errors, SSE events).
    for model in (ErrorResponse, CompletionChunk, ChatCompletionChunk):
        sub = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, nested in sub.pop("$defs", {}).items():
            components.setdefault(name, nested)
        components[model.__name__] = sub
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path_item in schema.get("paths", {}).values():
        for op in path_item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            responses["default"] = {
                "description": "OpenAI-shaped error",
                "content": {"application/json": {"schema": error_ref}},
            }
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema
