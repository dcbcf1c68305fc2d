"""Chat completions and completions: from a validated body to a response or an SSE stream.

One request's life: build the `TokenizeRequest` (sampling defaults like vLLM's),
`generate` it, turn each engine output into text (`TextStream`), and end it in one of
three ways — the engine finishes it, a stop string cuts it (then the engine is told to
abort), or the client leaves (then too). Nothing is sent before the engine's first
output, so an error found while tokenizing (an unreadable image, a prompt over the
limit) is a plain HTTP error even for `stream=true`. The time from the handler's start to
the first output that carries a token is observed as the request's time to first token;
a request that ends with a finish reason is observed again as it ends (its latencies and
token counts: `MetricsBoard.observe_finished`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import Request

from ..ipc.messages import (
    RequestOutput,
    Sampling,
    TokenizeRequest,
    TokenLogprob,
    context_length_error,
)
from .detokenizer import TextStream
from .engine_client import EngineClient, EngineRequestError
from .errors import APIError, ClientDisconnected
from .logprobs import TokenText, chat_logprobs, completion_logprobs
from .metrics import MetricsBoard
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Usage,
    image_cache,
)
from .streaming import (
    Answer,
    ChunkMaker,
    Delta,
    closing,
    collect,
    combined_usage,
    event_stream,
    events,
    read_answer,
    sse,
    starting_with,
)
from .structured_output import requested_constraint
from .tool_choice import ToolPlan, plan_tools

T = TypeVar("T")


@dataclass(frozen=True)
class _Meta:
    id: str
    created: int
    model: str


class OpenAIServing:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        served_model_names: tuple[str, ...],
        max_model_len: int,
        metrics: MetricsBoard | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        max_logprobs: int = 20,
        tool_call_parser: str | None = None,
    ) -> None:
        self.client = client
        self.tool_call_parser = tool_call_parser  # None: tool_choice "auto" is off
        self.max_logprobs = max_logprobs  # top tokens a request may ask for (vLLM's flag)
        # the model's generation_config.json (`server.generation_config`): a request's
        # own fields win
        self.sampling_defaults = sampling_defaults or {}
        self.metrics = metrics if metrics is not None else MetricsBoard()
        self.tokenizer = tokenizer
        self.token_text = TokenText(tokenizer)
        self.vocab_size = len(tokenizer)
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self._background: set[asyncio.Task[None]] = set()
        self._in_flight: set[str] = set()  # engine request ids with a client waiting
        self._draining = False  # shutting down: an abort now is the server's, not the client's

    @property
    def num_in_flight(self) -> int:
        """Requests with a client waiting for them."""
        return len(self._in_flight)

    async def drain(self) -> None:
        """Ends every request still running, as aborts: each open stream finishes with
        `finish_reason: "abort"` and `[DONE]`, each waiting response with what it has
        (the server's shutdown, once `--shutdown-timeout` is up)."""
        self._draining = True
        for request_id in list(self._in_flight):
            await self.client.abort(request_id)

    # -- routes -------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Any:
        arrival = time.perf_counter()
        meta = self._meta("chatcmpl", body.model)
        plan = plan_tools(body, self.tool_call_parser)
        kwargs = body.mm_processor_kwargs
        messages = [message.wire() for message in body.messages]
        requests = [
            TokenizeRequest(
                request_id=request_id,
                sampling=sampling,
                messages=messages,
                max_pixels=kwargs.max_pixels if kwargs else None,
                min_pixels=kwargs.min_pixels if kwargs else None,
                fps=kwargs.fps if kwargs else None,
                num_frames=kwargs.num_frames if kwargs else None,
                min_frames=kwargs.min_frames if kwargs else None,
                max_frames=kwargs.max_frames if kwargs else None,
                chat_template_kwargs=body.chat_template_kwargs,
                tools=plan.tools,
            )
            for request_id, sampling in self._choices(meta.id, body, plan)
        ]
        logprobs = body.requested_logprobs is not None
        if body.stream:
            streams = [self._deltas(r, body, arrival) for r in requests]
            readers = [plan.reader() for _ in streams]
            streams = [
                deltas if reader is None else read_answer(deltas, reader, plan)
                for deltas, reader in zip(streams, readers, strict=True)
            ]
            first = await _unless_disconnected(raw, anext(streams[0]))
            return self._stream(
                meta,
                first,
                streams,
                self._chat_chunk,
                ChatCompletionChunk,
                body.include_usage,
                logprobs,
            )
        answers = await _unless_disconnected(raw, self._answers(requests, body, arrival))
        choices = [
            ChatChoice(
                index=i,
                **_chat_answer(text, last.finish_reason, plan),
                logprobs=chat_logprobs(items, self.token_text) if logprobs else None,
            )
            for i, (text, last, items) in enumerate(answers)
        ]
        return ChatCompletion(
            id=meta.id, created=meta.created, model=meta.model, choices=choices,
            usage=_usage_of(answers),
        )  # fmt: skip

    async def completion(self, body: CompletionRequest, raw: Request) -> Any:
        arrival = time.perf_counter()
        meta = self._meta("cmpl", body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and max(prompt) >= self.vocab_size:
            raise APIError(400, f"token id {max(prompt)} is out of the vocabulary", param="prompt")
        requests = [
            TokenizeRequest(request_id, sampling, prompt=prompt)
            for request_id, sampling in self._choices(meta.id, body)
        ]
        logprobs = body.requested_logprobs is not None
        if body.stream:
            streams = [self._deltas(r, body, arrival) for r in requests]
            first = await _unless_disconnected(raw, anext(streams[0]))
            return self._stream(
                meta,
                first,
                streams,
                self._completion_chunk,
                Completion,
                body.include_usage,
                logprobs,
            )
        answers = await _unless_disconnected(raw, self._answers(requests, body, arrival))
        choices = [
            CompletionChoice(
                index=i,
                text=text,
                logprobs=completion_logprobs(items, self.token_text) if logprobs else None,
                finish_reason=last.finish_reason,  # pyright: ignore[reportArgumentType]: a FinishReason, typed str on Delta
            )
            for i, (text, last, items) in enumerate(answers)
        ]
        return Completion(
            id=meta.id, created=meta.created, model=meta.model, choices=choices,
            usage=_usage_of(answers),
        )  # fmt: skip

    def check_model(self, model: str | None) -> str:
        """The served name a request asked for (the first one when it names none)."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            # 404 as OpenAI and vLLM answer it (the SDK raises NotFoundError)
            raise APIError(404, f"The model `{model}` does not exist.", param="model")
        return model

    # -- request building ---------------------------------------------------------------

    def _choices(
        self,
        response_id: str,
        body: ChatCompletionRequest | CompletionRequest,
        plan: ToolPlan | None = None,
    ) -> list[tuple[str, Sampling]]:
        """(engine request id, sampling) of each of the `n` choices: choice i of a seeded
        request draws with seed + i, so the choices differ and each is reproducible."""
        sampling = self._sampling(body, plan)
        if body.n == 1:
            return [(response_id, sampling)]
        return [(f"{response_id}-{i}", choice_sampling(sampling, i)) for i in range(body.n)]

    async def _answers(
        self,
        requests: list[TokenizeRequest],
        body: ChatCompletionRequest | CompletionRequest,
        arrival: float,
    ) -> list[tuple[str, Delta, list[TokenLogprob]]]:
        """Every choice's whole answer. The first runs alone until its first token, so its
        prompt's KV pages are in the prefix cache when the others arrive: n choices cost
        one prefill (and each image one encoding), not n."""
        first = self._deltas(requests[0], body, arrival)
        head = await anext(first)
        others = [collect(self._deltas(r, body, arrival)) for r in requests[1:]]
        return list(await asyncio.gather(collect(starting_with(head, first)), *others))

    def _meta(self, prefix: str, model: str | None) -> _Meta:
        return _Meta(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.check_model(model))

    def _sampling(
        self, body: ChatCompletionRequest | CompletionRequest, plan: ToolPlan | None
    ) -> Sampling:
        max_tokens, field = body.max_output_tokens
        too_long = (
            None
            if max_tokens is None
            else context_length_error(self.max_model_len, None, max_tokens)
        )
        if too_long is not None:
            raise APIError(400, too_long, param=field)
        biased = [token for token, _ in body.logit_bias_pairs if token >= self.vocab_size]
        if biased:
            raise APIError(400, f"logit_bias token {biased[0]} is out of the vocabulary",
                           param="logit_bias")  # fmt: skip
        stops = [t for t in body.stop_token_ids or () if not 0 <= t < self.vocab_size]
        if stops:
            raise APIError(400, f"stop_token_ids: token id {stops[0]} is out of the "
                           "vocabulary", param="stop_token_ids")  # fmt: skip
        wanted = body.requested_logprobs
        if wanted is not None and wanted > self.max_logprobs:
            raise APIError(
                400,
                f"at most {self.max_logprobs} top logprobs (--max-logprobs), got {wanted}",
                param="top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs",
            )
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise APIError(
                400,
                f"min_tokens={body.min_tokens} exceeds {field}={max_tokens}",
                param="min_tokens",
            )

        def chosen(name: str, default: Any) -> Any:
            value = getattr(body, name)
            return self.sampling_defaults.get(name, default) if value is None else value

        return Sampling(
            max_tokens=max_tokens or 0,  # 0: as many as the context allows
            temperature=chosen("temperature", 1.0),
            top_p=chosen("top_p", 1.0),
            top_k=max(chosen("top_k", 0), 0),  # -1 and 0 both mean "off"
            seed=body.seed,
            min_tokens=body.min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            repetition_penalty=chosen("repetition_penalty", 1.0),
            min_p=chosen("min_p", 0.0),
            logit_bias=body.logit_bias_pairs,
            logprobs=wanted,
            structured=requested_constraint(body, plan),
        )

    # -- the engine side ----------------------------------------------------------------

    async def _deltas(
        self,
        request: TokenizeRequest,
        body: ChatCompletionRequest | CompletionRequest,
        arrival: float,
    ) -> AsyncIterator[Delta]:
        """The request's text as it comes; aborts it in the engine unless it finished there."""
        text = TextStream(
            self.tokenizer, stop=body.stop_strings, skip_special_tokens=body.skip_special_tokens
        )
        request_id = request.request_id
        self._in_flight.add(request_id)
        settled = False  # nothing of this request runs in the engine any more
        usage = Usage()
        received: list[tuple[float, int]] = []  # (when, tokens) of each output with tokens
        try:
            async with closing(self.client.generate(request)) as outputs:
                async for output in outputs:
                    if output.new_token_ids:
                        received.append((time.perf_counter(), len(output.new_token_ids)))
                        if len(received) == 1:
                            self.metrics.observe_first_token(received[0][0] - arrival)
                    if output.queue_seconds is not None:
                        self.metrics.observe_before_first_token(output)
                    usage = _usage(output, usage)
                    reason = output.finish_reason if output.finished else None
                    piece = text.update(output.new_token_ids, finish_reason=reason)
                    if text.stopped:
                        if not output.finished:
                            await self.client.abort(request_id)
                        settled, reason = True, "stop"
                    settled = settled or output.finished
                    if reason is not None:
                        self.metrics.observe_finished(reason, usage, arrival, received)
                    logprobs = tuple(output.logprobs or ())
                    yield Delta(piece, reason, usage, logprobs, error=self._cut(reason))
                    if reason is not None:
                        return
                settled = True  # the engine ended it without a last output
                self.metrics.observe_finished("abort", usage, arrival, received)
                piece = text.update([], finish_reason="abort")
                yield Delta(piece, "abort", usage, error=self._cut("abort"))
        except EngineRequestError:
            settled = True  # the engine (or a worker) ended it with an error
            raise
        finally:
            self._in_flight.discard(request_id)
            if not settled:
                self.metrics.observe_abandoned()
                self._abort_soon(request_id)

    def _cut(self, finish_reason: str | None) -> APIError | None:
        """The error an aborted answer carries when the server's shutdown aborted it."""
        if finish_reason == "abort" and self._draining:
            return APIError(503, "the server shut down before this request finished "
                                 "(--shutdown-timeout); retry it", type="server_shutdown")  # fmt: skip
        return None

    def _abort_soon(self, request_id: str) -> None:
        """Abort from a cancelled task: a new task, so a pending cancel cannot stop it."""
        task = asyncio.ensure_future(self.client.abort(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- streaming ----------------------------------------------------------------------

    def _stream(
        self,
        meta: _Meta,
        first: Delta,
        streams: list[AsyncIterator[Delta]],
        chunk_maker: Callable[[_Meta, int, bool], ChunkMaker],
        envelope: type[ChatCompletionChunk] | type[Completion],
        include_usage: bool,
        logprobs: bool,
    ) -> Any:
        """The SSE response of `n` choices: the first one's first delta is in; the others
        start as the stream is read (their prompts are in the prefix cache by then)."""
        answers: list[Answer] = [
            (first if i == 0 else None, deltas, chunk_maker(meta, i, logprobs))
            for i, deltas in enumerate(streams)
        ]

        def usage(total: Usage) -> str:
            return sse(envelope(**_fields(meta), choices=[], usage=total))

        return event_stream(events(answers, usage if include_usage else None))

    def _chat_chunk(self, meta: _Meta, index: int, logprobs: bool) -> ChunkMaker:
        def chunk(piece: Delta, items: list[TokenLogprob], finish: Any, opening: bool) -> str:
            # The first chunk goes out with the first token, text or not (clients time
            # TTFT by it) and names the role; the finish chunk's delta is empty.
            delta: dict[str, Any] = {"role": "assistant"} if opening else {}
            if piece.text or opening:
                delta["content"] = piece.text
            if piece.tool_calls:
                delta["tool_calls"] = piece.tool_calls
            choice = ChatChunkChoice(
                index=index,
                delta={} if finish is not None else delta,
                logprobs=chat_logprobs(items, self.token_text) if logprobs and items else None,
                finish_reason=finish,
            )
            return sse(ChatCompletionChunk(**_fields(meta), choices=[choice]))

        return chunk

    def _completion_chunk(self, meta: _Meta, index: int, logprobs: bool) -> ChunkMaker:
        offset = 0  # characters of the answer's tokens so far (text_offset)

        def chunk(piece: Delta, items: list[TokenLogprob], finish: Any, opening: bool) -> str:
            nonlocal offset
            shown = None
            if logprobs and items:
                shown = completion_logprobs(items, self.token_text, offset)
                offset += sum(len(token) for token in shown.tokens)
            choice = CompletionChoice(
                index=index, text=piece.text, logprobs=shown, finish_reason=finish
            )
            return sse(Completion(**_fields(meta), choices=[choice]))

        return chunk


def _chat_answer(text: str, finish_reason: str | None, plan: ToolPlan) -> dict[str, Any]:
    """A whole chat answer's message and finish reason, its tool calls read out."""
    reader = plan.reader()
    if reader is None:
        return {"message": AssistantMessage(content=text), "finish_reason": finish_reason}
    reader.feed(text)
    reader.finish()
    answer = reader.answer()
    calls = [call.openai() for call in answer.tool_calls] or None
    return {
        "message": AssistantMessage(content=answer.content, tool_calls=calls),
        "finish_reason": plan.finish_reason(finish_reason, answer),
    }


def _fields(meta: _Meta) -> dict[str, Any]:
    return {"id": meta.id, "created": meta.created, "model": meta.model}


def _usage(output: RequestOutput, previous: Usage) -> Usage:
    """The usage so far; the image report comes on the first token only, and stays."""
    images = image_cache(output.images) if output.images else previous.image_cache
    return Usage.of(
        output.prompt_tokens,
        output.completion_tokens,
        output.cached_tokens,
        images,
        output.host_cached_tokens,
    )


async def _unless_disconnected(raw: Request, awaitable: Awaitable[T]) -> T:
    """Awaits `awaitable`, unless the client disconnects first (then cancels it)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_wait_for_disconnect(raw.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # its generator's `finally` aborts the request in the engine
    if not work.done():
        await asyncio.wait({work})
        raise ClientDisconnected
    return work.result()


async def _wait_for_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    # The body was read already, so the next message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


def _usage_of(answers: list[tuple[str, Delta, list[TokenLogprob]]]) -> Usage:
    return combined_usage([last.usage for _, last, _ in answers])


def choice_sampling(sampling: Sampling, index: int) -> Sampling:
    """Choice `index`'s sampling of a request for several: a seeded request's choice i
    draws with seed + i (wrapped to int64), so the choices differ and each reproduces."""
    if sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=_wrap_int64(sampling.seed + index))


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63
