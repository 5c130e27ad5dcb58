"""OpenAI-shaped errors: one exception type for handlers to raise, and the app's handlers.

Every 4xx/5xx body the API sends is `{"error": {"message", "type", "param", "code"}}`,
whatever raised it: our own APIError, a request-body validation failure, an unknown
route, an engine InvalidRequestError, or a bug. This module must not decide *when* a
request fails (handlers and middleware do); it only decides how a failure looks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from wattserve.daemon.engine.request import InvalidRequestError

log = logging.getLogger(__name__)

# OpenAI's `type` strings by status; codes not listed here are server errors.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


class APIError(Exception):
    """Raise from a handler to answer with an OpenAI-shaped error."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    fallback = "server_error" if status_code >= 500 else "invalid_request_error"
    kind = _TYPE_BY_STATUS.get(status_code, fallback)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, code), status_code, headers=headers)


def from_invalid_request(
    err: InvalidRequestError, rename: dict[str, str] | None = None
) -> APIError:
    """An engine validation error as a 400; `rename` maps engine param names to API ones."""
    param = (rename or {}).get(err.param or "", err.param)
    return APIError(400, err.message, param=param, code=err.code)


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages.0.content'; the body itself -> None."""
    # pydantic puts union branch tags in the location ('str', 'list[int]', 'constrained-str',
    # 'TextPart'); field names are snake_case identifiers and list indexes are ints.
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int)
        or (
            p != "body"
            and str(p) not in _BRANCH_TAGS
            and str(p).isidentifier()
            and not str(p)[:1].isupper()
        )
    ]
    return ".".join(parts) or None


_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


_TYPE_MISMATCH = (
    "string_type",
    "int_type",
    "int_parsing",
    "float_type",
    "float_parsing",
    "bool_type",
    "bool_parsing",
    "list_type",
    "dict_type",
    "model_type",
    "model_attributes_type",
)


def _most_specific(errors: list[Any]) -> Any:
    """Of the first field's errors, the one a person can act on.

    A value that fails a union (prompt: str | list[int] | ...) yields one error per
    branch; a branch that failed on a constraint rather than on the value's type, and
    got deepest into the value, is the one the client meant.
    """

    def field(e: Any) -> tuple[Any, ...]:
        loc = tuple(e.get("loc", ()))
        return loc[:2] if loc[:1] == ("body",) else loc[:1]

    same = [e for e in errors if field(e) == field(errors[0])]
    return max(
        same,
        key=lambda e: (e.get("type") not in _TYPE_MISMATCH, len(e.get("loc", ()))),
    )


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = _most_specific(errors) if errors else {"loc": (), "msg": "invalid request", "type": ""}
    kind = first.get("type", "")
    loc = tuple(first.get("loc", ()))
    if kind == "json_invalid":
        return error_response(400, "request body is not valid JSON", code="invalid_json")
    if kind in ("model_attributes_type", "dict_type", "model_type") and loc in (("body",), ()):
        return error_response(400, "request body must be a JSON object", code="invalid_body")
    if kind == "missing" and loc == ("body",):
        return error_response(400, "request body is required", code="invalid_body")
    param = _param_from_loc(loc)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        message = f"unknown parameter {param!r}"
        code = "unknown_parameter"
    elif kind == "finite_number":
        message = f"{param}: must be a finite number"
        code = "invalid_value"
    else:
        message = f"{param}: {msg}" if param else msg
        code = "missing_parameter" if kind == "missing" else "invalid_value"
    return error_response(400, message, param=param, code=code)


def install_error_handlers(
    app: FastAPI, on_invalid_body: Callable[[Request], None] | None = None
) -> None:
    """Answer every failure OpenAI-shaped; `on_invalid_body` hears each body rejected (400)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(
            exc.status_code, exc.message, param=exc.param, code=exc.code, headers=exc.headers
        )

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if on_invalid_body is not None:
            on_invalid_body(request)
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {404: "no such endpoint", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        return error_response(
            exc.status_code,
            message,
            code=codes.get(exc.status_code),
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: logged with its traceback, answered without internals.
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", code="internal_error")
