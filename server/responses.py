"""The OpenAI-compatible response bodies (pydantic): completions, chat completions and
their stream chunks, usage with Iris's per-image cache report, the model list."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from .logprobs import ChatLogprobs, CompletionLogprobs

if TYPE_CHECKING:
    from ..ipc.messages import ImageReport

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


def _omitted_when_none() -> Any:
    return Field(default=None, exclude_if=lambda value: value is None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # from the prefix cache, whichever tier held them
    # of those, reloaded from host memory (Iris's vendor field, with `--kv-offload-gib`)
    host_cached_tokens: int | None = _omitted_when_none()


class ImageCacheEntry(BaseModel):
    """Iris's report on one image of a chat prompt (`usage.image_cache`, a vendor field:
    vLLM has none). `cache`: the deepest cache that served it — "prefix" (its KV),
    "embedding" (the vision tower's output), "processor" (its decoded pixels) — or None
    when it was decoded and encoded anew; `hit` is whether any did."""

    part: str  # where it was in the request: "messages[1].content[0]"
    uuid: str | None = None  # the client's id for it, when it gave one
    hit: bool
    cache: Literal["prefix", "embedding", "processor"] | None


_CACHE_DEPTH = {"none": 0, "processor": 1, "embedding": 2, "prefix": 3}


def image_cache(reports: Sequence[ImageReport]) -> list[ImageCacheEntry]:
    """The client's view of the scheduler's per-image reports. A video's temporal patches
    (consecutive reports of one part) make one entry, at the shallowest cache that served
    all of them."""
    merged: list[ImageReport] = []
    for report in reports:
        if merged and merged[-1].part == report.part:
            if _CACHE_DEPTH[report.cache] < _CACHE_DEPTH[merged[-1].cache]:
                merged[-1] = report
            continue
        merged.append(report)
    return [
        ImageCacheEntry(
            part=report.part,
            uuid=report.uuid,
            hit=report.cache != "none",
            cache=None if report.cache == "none" else report.cache,
        )
        for report in merged
    ]


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    image_cache: list[ImageCacheEntry] | None = _omitted_when_none()  # chat with images

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        image_cache: list[ImageCacheEntry] | None = None,
        host_cached_tokens: int | None = None,
    ) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=cached_tokens, host_cached_tokens=host_cached_tokens
            ),
            image_cache=image_cache,
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is tool calls only (as OpenAI sends it)
    tool_calls: list[dict[str, Any]] | None = _omitted_when_none()


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    # {"role", "content"} first, then {"content"} or {"tool_calls"}, {} at the finish
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omitted_when_none()


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """A completion, and (with `usage` unset) one streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _omitted_when_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "iris"
    root: str
    parent: str | None = None
    max_model_len: int
    quantization: str | None = _omitted_when_none()  # Iris's: the checkpoint's format


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
