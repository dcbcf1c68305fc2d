"""The Hermes tool-call parser: a streamed answer, fed in any split, adds up to the same
content and calls as the whole text parsed at once (OpenAI clients concatenate every
fragment, so nothing may be sent twice or taken back)."""

from __future__ import annotations

import json
import random

import pytest

from iris_serve.server.tool_parser import HermesParser, ParsedAnswer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parse_tool_calls(text: str) -> ParsedAnswer:
    """A whole answer's content and tool calls: the streaming parser fed it at once."""
    parser = HermesParser()
    parser.feed(text)
    parser.finish()
    return parser.answer()


# (model output, expected content, expected [(name, arguments)])
CASES = [
    ("A plain answer, < and <tool included.  ", "A plain answer, < and <tool included.  ", []),
    (f"Let me check.\n{CALL}", "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    (
        '<tool_call>\n{"name": "a", "arguments": {"s": "} \\" </tool_call>", "n": [1, {}]}}'
        '\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n',
        None,
        [("a", '{"s": "} \\" </tool_call>", "n": [1, {}]}'), ("b", "{}")],
    ),
    ('<tool_call>\n{"name": "no_args"}\n</tool_call>', None, [("no_args", "{}")]),
    ('<tool_call>\n{"arguments": {"q": 1}, "name": "late"}\n</tool_call>', None,
     [("late", '{"q": 1}')]),
    ('<tool_call>\n{"name": "s", "arguments": "{\\"k\\": 1}"}\n</tool_call>', None,
     [("s", '{"k": 1}')]),
    ("<tool_call>\nnot a call\n</tool_call>", "<tool_call>\nnot a call\n</tool_call>", []),
    # cut off by max_tokens: a call with the arguments it had (finish_reason says length)
    ('<tool_call>\n{"name": "cut", "arguments": {"city": "Par', None,
     [("cut", '{"city": "Par')]),
]  # fmt: skip


def accumulate(pieces: list[dict]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """What an OpenAI client builds from the deltas: content, calls, and their ids."""
    content, calls = [], {}
    for piece in pieces:
        content.append(piece.get("content", ""))
        for entry in piece.get("tool_calls", ()):
            call = calls.setdefault(entry["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] += entry.get("id", "")
            call["name"] += entry["function"].get("name", "")
            call["arguments"] += entry["function"].get("arguments", "")
    ordered = [calls[i] for i in sorted(calls)]
    return (
        "".join(content),
        [(c["name"], c["arguments"]) for c in ordered],
        [c["id"] for c in ordered],
    )


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_text_gives_content_and_calls(text, content, calls):
    answer = parse_tool_calls(text)
    assert answer.content == content
    assert [(c.name, c.arguments) for c in answer.tool_calls] == calls
    for call in answer.tool_calls:
        if call.name != "cut":
            json.loads(call.arguments)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_split_streams_what_the_whole_text_gives(text, content, calls):
    rng = random.Random(0)
    splits = [[1] * len(text)] + [[rng.randint(1, 6) for _ in range(len(text))] for _ in range(30)]
    for sizes in splits:
        parser, pieces, at = HermesParser(), [], 0
        for size in sizes:
            if at >= len(text):
                break
            pieces += parser.feed(text[at : at + size])
            at += size
        pieces += parser.finish()
        got_content, got_calls, ids = accumulate(pieces)
        assert got_content == (content or "")
        assert got_calls == calls
        assert all(ids) and len(set(ids)) == len(ids)  # each call's id, sent once


def test_arguments_stream_before_the_call_closes():
    parser = HermesParser()
    parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": ')
    pieces = parser.feed('"x"')
    assert pieces == [{"tool_calls": [{"index": 0, "function": {"arguments": '"x"'}}]}]
