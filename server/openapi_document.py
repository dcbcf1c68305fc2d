"""The OpenAPI document as the server answers: every failure is OpenAI's error object
(`errors.py`), so the document names those, not FastAPI's 422 validation body, which
Iris never sends. A client generated from the document, or a fuzzer driven by it
(`tests/test_api_fuzz.py`), then tells a documented refusal from a bug."""

from __future__ import annotations

from typing import Any

from fastapi import Body, FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .protocol import IMAGE_URL_EXAMPLES, VIDEO_URL_EXAMPLES


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None  # the request field the error is about
    code: int  # the HTTP status


class ErrorResponse(BaseModel):
    """What every 4xx and 5xx answers."""

    error: ErrorInfo


def error_reply(description: str) -> dict[str, Any]:
    """A route's `responses` entry for an error status it answers."""
    return {"model": ErrorResponse, "description": description}


Responses = dict[int | str, dict[str, Any]]  # a route's `responses`, as FastAPI types it
BAD_REQUEST: Responses = {400: error_reply("A field the server refuses, named in error.param.")}
UNKNOWN_MODEL: Responses = {404: error_reply("No served model has that name (error.param: model).")}
BUSY: Responses = {503: error_reply("The server is at capacity or shutting down; retry.")}
GENERATION_ERRORS: Responses = {**BAD_REQUEST, **UNKNOWN_MODEL, **BUSY}
_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")


def _chat_with(part: dict[str, Any]) -> dict[str, Any]:
    text = {"type": "text", "text": "What is this?"}
    return {"value": {"messages": [{"role": "user", "content": [part, text]}], "max_tokens": 4}}


def chat_examples(image_urls: list[str], video_urls: list[str]) -> dict[str, Any]:
    """Chat requests the document shows (and a fuzzer driven by it sends as they are):
    text, then one per example media URL (`protocol.IMAGE_URL_EXAMPLES`: a valid image, a
    truncated one, another type, a host no rule allows; videos alike)."""
    examples: dict[str, Any] = {
        "text": {"value": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}
    }
    for i, url in enumerate(image_urls):
        examples[f"image {i}"] = _chat_with({"type": "image_url", "image_url": {"url": url}})
    for i, url in enumerate(video_urls):
        examples[f"video {i}"] = _chat_with({"type": "video_url", "video_url": {"url": url}})
    return examples


def install_document(app: FastAPI) -> None:
    """Serves `app`'s document without FastAPI's 422 responses and their schemas (a
    request that fails validation is a 400, which the routes document)."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title, version=app.version, routes=app.routes,
                description=app.description,
            )  # fmt: skip
            for operations in spec.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = spec.get("components", {}).get("schemas", {})
            for name in _VALIDATION_SCHEMAS:
                schemas.pop(name, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]


# The chat route's body, with its examples in the document.
CHAT_BODY: Any = Body(openapi_examples=chat_examples(IMAGE_URL_EXAMPLES, VIDEO_URL_EXAMPLES))
