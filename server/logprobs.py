"""Logprobs in the two shapes the OpenAI API gives them: chat's
`logprobs.content[{token, logprob, bytes, top_logprobs}]` and completions'
`logprobs{tokens, token_logprobs, top_logprobs, text_offset}`, from the engine's
`ipc.TokenLogprob`s (raw log-softmax, as vLLM's default `raw_logprobs`). A token's text
is what it decodes to alone, and `bytes` that text's UTF-8 (a token holding part of a
multi-byte character reads as U+FFFD, whose bytes are not the token's: a known limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from ..ipc.messages import TokenLogprob


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TokenText:
    """Token id -> its text and UTF-8 bytes, as the tokenizer decodes it alone (memoised)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            text = self.tokenizer.decode([token_id])
            found = self._cache[token_id] = (text, list(text.encode("utf-8")))
        return found


def chat_logprobs(items: Sequence[TokenLogprob], text: TokenText) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token, raw = text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=raw)

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **top(item.token_id, item.logprob).model_dump(),
                top_logprobs=[top(t, lp) for t, lp in item.top],
            )
            for item in items
        ]
    )


def completion_logprobs(
    items: Sequence[TokenLogprob], text: TokenText, offset: int = 0
) -> CompletionLogprobs:
    """`offset`: characters of the answer before these tokens (`text_offset` counts on)."""
    tokens, offsets = [], []
    for item in items:
        token, _ = text(item.token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[item.logprob for item in items],
        top_logprobs=[{text(t)[0]: lp for t, lp in item.top} for item in items],
        text_offset=offsets,
    )
