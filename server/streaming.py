"""One answer as it comes: the engine's text deltas, read for tool calls when the
request has a reader, framed as OpenAI server-sent events or collected whole.

`events` is the one event loop both APIs stream with (each API shapes only its chunk);
`collect` the non-streamed counterpart. An answer read for tool calls goes through
`read_answer` first, so a streamed answer and a collected one are the same fold of the
same deltas.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ..ipc.messages import TokenLogprob
from .engine_client import EngineRequestError
from .errors import APIError
from .responses import Usage
from .tool_choice import AnswerReader, ToolPlan

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
    error: APIError | None = None  # why an aborted answer was cut (sent after its chunks)


# chunk(delta, logprobs since the last chunk, finish reason, opening) -> one SSE event
ChunkMaker = Callable[[Delta, list[TokenLogprob], Any, bool], str]


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event, framed exactly as OpenAI clients split them."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


# (its first delta when already awaited, its deltas, its chunk maker): one choice
Answer = tuple[Delta | None, AsyncIterator[Delta], ChunkMaker]


async def events(answers: list[Answer], usage: Callable[[Usage], str] | None) -> AsyncIterator[str]:
    """A response's SSE events, in either API's shape, for one or more choices (`n`):
    per choice the opening chunk, a chunk per new text or tool-call fragment (with the
    logprobs of the tokens since its previous chunk) and its finish chunk, the choices'
    chunks interleaved as they come; then the usage chunk if asked (the prompt once,
    every choice's completion tokens), an error event if an answer was cut by the
    server (its shutdown), and [DONE]. An engine error mid-stream is an error event,
    then [DONE]."""
    streams = [_choice_events(first, deltas, chunk) for first, deltas, chunk in answers]
    lasts: list[Delta] = []
    try:
        async for item in interleaved(streams):
            if isinstance(item, Delta):
                lasts.append(item)
            else:
                yield item
    except EngineRequestError as e:
        yield sse(e.body())
        yield DONE
        return
    if usage is not None:
        yield usage(combined_usage([last.usage for last in lasts]))
    cut = next((last.error for last in lasts if last.error is not None), None)
    if cut is not None:
        yield sse(cut.body())
    yield DONE


def combined_usage(choices: list[Usage]) -> Usage:
    """The prompt once (as OpenAI counts it; the first choice's cache hits), every choice's
    completion tokens."""
    first = choices[0]
    completion = sum(usage.completion_tokens for usage in choices)
    details = first.prompt_tokens_details
    return Usage.of(
        first.prompt_tokens,
        completion,
        details.cached_tokens,
        first.image_cache,
        details.host_cached_tokens,
    )


async def _choice_events(
    first: Delta | None, deltas: AsyncIterator[Delta], chunk: ChunkMaker
) -> AsyncIterator[str | Delta]:
    """One choice's chunks, then its last delta (for the usage)."""
    async with closing(deltas):
        if first is None:
            first = await anext(deltas)
        yield chunk(first, list(first.logprobs), None, True)
        pending: list[TokenLogprob] = []
        last = first
        while last.finish_reason is None:
            last = await anext(deltas)
            pending.extend(last.logprobs)
            if last.text or last.tool_calls:
                yield chunk(last, pending, None, False)
                pending = []
        yield chunk(Delta("", None, last.usage), pending, last.finish_reason, False)
        yield last


async def interleaved(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The streams' items as each comes (each stream's own order kept); closing it
    closes every stream. One stream is passed through without tasks."""
    if len(streams) == 1:
        async with closing(streams[0]):
            async for item in streams[0]:
                yield item
        return
    waiting: dict[asyncio.Future[T], AsyncIterator[T]] = {}
    try:
        for stream in streams:
            waiting[asyncio.ensure_future(anext(stream))] = stream
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                stream = waiting.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                waiting[asyncio.ensure_future(anext(stream))] = stream
                yield item
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


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
            yield Delta(content, reason, delta.usage, delta.logprobs, calls, delta.error)
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


async def starting_with(head: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`head`, then `rest`'s deltas; closing it closes `rest`."""
    async with closing(rest):
        yield head
        async for delta in rest:
            yield delta
