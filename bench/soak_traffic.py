"""The request mix of `bench.soak`: closed-loop users, each sending one request after
another, cycling through every kind below, so every stretch of a run sees the same mix.

- `agent`: a screenshot agent whose history grows by one new screenshot a turn (the
  answers kept), a new agent every `AGENT_TURNS` turns;
- `window`: an agent sending its last `WINDOW` screenshots, one new a step;
- `video`: a question about one of a few short clips, the clip sent each time;
- `tool_auto` / `tool_required`: a tool call the model may make / must make
  (`tool_choice` "required"), every other one cut by a small `max_tokens`;
- `json_schema`: an answer held to a JSON schema;
- `n2_logprobs`: two sampled choices with their logprobs;
- `cancel`: a stream the client closes after its first tokens;
- `slow`: a stream read slowly, a pause after each chunk.

Each request ends as an `Outcome`: its kind, its error (None when it went as a client
expects; a cancelled stream is `cancelled`, expected), and for streams its TTFT and TPOT.
Every answer is checked for what a client relies on: the status, the choices, a forced
tool call's arguments as JSON, a schema'd answer parsing as JSON unless it was cut.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.images import image_part
from bench.videos import Recording, clip_bytes, video_part

KINDS = (
    "agent", "window", "video", "tool_auto", "tool_required", "json_schema", "n2_logprobs",
    "cancel", "slow",
)  # fmt: skip
EXPECTED = "cancelled"  # the one error a client asks for
SCREENSHOT = (320, 240)
AGENT_TURNS = 6
WINDOW = 4
CLIPS = 3  # clips in the pool, each 2 s of its own recording
CLIP_SIZE, CLIP_FPS = (192, 128), 4.0
MAX_TOKENS = 16
SLOW_READ_SECONDS = 0.1
REQUEST_TIMEOUT_SECONDS = 300.0
TOOLS = [
    {"type": "function", "function": {
        "name": "click", "description": "Click a point of the screen.",
        "parameters": {"type": "object", "properties": {
            "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}},
    {"type": "function", "function": {
        "name": "type_text", "description": "Type text into the focused field.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                       "required": ["text"]}}},
]  # fmt: skip
ACTION_SCHEMA = {
    "type": "object",
    "properties": {"action": {"enum": ["click", "scroll", "done"]}, "x": {"type": "integer"}},
    "required": ["action", "x"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Outcome:
    kind: str
    ended: float  # time.monotonic()
    error: str | None = None
    ttft: float | None = None  # seconds, streams only
    tpot: float | None = None  # seconds per output token after the first, streams only


class AnswerError(Exception):
    """An answer a client could not use; the message is the error's kind."""


Check = Callable[[dict[str, Any]], None]  # raises AnswerError for an answer a client can't use


def clip_pool(seed: int) -> list[bytes]:
    """`CLIPS` short MP4s, each of its own recording (written once per run)."""
    width, height = CLIP_SIZE
    return [
        clip_bytes(Recording(width, height, CLIP_FPS, seed + i), 0.0, 2.0) for i in range(CLIPS)
    ]


@dataclass
class User:
    """One closed-loop client of one server; `index` staggers its kinds and seeds."""

    index: int
    model: str
    clips: Sequence[bytes]
    _seeds: Iterator[int] = field(init=False)
    _history: list[dict[str, Any]] = field(default_factory=list)
    _shown: list[dict[str, Any]] = field(default_factory=list)  # `window`'s screenshots
    _turn: int = 0

    def __post_init__(self) -> None:
        self._seeds = itertools.count(1_000_000 * (self.index + 1))

    async def run(
        self, client: httpx.AsyncClient, base_url: str, until: Callable[[], bool],
        record: Callable[[Outcome], None],
    ) -> None:  # fmt: skip
        """Sends requests until `until()` holds, recording each one's outcome."""
        kinds = itertools.islice(itertools.cycle(KINDS), self.index % len(KINDS), None)
        for kind in kinds:
            if until():
                return
            record(await self.send(client, base_url, kind))

    async def send(self, client: httpx.AsyncClient, base_url: str, kind: str) -> Outcome:
        body, check = getattr(self, f"_{kind}")()
        url = f"{base_url}/v1/chat/completions"
        try:
            if not body.get("stream"):
                response = await client.post(url, json=body)
                answer = _json_answer(response)
                check(answer)
                return Outcome(kind, time.monotonic())
            return await _stream(client, url, body, kind, check)
        except AnswerError as e:
            return Outcome(kind, time.monotonic(), str(e))
        except httpx.HTTPError as e:
            return Outcome(kind, time.monotonic(), f"client: {type(e).__name__}")

    # -- the kinds: each a body and a check of its answer -----------------------------------

    def _body(self, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": messages, "max_tokens": MAX_TOKENS,
                "temperature": 0, **extra}  # fmt: skip

    def _screenshot(self) -> dict[str, Any]:
        return image_part(*SCREENSHOT, seed=next(self._seeds))

    def _agent(self) -> tuple[dict[str, Any], Check]:
        if self._turn % AGENT_TURNS == 0:
            self._history = [{"role": "system", "content": "You are a careful agent."}]
        self._turn += 1
        text = {"type": "text", "text": f"Turn {self._turn}: what changed on the screen?"}
        self._history.append({"role": "user", "content": [self._screenshot(), text]})
        history = self._history

        def keep_answer(answer: dict[str, Any]) -> None:
            history.append({"role": "assistant", "content": answer["text"]})

        return self._body(list(history), stream=True, ignore_eos=True), keep_answer

    def _window(self) -> tuple[dict[str, Any], Check]:
        self._shown = [*self._shown[-(WINDOW - 1) :], self._screenshot()]
        content = [*self._shown, {"type": "text", "text": "Next action?"}]
        return self._body([{"role": "user", "content": content}], stream=True), _any

    def _video(self) -> tuple[dict[str, Any], Check]:
        clip = self.clips[next(self._seeds) % len(self.clips)]
        content = [video_part(clip), {"type": "text", "text": "What happens in this clip?"}]
        body = self._body([{"role": "user", "content": content}], stream=True, ignore_eos=True)
        return body, _any

    def _tool_auto(self) -> tuple[dict[str, Any], Check]:
        messages = [{"role": "user", "content": "Open the settings, then type hello."}]
        return self._body(messages, tools=TOOLS, tool_choice="auto", stream=True), _any

    def _tool_required(self) -> tuple[dict[str, Any], Check]:
        cut = next(self._seeds) % 2 == 0
        content = [self._screenshot(), {"type": "text", "text": "Click the OK button."}]
        body = self._body([{"role": "user", "content": content}], tools=TOOLS,
                          tool_choice="required", max_tokens=6 if cut else 96)  # fmt: skip
        return body, _forced_tool_call

    def _json_schema(self) -> tuple[dict[str, Any], Check]:
        schema = {"type": "json_schema", "json_schema": {"name": "action", "schema": ACTION_SCHEMA}}
        messages = [{"role": "user", "content": "Answer with the next action as JSON."}]
        return self._body(messages, response_format=schema, max_tokens=48), _schema_answer

    def _n2_logprobs(self) -> tuple[dict[str, Any], Check]:
        messages = [{"role": "user", "content": "Name a colour."}]
        body = self._body(messages, n=2, temperature=0.8, seed=next(self._seeds),
                          logprobs=True, top_logprobs=3)  # fmt: skip
        return body, _two_choices_with_logprobs

    def _cancel(self) -> tuple[dict[str, Any], Check]:
        messages = [{"role": "user", "content": "Tell a long story."}]
        return self._body(messages, stream=True, ignore_eos=True, max_tokens=400), _any

    def _slow(self) -> tuple[dict[str, Any], Check]:
        messages = [{"role": "user", "content": "Describe a busy street."}]
        return self._body(messages, stream=True, ignore_eos=True), _any


def _any(answer: dict[str, Any]) -> None:
    pass


def _json_answer(response: httpx.Response) -> dict[str, Any]:
    """A non-streamed answer's first choice: `text`, `finish_reason`, the whole body."""
    if response.status_code != 200:
        raise AnswerError(_http_error(response))
    body = response.json()
    choice = body["choices"][0]
    message = choice["message"]
    return {"text": message.get("content") or "", "finish_reason": choice["finish_reason"],
            "message": message, "body": body}  # fmt: skip


def _http_error(response: httpx.Response) -> str:
    """`HTTP 400 (param)`: the status and the field an OpenAI-style error names."""
    try:
        param = response.json()["error"].get("param")
    except (ValueError, KeyError, AttributeError):
        param = None
    return f"HTTP {response.status_code}" + (f" ({param})" if param else "")


def _forced_tool_call(answer: dict[str, Any]) -> None:
    if answer["finish_reason"] == "length":
        return  # cut by max_tokens: a client sees it was
    calls = answer["message"].get("tool_calls") or []
    if not calls:
        raise AnswerError("no tool call under tool_choice=required")
    for call in calls:
        try:
            json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            raise AnswerError("tool call arguments not JSON") from None


def _schema_answer(answer: dict[str, Any]) -> None:
    if answer["finish_reason"] == "length":
        return
    try:
        value = json.loads(answer["text"])
    except json.JSONDecodeError:
        raise AnswerError("json_schema answer not JSON") from None
    if not isinstance(value, dict) or set(value) != {"action", "x"}:
        raise AnswerError("json_schema answer off its schema")


def _two_choices_with_logprobs(answer: dict[str, Any]) -> None:
    choices = answer["body"]["choices"]
    if len(choices) != 2:
        raise AnswerError(f"n=2 answered {len(choices)} choices")
    for choice in choices:
        if not (choice.get("logprobs") or {}).get("content"):
            raise AnswerError("logprobs missing")


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], kind: str, check: Check
) -> Outcome:
    """Streams `body`; `cancel` hangs up after two content chunks, `slow` pauses after
    each. TTFT: to the first content chunk; TPOT: the rest over the other tokens."""
    body = {**body, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    first: float | None = None
    chunks, text, tokens, finish = 0, [], 0, None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise AnswerError(_http_error(response))
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise AnswerError(f"stream error: {event['error'].get('type')}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("tool_calls"):
                    first = first or time.monotonic()
                    chunks += 1
                    text.append(delta.get("content") or "")
                finish = choice.get("finish_reason") or finish
            if kind == "cancel" and chunks >= 2:
                return Outcome(kind, time.monotonic(), EXPECTED, first and first - start)
            if kind == "slow":
                await asyncio.sleep(SLOW_READ_SECONDS)  # the slow client itself
    end = time.monotonic()
    if finish is None:
        raise AnswerError("stream ended without a finish reason")
    check({"text": "".join(text), "finish_reason": finish})
    ttft = None if first is None else first - start
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    if kind == "slow":
        tpot = None  # the client's own pace
    return Outcome(kind, end, None, ttft, tpot)
