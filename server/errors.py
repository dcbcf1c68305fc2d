"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure
(`docs/design.md`, "Bad input is the client's error").

Every route raises `APIError` (or lets FastAPI raise a validation error); the handlers
installed here turn each into that body. Request validation errors are 400s with `param`
set to the offending top-level field, not FastAPI's default 422.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


# A validation error of this type is named by its whole path, as OpenAI names it
# (`messages[0].content[1].type`), where others are named by their top-level field.
PATH_PARAM_ERROR = "iris_path_param"
# The union tag of content parts Iris does not take (`protocol.UnsupportedPart`): part of
# pydantic's location of an error, never of the request's.
UNSUPPORTED_PART_TAG = "unsupported part"


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class APIError(Exception):
    """A request fails with an HTTP status and an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param)


class ClientDisconnected(Exception):
    """The client went away before its response was ready (nothing is sent back)."""


def error_body(
    status: int, message: str, type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type or error_type(status),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int, message: str, type: str | None = None, param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, type, param), status_code=status)


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request")
    if errors[0].get("type") == "json_invalid":
        detail = (errors[0].get("ctx") or {}).get("error", errors[0].get("msg", ""))
        return error_response(400, f"Invalid JSON body: {detail}")
    # A value that fits no member of a union gets one error per member; the one that
    # got furthest into the value says best what is wrong.
    first = max(errors, key=lambda error: len(error.get("loc", ())))
    loc = [
        part
        for part in first.get("loc", ())
        if part not in ("body", UNSUPPORTED_PART_TAG) and not _is_union_label(part)
    ]
    param = loc[0] if loc and isinstance(loc[0], str) else None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == PATH_PARAM_ERROR:
        path = _openai_path(loc)
        return error_response(400, f"{path}: {message}", param=path)
    if loc:
        message = f"{'.'.join(str(part) for part in loc)}: {message}"
    return error_response(400, message, param=param)


def _openai_path(loc: list[object]) -> str:
    """["messages", 0, "content", 1, "type"] → "messages[0].content[1].type"."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _is_union_label(part: object) -> bool:
    """pydantic names the union member in an error's loc: "str", "list[int]", ..."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_LABELS)


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # a 405's `Allow`
        return response

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}")
