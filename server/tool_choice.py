"""A chat request's `tools` and `tool_choice` → what the prompt shows, how the answer is
constrained and how it is read back, as vLLM serves them:

- `none` (the default without tools): tools, if any, are shown to the model; its answer
  is plain content.
- `auto` (the default with tools; needs `--enable-auto-tool-choice`): the model decides;
  its `<tool_call>` blocks are read by the parser (`server.tool_parser`), and an answer
  with calls finishes with `tool_calls`.
- `required`: decoding is constrained to a JSON array of `{"name", "parameters"}`
  objects, one of the tools each (at least one), read back into calls as the auto path
  reads its blocks (`tool_parser.CallArrayParser`: each name once it is complete, the
  arguments as they are written); finishes with `tool_calls`.
- a named function: decoding is constrained to that tool's parameters schema; the whole
  answer is the call's arguments, streamed as they are written after a first chunk with
  the name. Finishes with `stop`, as OpenAI and vLLM do.

A forced call cut off by `max_tokens` comes back with what was written of it (its name,
the arguments so far) and `finish_reason: "length"`, streamed or not.

`required` and named choices are enforced by the grammar, not hoped for: with random
weights as much as with a real model, the answer is a valid call. `parallel_tool_calls:
false` allows one call: the `required` grammar takes at most one, and an `auto` answer
keeps its first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from .errors import APIError
from .protocol import ChatCompletionRequest, NamedToolChoice
from .tool_parser import (
    CallArrayParser,
    HermesParser,
    ParsedAnswer,
    ToolCall,
    new_call_id,
)

Mode = Literal["none", "auto", "required", "named"]

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class AnswerReader(Protocol):
    """Turns an answer's text deltas into OpenAI delta pieces, then the whole answer."""

    def feed(self, delta: str) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...

    def answer(self) -> ParsedAnswer: ...


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    tools: list[dict[str, Any]] | None = None  # what the chat template renders
    name: str | None = None  # the named function
    single_call: bool = False  # parallel_tool_calls: false

    def reader(self) -> AnswerReader | None:
        if self.mode == "auto":
            return _FirstCallOnly(HermesParser()) if self.single_call else HermesParser()
        if self.mode == "named":
            assert self.name is not None
            return _ArgumentsReader(self.name)
        if self.mode == "required":
            return CallArrayParser()
        return None

    def json_schema(self) -> dict[str, Any] | None:
        """The schema decoding is constrained to (None: unconstrained)."""
        if self.mode == "named":
            return _parameters(self._function(self.name))
        if self.mode == "required":
            assert self.tools is not None
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool["function"]["name"]]},
                        "parameters": _parameters(tool["function"]),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for tool in self.tools
            ]
            most = {"maxItems": 1} if self.single_call else {}
            return {"type": "array", "minItems": 1, **most, "items": {"anyOf": calls}}
        return None

    def finish_reason(self, reason: str | None, answer: ParsedAnswer | None) -> str | None:
        """`tool_calls` for a finished auto or required answer with calls."""
        called = answer is not None and bool(answer.tool_calls)
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def _function(self, name: str | None) -> dict[str, Any]:
        assert self.tools is not None
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def plan_tools(body: ChatCompletionRequest, tool_call_parser: str | None) -> ToolPlan:
    """Checks the request's tools and choice against each other and the server's flags."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools have the same function name twice", param="tools")
    choice = choice or "auto"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        return ToolPlan("named", tools, choice.function.name)
    single_call = body.parallel_tool_calls is False
    if choice == "auto" and tool_call_parser is None:
        raise APIError(
            400,
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
            '(and --tool-call-parser hermes); "required", a named function and "none" '
            "work without it",
            param="tool_choice",
        )
    return ToolPlan(choice, tools, single_call=single_call)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or ANY_OBJECT


class _FirstCallOnly:
    """An auto answer under `parallel_tool_calls: false`: calls after the first dropped."""

    def __init__(self, reader: AnswerReader) -> None:
        self._reader = reader

    def feed(self, delta: str) -> list[dict[str, Any]]:
        return self._first_only(self._reader.feed(delta))

    def finish(self) -> list[dict[str, Any]]:
        return self._first_only(self._reader.finish())

    def answer(self) -> ParsedAnswer:
        answer = self._reader.answer()
        return ParsedAnswer(answer.content, answer.tool_calls[:1])

    @staticmethod
    def _first_only(pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kept = []
        for piece in pieces:
            calls = [c for c in piece.get("tool_calls", ()) if c["index"] == 0]
            if "tool_calls" not in piece:
                kept.append(piece)
            elif calls:
                kept.append({"tool_calls": calls})
        return kept


class _ArgumentsReader:
    """A named choice: the whole answer is the call's arguments."""

    def __init__(self, name: str) -> None:
        self._call = ToolCall(new_call_id(), name, "")
        self._opened = False

    def feed(self, delta: str) -> list[dict[str, Any]]:
        pieces = []
        if not self._opened:
            self._opened = True
            header = {"index": 0, "id": self._call.id, "type": "function",
                      "function": {"name": self._call.name, "arguments": ""}}  # fmt: skip
            pieces.append({"tool_calls": [header]})
        if delta:
            self._call.arguments += delta
            pieces.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
        return pieces

    def finish(self) -> list[dict[str, Any]]:
        return self.feed("") if not self._opened else []

    def answer(self) -> ParsedAnswer:
        return ParsedAnswer(None, [self._call])
