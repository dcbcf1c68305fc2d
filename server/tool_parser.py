"""Hermes-style tool calls in generated text → OpenAI `tool_calls`, streamed or not.

Qwen2.5-VL and Qwen3-VL answer a tool request with
`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` blocks (the format their
chat templates ask for; vLLM's and SGLang's `hermes` parser). `HermesParser` reads the
text as it is generated and turns it into OpenAI chat deltas:

- text outside the blocks is `content`; whitespace next to a block is dropped (the
  newlines between calls), and a partial `<tool_call>` at the end of the text is held
  back until it is known to be one;
- a call's first delta carries `index`, `id`, `type` and `function.name` (once the name is
  complete), the next ones only `function.arguments` fragments: the model's own text of
  the arguments object, strictly appended, never the block's closing brace (the OpenAI
  SDK concatenates every fragment, so nothing may be sent twice or taken back);
- a block whose JSON does not start with its name is held until it closes, then sent
  whole (or as content, when it is not a call at all); a call without arguments gets `{}`.

A non-streamed answer is the same parser fed the whole text at once,
so a streamed answer and a non-streamed one can never disagree (the tests feed every
split). A block cut off by `max_tokens` stays a call with what was written of its
arguments (none, if they had not begun), as OpenAI returns it with `finish_reason:
"length"`.

`CallArrayParser` reads `tool_choice: "required"`'s answer, a JSON array of
`{"name": ..., "parameters": {...}}` objects (the form its grammar allows), the same
way: each call's name as soon as it is complete, its arguments as they are written.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

# `{"name": "<json string>"` at the start of a block, then `, "arguments":`
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_PARAMETERS_KEY = re.compile(r'\s*,\s*"parameters"\s*:\s*')  # `required`'s array items


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One whole call, as a non-streamed answer carries it."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedAnswer:
    content: str | None  # None when the answer is only tool calls
    tool_calls: list[ToolCall]


@dataclass
class _Call:
    """The call being read: where it starts in the text and what of it was sent."""

    start: int  # its JSON's start: right after OPEN_TAG, or an array item's "{"
    index: int | None = None  # its place in `tool_calls`, once its header was sent
    id: str = ""
    name: str = ""
    name_end: int = 0
    value: _JsonValue | None = None  # the arguments' value, once its key was read
    arguments: list[str] = field(default_factory=list)  # fragments sent


class _CallSender:
    """What both parsers send of a call: its header once (index, id, type, name), then
    its arguments strictly appended; `calls` holds the calls whose reading ended."""

    def __init__(self) -> None:
        self.text = ""
        self._call: _Call | None = None
        self.calls: list[ToolCall] = []

    def _send_header(self, call: _Call, name: str, pieces: list[dict[str, Any]]) -> None:
        call.index, call.id, call.name = len(self.calls), new_call_id(), name
        function = {"name": name, "arguments": ""}
        header = {"index": call.index, "id": call.id, "type": "function", "function": function}
        pieces.append({"tool_calls": [header]})

    def _send_arguments(self, call: _Call, fragment: str, pieces: list[dict[str, Any]]) -> None:
        if fragment:
            call.arguments.append(fragment)
            fragments = {"index": call.index, "function": {"arguments": fragment}}
            pieces.append({"tool_calls": [fragments]})

    def _send_whole(
        self, call: _Call, whole: dict[str, Any] | None, key: str, pieces: list[dict[str, Any]]
    ) -> None:
        """A closed call none of whose arguments were sent: its `key` value whole (a
        string as it is, anything else as JSON), `{}` when it has none."""
        arguments = whole.get(key, {}) if whole is not None else {}
        text = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        self._send_arguments(call, text, pieces)

    def _read_call(
        self,
        key: re.Pattern[str],
        limit: int,
        pieces: list[dict[str, Any]],
        value_limit: int | None = None,
    ) -> None:
        """Reads the open call: its header once `{"name": "..."` is whole, then the value
        after `key` (`, "arguments":`) as it comes; the name and the key are looked for
        before `limit`, the value read up to `value_limit` (by default `limit` too)."""
        call = self._call
        assert call is not None
        text = self.text
        if call.index is None:
            named = _NAME.match(text, call.start, limit)
            if named is not None:
                self._send_header(call, json.loads(named.group(1)), pieces)
                call.name_end = named.end()
        if call.index is not None and call.value is None:
            found = key.match(text, call.name_end, limit)
            if found is not None:
                call.value = _JsonValue(found.end())
        end = limit if value_limit is None else value_limit
        if call.value is not None and call.value.read(text, end):
            self._send_arguments(call, call.value.sendable(text), pieces)

    def _end_call(self, call: _Call) -> None:
        self.calls.append(ToolCall(call.id, call.name, "".join(call.arguments)))


class HermesParser(_CallSender):
    """Feeds on text deltas; returns the OpenAI delta pieces each one completes:
    `{"content": ...}` or `{"tool_calls": [...]}` (one call each)."""

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0  # the text before this is handled
        self._after_block = False  # whitespace here is between blocks: dropped
        self._content: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self.calls) or (self._call is not None and self._call.index is not None)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        pieces: list[dict[str, Any]] = []
        while self._step(pieces, final=False):
            pass
        return pieces

    def finish(self) -> list[dict[str, Any]]:
        """What the end of the text releases: held-back content, a cut-off call's rest."""
        pieces: list[dict[str, Any]] = []
        while self._step(pieces, final=True):
            pass
        if self._call is not None:
            self._close_call(len(self.text), closed=False, pieces=pieces)
            self._step(pieces, final=True)
        return pieces

    def answer(self) -> ParsedAnswer:
        content = "".join(self._content)
        return ParsedAnswer(content if content or not self.calls else None, self.calls)

    # -- outside a block ------------------------------------------------------------

    def _step(self, pieces: list[dict[str, Any]], final: bool) -> bool:
        """Handles what it can of the unhandled text; True when there may be more."""
        if self._call is not None:
            return self._step_call(pieces)
        rest = self.text[self._pos :]
        if self._after_block:
            skipped = len(rest) - len(rest.lstrip())
            self._pos += skipped
            rest = rest[skipped:]
        tag = rest.find(OPEN_TAG)
        if tag >= 0:
            self._say(rest[:tag].rstrip(), pieces)
            self._pos += tag + len(OPEN_TAG)
            self._call = _Call(start=self._pos)
            return True
        if final:
            self._say(rest.rstrip() if self.called else rest, pieces)
            self._pos = len(self.text)
            return False
        # Hold back what may still become a tag, and whitespace that may precede one.
        sendable = rest[: len(rest) - _partial_tag_length(rest)].rstrip()
        self._say(sendable, pieces)
        self._pos += len(sendable)
        return False

    def _say(self, text: str, pieces: list[dict[str, Any]]) -> None:
        if text:
            self._after_block = False
            self._content.append(text)
            pieces.append({"content": text})

    # -- inside a block -------------------------------------------------------------

    def _step_call(self, pieces: list[dict[str, Any]]) -> bool:
        call = self._call
        assert call is not None
        text = self.text
        # The block's end bounds the name and the key; the arguments are read to the end
        # of the text, and the block's end is only looked for after them: a string in
        # them may hold "</tool_call>".
        header_end = len(text) if call.value is not None else _end_of_block(text, call.start)
        self._read_call(_ARGUMENTS_KEY, header_end, pieces, len(text))
        search_from = call.start
        if call.value is not None:
            if not call.value.done:
                return False
            search_from = call.value.pos
        close = text.find(CLOSE_TAG, search_from)
        if close >= 0:
            self._close_call(close, closed=True, pieces=pieces)
            return True
        return False

    def _close_call(self, end: int, closed: bool, pieces: list[dict[str, Any]]) -> None:
        """Ends the block at `end`: a call gets what it still lacks; a block that is no
        call is content after all."""
        call = self._call
        assert call is not None
        self._call = None
        self._pos = end + len(CLOSE_TAG) if closed else end
        body = self.text[call.start : end]
        whole = _json_object(body)
        if call.index is None:
            if whole is None or not isinstance(whole.get("name"), str):
                self._say(OPEN_TAG + body + (CLOSE_TAG if closed else ""), pieces)
                return
            self._send_header(call, whole["name"], pieces)
        if not call.arguments and (closed or whole is not None):
            self._send_whole(call, whole, "arguments", pieces)
        self._end_call(call)
        self._after_block = True


class CallArrayParser(_CallSender):
    """`tool_choice: "required"`: the answer is a JSON array of `{"name", "parameters"}`
    objects, read as `HermesParser` reads a block: a call's header once its name is
    complete, its arguments (the `parameters` object's own text) as they are written;
    an object whose name does not come first is sent whole when it closes. A call cut
    off keeps what was written of it; one cut before its name is whole is no call."""

    def __init__(self) -> None:
        super().__init__()
        self._scanned = 0
        self._nesting = JsonNesting()

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        pieces: list[dict[str, Any]] = []
        for i in range(self._scanned, len(self.text)):
            structure = self._nesting.push(self.text[i])
            if structure == "{" and self._nesting.depth == 2:  # an item of the array opens
                self._call = _Call(start=i)
            elif structure == "}" and self._nesting.depth == 1 and self._call is not None:
                self._read_call(_PARAMETERS_KEY, i + 1, pieces)
                self._close(i + 1, closed=True, pieces=pieces)
        self._scanned = len(self.text)
        if self._call is not None:
            self._read_call(_PARAMETERS_KEY, len(self.text), pieces)
        return pieces

    def finish(self) -> list[dict[str, Any]]:
        pieces: list[dict[str, Any]] = []
        if self._call is not None:
            self._close(len(self.text), closed=False, pieces=pieces)
        return pieces

    def answer(self) -> ParsedAnswer:
        return ParsedAnswer(None, self.calls)

    def _close(self, end: int, closed: bool, pieces: list[dict[str, Any]]) -> None:
        call = self._call
        assert call is not None
        self._call = None
        whole = _json_object(self.text[call.start : end]) if closed else None
        if call.index is None:
            if whole is None or not isinstance(whole.get("name"), str):
                return  # cut before its name was whole, or no call (the grammar rules it out)
            self._send_header(call, whole["name"], pieces)
        if not call.arguments and closed:
            self._send_whole(call, whole, "parameters", pieces)
        self._end_call(call)


class JsonNesting:
    """Where JSON text stands, character by character: inside a string or not, and how
    deep in brackets (escapes tracked, so a `}` inside a string is no bracket)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self._escaped = False

    def push(self, char: str) -> str | None:
        """Advances by `char`; returns it when it is structure (a bracket, or the quote
        that closes a string), else None."""
        if self.in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self.in_string = False
                return char
            return None
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
            return char
        elif char in "}]":
            self.depth -= 1
            return char
        return None


class _JsonValue:
    """Reads one JSON value as it arrives, without parsing it: where it starts, how far
    it goes so far and whether it is complete (brackets and strings tracked, so a `}`
    inside a string does not end it)."""

    def __init__(self, start: int) -> None:
        self.start = start  # of the value, once its first character arrived
        self.pos = start
        self.began = False
        self._opening = ""
        self.done = False
        self.sent = start
        self._nesting = JsonNesting()

    @property
    def is_container(self) -> bool:
        return self.began and self._opening in "{["

    def read(self, text: str, limit: int) -> bool:
        """Advances to `limit`; True when there may be something new to send."""
        while self.pos < limit and not self.done:
            char = text[self.pos]
            if not self.began:
                if char.isspace():
                    self.pos += 1
                    self.start = self.sent = self.pos
                    continue
                self.began, self._opening = True, char
                if char not in '{["':
                    self.done = True  # not an object: the block's end decides (see sendable)
                    break
            structure = self._nesting.push(char)
            if structure is not None and structure not in "{[":
                self.done = self._nesting.depth == 0  # a closing bracket or quote
            self.pos += 1
        return self.began

    def sendable(self, text: str) -> str:
        """The value's text not sent yet: objects and arrays as they come; strings whole
        (decoded: arguments sent as a JSON string are that string), once complete;
        other values never (they are not arguments; the block's end decides)."""
        if self.is_container:
            fragment, self.sent = text[self.sent : self.pos], self.pos
            return fragment
        if self._opening == '"' and self.done and self.sent < self.pos:
            self.sent = self.pos
            return str(json.loads(text[self.start : self.pos]))
        return ""


def _end_of_block(text: str, start: int) -> int:
    close = text.find(CLOSE_TAG, start)
    return close if close >= 0 else len(text)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _partial_tag_length(text: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of OPEN_TAG."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0
