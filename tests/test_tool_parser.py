"""The tool-call parsers (Hermes blocks for `auto`, the JSON array of `required`): a
streamed answer, fed in any split, adds up to the same content and calls as the whole
text parsed at once (OpenAI clients concatenate every fragment, so nothing may be sent
twice or taken back), and a call's name and arguments are sent as they are written."""

from __future__ import annotations

import json
import random

import pytest

from iris_serve.server.tool_parser import CallArrayParser, HermesParser, ParsedAnswer

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
    ('<tool_call>\n{"name": "cut", "argu', None, [("cut", "")]),  # nothing made up
]  # fmt: skip

# `tool_choice: "required"`: (the grammar's JSON array, expected [(name, arguments)])
ARRAY_CASES = [
    ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
     '{"name": "get_time", "parameters": {}}]',
     [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")]),
    ('[\n  {"name":"a","parameters":{ "s" : "} ] \\" {", "n": [1, {}] }}\n]',
     [("a", '{ "s" : "} ] \\" {", "n": [1, {}] }')]),
    ('[{"parameters": {"q": 1}, "name": "late"}]', [("late", '{"q": 1}')]),
    # cut off by max_tokens: what was written, and no call before its name is whole
    ('[{"name": "get_weather", "parameters": {"city": "Par', [("get_weather", '{"city": "Par')]),
    ('[{"name": "f", "parameters": {}}, {"name": "get_weather", "param',
     [("f", "{}"), ("get_weather", "")]),
    ('[{"name": "get_wea', []),
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


def streamed(parser: HermesParser | CallArrayParser, text: str, sizes: list[int]) -> list[dict]:
    """Every piece `parser` sends when fed `text` in chunks of `sizes`, then finished."""
    pieces, at = [], 0
    for size in sizes:
        if at >= len(text):
            break
        pieces += parser.feed(text[at : at + size])
        at += size
    return pieces + parser.finish()


def splits(text: str) -> list[list[int]]:
    rng = random.Random(0)
    return [[1] * len(text)] + [[rng.randint(1, 6) for _ in range(len(text))] for _ in range(30)]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_split_streams_what_the_whole_text_gives(text, content, calls):
    for sizes in splits(text):
        got_content, got_calls, ids = accumulate(streamed(HermesParser(), text, sizes))
        assert got_content == (content or "")
        assert got_calls == calls
        assert all(ids) and len(set(ids)) == len(ids)  # each call's id, sent once


@pytest.mark.parametrize(("text", "calls"), ARRAY_CASES)
def test_required_array_whole_and_in_every_split(text, calls):
    whole = CallArrayParser()
    whole.feed(text)
    whole.finish()
    assert whole.answer().content is None
    assert [(c.name, c.arguments) for c in whole.answer().tool_calls] == calls
    for sizes in splits(text):
        content, got_calls, ids = accumulate(streamed(CallArrayParser(), text, sizes))
        assert (content, got_calls) == ("", calls)
        assert all(ids) and len(set(ids)) == len(ids)


def test_a_required_call_streams_its_name_then_its_arguments_as_written():
    parser = CallArrayParser()
    assert parser.feed('[{"name": "get_wea') == []
    header = parser.feed('ther", "parameters": ')[0]["tool_calls"][0]
    assert (header["index"], header["function"]) == (0, {"name": "get_weather", "arguments": ""})
    assert header["id"].startswith("call_") and header["type"] == "function"
    for fragment in ('{"city', '": "Pa', 'ris"}'):
        pieces = parser.feed(fragment)
        assert pieces == [{"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}]
    assert parser.feed("}, ") == []
    assert parser.feed('{"name": "b"')[0]["tool_calls"][0]["index"] == 1


def test_arguments_stream_before_the_call_closes():
    parser = HermesParser()
    parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": ')
    pieces = parser.feed('"x"')
    assert pieces == [{"tool_calls": [{"index": 0, "function": {"arguments": '"x"'}}]}]
