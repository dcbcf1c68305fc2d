"""One answer as it comes: the engine's text deltas, read for tool calls when the
request has a reader, framed as OpenAI server-sent events or collected whole.

`events` is the one event loop both APIs stream with (each API shapes only its chunk);
`collect` the non-streamed counterpart. An answer read for tool calls goes through
`read_answer` first, so a streamed answer and a collected one are the same fold of the
same deltas.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from iris_serve.ipc.messages import TokenLogprob
from iris_serve.server.engine_client import EngineRequestError
from iris_serve.server.protocol import Usage
from iris_serve.server.tool_choice import AnswerReader, ToolPlan

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


@dataclass
class Delta:
    """New text of one request; `finish_reason` set on the last one."""

    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "tool_calls" on the last one
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()  # of this delta's tokens, when asked for
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's delta entries


# chunk(delta, logprobs since the last chunk, finish reason, opening) -> one SSE event
ChunkMaker = Callable[[Delta, list[TokenLogprob], Any, bool], str]


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event, framed exactly as OpenAI clients split them."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def events(
    first: Delta,
    deltas: AsyncIterator[Delta],
    chunk: ChunkMaker,
    usage: Callable[[Usage], str] | None,
) -> AsyncIterator[str]:
    """One answer's SSE events, in either API's shape: the opening chunk, a chunk per
    new text or tool-call fragment (with the logprobs of the tokens since the previous
    chunk), the finish chunk, the usage chunk if asked, [DONE]; an engine error
    mid-stream is an error event, then [DONE]."""
    async with closing(deltas):
        yield chunk(first, list(first.logprobs), None, True)
        pending: list[TokenLogprob] = []
        last = first
        try:
            while last.finish_reason is None:
                last = await anext(deltas)
                pending.extend(last.logprobs)
                if last.text or last.tool_calls:
                    yield chunk(last, pending, None, False)
                    pending = []
        except EngineRequestError as e:
            yield sse(e.body())
            yield DONE
            return
        yield chunk(Delta("", None, last.usage), pending, last.finish_reason, False)
        if usage is not None:
            yield usage(last.usage)
        yield DONE


def event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    # no-cache and X-Accel-Buffering: proxies (nginx) pass each event on at once.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)


async def read_answer(
    deltas: AsyncIterator[Delta], reader: AnswerReader, plan: ToolPlan
) -> AsyncIterator[Delta]:
    """The deltas with their text read for tool calls: content stays text, calls become
    `tool_calls` entries (one per call index per delta), and the finish reason becomes
    `tool_calls` when the plan says so."""
    async with closing(deltas):
        async for delta in deltas:
            pieces = reader.feed(delta.text)
            reason = delta.finish_reason
            if reason is not None:
                pieces += reader.finish()
                reason = plan.finish_reason(reason, reader.answer())
            content = "".join(piece.get("content", "") for piece in pieces)
            calls = _merged([call for piece in pieces for call in piece.get("tool_calls", ())])
            yield Delta(content, reason, delta.usage, delta.logprobs, calls)
            if reason is not None:
                return


def _merged(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call index: a header and the argument fragments after it become one
    (some clients merge entries of one chunk by index, some do not)."""
    merged: list[dict[str, Any]] = []
    for call in calls:
        if merged and merged[-1]["index"] == call["index"]:
            function = merged[-1].setdefault("function", {})
            function["arguments"] = function.get("arguments", "") + call["function"]["arguments"]
        else:
            merged.append({**call, "function": dict(call["function"])})
    return merged


async def collect(deltas: AsyncIterator[Delta]) -> tuple[str, Delta, list[TokenLogprob]]:
    """The whole answer, its last delta and every token's logprobs (when asked for)."""
    async with closing(deltas):
        parts = []
        logprobs: list[TokenLogprob] = []
        async for delta in deltas:
            parts.append(delta.text)
            logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                return "".join(parts), delta, logprobs
    raise RuntimeError("the request ended without a finish reason")  # deltas always set one


@asynccontextmanager
async def closing(iterator: AsyncIterator[T]) -> AsyncIterator[AsyncIterator[T]]:
    """Closes an async generator on exit (plain async iterators have nothing to close)."""
    try:
        yield iterator
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


async def starting_with(head: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """`head`, then `rest`'s deltas; closing it closes `rest`."""
    async with closing(rest):
        yield head
        async for delta in rest:
            yield delta
