"""API errors with the right status, in the shape the client's API has: OpenAI's
`{"error": {"message", "type", "param", "code"}}`, and under `/v1/messages` Anthropic's
`{"type": "error", "error": {"type", "message"}}`.

Every failure the gateway reports goes through `APIError`, and the handlers installed by
`install_error_handlers` turn request-validation failures, malformed JSON and unexpected
exceptions into the same shape, so a client always gets JSON it can parse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)
T = TypeVar("T")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_path(path: str) -> bool:
    """Whether `path` belongs to Anthropic's Messages API (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def _printable(text: str | None) -> str | None:
    """`text` with lone surrogates escaped: a message quoting a client's invalid string must
    still encode as UTF-8."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self, anthropic: bool = False) -> JSONResponse:
        if anthropic:
            message = _printable(self.message) or ""
            if self.param:
                message = message if message.startswith(f"{self.param}:") else f"{self.param}: {message}"
            return JSONResponse(anthropic_error(self.status, message), status_code=self.status, headers=self.headers)
        body = {
            "error": {
                "message": _printable(self.message),
                "type": _TYPES.get(self.status, "server_error"),
                "param": _printable(self.param),
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _is_union_tag(part: str | int) -> bool:
    """Whether a location part names the member of a union pydantic tried (`str`,
    `list[TextPart]`, `NamedToolChoice`, `function-after[...]`) rather than a field or key (a
    dict key that looks like one is dropped too: `param` then names the dict)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper())


def _param(error: dict[str, Any]) -> list[str]:
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    parts = [str(p) for p in loc if not _is_union_tag(p)]
    at = (error.get("ctx") or {}).get("at")  # a validator's own pointer below its location
    return parts + at.split(".") if at else parts


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors about a request body."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") in ("missing", "model_attributes_type", "dict_type") and list(first.get("loc", ())) == ["body"]:
        return "the request body must be a JSON object (Content-Type: application/json)", None
    # A value no member of a union accepts fails once per member: report the member that got
    # furthest (a content part's missing `text` rather than "content should be a string").
    prefix = _param(first)
    related = [e for e in errors if _param(e)[:len(prefix)] == prefix]
    chosen = max(related, key=lambda e: len(_param(e)))  # the first of the deepest
    param = ".".join(_param(chosen)) or None
    if chosen.get("type") == "extra_forbidden":
        return f"unsupported parameter: {param}", param
    message = chosen["msg"].removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def translated(make: Callable[[], T]) -> T:
    """The chat request another API's request stands for (`make` builds it); one it cannot stand
    for is a 400 naming the field, like any invalid request."""
    try:
        return make()
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise APIError(400, message, param) from None


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
    }}},
}


ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"},
    }}},
}


def openapi_with_openai_errors(app: FastAPI) -> None:
    """Make `/openapi.json` say what the gateway answers: an invalid request is a 400 with
    OpenAI's error object, or Anthropic's under `/v1/messages` (FastAPI documents its own 422
    `HTTPValidationError`)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for path, operations in schema.get("paths", {}).items():
                shape = ANTHROPIC_ERROR_SCHEMA if anthropic_path(path) else ERROR_SCHEMA
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = {"description": "Invalid request",
                                            "content": {"application/json": {"schema": shape}}}
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def install_error_handlers(app: FastAPI) -> None:
    openapi_with_openai_errors(app)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(anthropic_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return APIError(400, message, param=param).response(anthropic_path(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response(anthropic_path(request.url.path))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response(anthropic_path(request.url.path))
