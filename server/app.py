"""The HTTP server: an OpenAI-compatible FastAPI app over an `EngineClient`.

    app = create_app(AppSettings(model_path, ("my-model",), max_model_len=4096), client)
    uvicorn.run(app, host=..., port=...)

The app owns HTTP only (`docs/design.md`, "Processes"). /metrics renders the client's
`MetricsBoard` when it has one, fed with the other processes' stats, else a board of the
server's own histograms only. When the client has `start()`/`close()`
(`ZmqEngineClient`; both idempotent), the app's lifespan calls them on the server's own
event loop.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.convertors import Convertor, register_url_convertor
from starlette.types import ASGIApp, Receive, Scope, Send
from transformers import AutoTokenizer

from ..common.version import iris_version
from .engine_client import EngineClient
from .errors import APIError, error_response, install_error_handlers
from .metrics import CONTENT_TYPE, MetricsBoard
from .openapi_document import (
    BAD_REQUEST,
    CHAT_BODY,
    GENERATION_ERRORS,
    UNKNOWN_MODEL,
    install_document,
)
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from .responses import ModelCard, ModelList
from .serving import OpenAIServing


@dataclass(frozen=True)
class AppSettings:
    model_path: str
    served_model_names: tuple[str, ...]
    max_model_len: int
    quantization: str | None = None  # the checkpoint's quantized format, if any
    api_key: str | None = None
    version: str = field(default_factory=iris_version)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # generation_config
    max_logprobs: int = 20
    chat_template: str | None = None  # replaces the tokenizer's (the workers get it too)
    tool_call_parser: str | None = None  # set: tool_choice "auto" is enabled, parsed so


class AnythingConvertor(Convertor[str]):
    """A path parameter of any characters, line breaks included (Starlette's `path`
    stops at one, so `/v1/models/a%0Ab` would be an unrouted 404 naming no field)."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("anything", AnythingConvertor())


def create_app(settings: AppSettings, client: EngineClient) -> FastAPI:
    if not settings.served_model_names:
        raise ValueError("served_model_names is empty")
    tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    if settings.chat_template is not None:
        tokenizer.chat_template = settings.chat_template
    board = getattr(client, "metrics", None)  # ZmqEngineClient feeds one
    if board is None:
        board = MetricsBoard()
    board.serve_model(settings.served_model_names[0], settings.max_model_len)  # vLLM's label
    serving = OpenAIServing(
        client,
        tokenizer,
        settings.served_model_names,
        settings.max_model_len,
        metrics=board,
        sampling_defaults=settings.sampling_defaults,
        max_logprobs=settings.max_logprobs,
        tool_call_parser=settings.tool_call_parser,
    )
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        start, close = getattr(client, "start", None), getattr(client, "close", None)
        if start is not None:
            await start()
        try:
            yield
        finally:
            if close is not None:
                await close()

    # strict_content_type=False: a JSON body without a Content-Type header is still JSON.
    app = FastAPI(
        title="Iris", version=settings.version, lifespan=lifespan, strict_content_type=False
    )
    install_error_handlers(app)
    install_document(app)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)

    # documented as they answer: an empty 200, and Prometheus' text format (not JSON)
    @app.get("/health", response_class=Response, responses={200: {"description": "Up."}})
    async def health() -> Response:
        return Response(status_code=200)

    metrics_text: dict[int | str, dict[str, Any]] = {
        200: {"description": "Prometheus text format", "content": {"text/plain": {}}}
    }

    @app.get("/metrics", response_class=Response, responses=metrics_text)
    async def metrics() -> Response:
        return Response(board.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": settings.version}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=name,
                    created=created,
                    root=settings.model_path,
                    max_model_len=settings.max_model_len,
                    quantization=settings.quantization,
                )
                for name in settings.served_model_names
            ]
        )

    @app.get("/v1/models/{model_id:anything}", responses=UNKNOWN_MODEL)
    async def model(model_id: str) -> ModelCard:
        if model_id not in settings.served_model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model")
        return ModelCard(
            id=model_id, created=created, root=settings.model_path,
            max_model_len=settings.max_model_len, quantization=settings.quantization,
        )  # fmt: skip

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS)
    async def chat_completions(raw: Request, body: ChatCompletionRequest = CHAT_BODY) -> Any:
        return await serving.chat(body, raw)

    @app.post("/v1/completions", responses=GENERATION_ERRORS)
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await serving.completion(body, raw)

    @app.post("/tokenize", responses={**BAD_REQUEST, **UNKNOWN_MODEL})
    async def tokenize(body: TokenizeBody) -> dict[str, Any]:
        serving.check_model(body.model)
        if body.messages is None:
            assert body.prompt is not None
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            if any(message.has_images for message in body.messages):
                raise APIError(
                    400,
                    "/tokenize takes text-only messages: image tokens are counted by the "
                    "tokenizer workers",
                    param="messages",
                )
            try:
                text = tokenizer.apply_chat_template(
                    [message.wire() for message in body.messages],
                    tokenize=False,
                    add_generation_prompt=body.add_generation_prompt,
                )
            except Exception as e:  # jinja's TemplateError and friends
                raise APIError(400, f"chat template failed: {e}", param="messages") from e
            tokens = tokenizer.encode(text, add_special_tokens=False)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": settings.max_model_len}

    @app.post("/detokenize", responses={**BAD_REQUEST, **UNKNOWN_MODEL})
    async def detokenize(body: DetokenizeBody) -> dict[str, str]:
        serving.check_model(body.model)
        if body.tokens and max(body.tokens) >= serving.vocab_size:
            raise APIError(
                400, f"token id {max(body.tokens)} is out of the vocabulary", param="tokens"
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    app.state.serving = serving  # the launcher drains it at shutdown
    return app


class BearerAuth:
    """401 on /v1/* unless `Authorization: Bearer <api_key>`; other paths stay open. A plain
    ASGI middleware (not `BaseHTTPMiddleware`), so streaming responses and disconnect
    detection pass through untouched, and it answers before the body is read."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                response: JSONResponse = error_response(
                    401, "Incorrect or missing API key (Authorization: Bearer <key>)."
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
