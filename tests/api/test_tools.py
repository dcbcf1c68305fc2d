"""Tool calling through the official OpenAI client against a served app (scripted
engine): the model's Hermes `<tool_call>` answer comes back as `tool_calls`, streamed
and not, identical either way; a tool round trip reaches the worker; and every
misuse is a 400 naming its field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from iris_serve.server.app import create_app
from tests.fake_engine import MODEL, USER, WAIT, FakeEngine, Script, chat, serve_in_thread, settings

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
ANSWER = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def _server(qwen2_vl_tiny: Path) -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine()
    app = create_app(settings(qwen2_vl_tiny, tool_call_parser="hermes"), engine)
    with serve_in_thread(app) as url:
        yield url, engine


def scripted(tokenizer, text: str, finish_reason: str = "stop"):
    """The text one token per output; a "stop" ends with the end-of-turn token, which the
    server never shows (as a real engine stops)."""
    ids = tokenizer.encode(text)
    if finish_reason == "stop":
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return lambda _: Script([[i] for i in ids], finish_reason=finish_reason)


@pytest.fixture
def sdk(_server, tokenizer) -> Iterator[tuple[openai.OpenAI, FakeEngine]]:
    url, engine = _server
    engine.reset(scripted(tokenizer, ANSWER))
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=WAIT) as c:
        yield c, engine


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_auto_tool_calls_come_back_parsed_streamed_or_not(sdk):
    client, engine = sdk
    whole = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "days": 2}),
                                        ("get_time", {})]  # fmt: skip
    assert engine.requests[0].tools == [WEATHER, TIME]  # the template renders them

    # The SDK's own accumulator (it concatenates every fragment) builds the same answer.
    with client.chat.completions.stream(
        model=MODEL, messages=USER, tools=[WEATHER, TIME]
    ) as stream:
        chunks = list(stream)
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == "Let me look."
    assert calls_of(streamed.message) == calls_of(choice.message)
    ids = [c.id for c in streamed.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    fragments = [
        e.chunk.choices[0].delta.tool_calls
        for e in chunks
        if e.type == "chunk" and e.chunk.choices and e.chunk.choices[0].delta.tool_calls
    ]
    assert len(fragments) > 2  # the arguments arrive in pieces, not at the end


def test_a_cut_off_call_finishes_with_length(sdk, tokenizer):
    client, engine = sdk
    engine.reset(scripted(tokenizer, ANSWER[:60], finish_reason="length"))
    choice = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls[0].function.name == "get_weather"


def test_tool_choice_none_renders_tools_and_reads_nothing(sdk):
    client, engine = sdk
    choice = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none"
    ).choices[0]
    assert choice.message.content == ANSWER and not choice.message.tool_calls
    assert choice.finish_reason == "stop" and engine.requests[0].tools == [WEATHER]


def test_a_tool_round_trip_reaches_the_worker_as_sent(sdk):
    client, engine = sdk
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME])
    message = first.choices[0].message
    history = [
        *USER,
        message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in message.tool_calls),
    ]
    client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME])
    sent = engine.requests[-1].messages
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sent[2]["tool_call_id"] == message.tool_calls[0].id


# --- misuse: a 400 naming the field, nothing reaches the engine ------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [WEATHER]}, "tool_choice"),  # auto needs --enable-auto-tool-choice
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
    ],
)  # fmt: skip
def test_tool_misuse_is_refused(client, engine, body, param):
    """`client` serves without --enable-auto-tool-choice."""
    refused = chat(client, **body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"].startswith(param)
    assert engine.requests == []


def test_tool_choice_none_needs_no_flag(client, engine):
    assert chat(client, tools=[WEATHER], tool_choice="none").status_code == 200
    assert engine.requests[0].tools == [WEATHER]


def test_parallel_tool_calls_false_keeps_the_first_call(sdk):
    client, _ = sdk
    whole = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, TIME], parallel_tool_calls=False
    ).choices[0]
    with client.chat.completions.stream(
        model=MODEL, messages=USER, tools=[WEATHER, TIME], parallel_tool_calls=False
    ) as stream:
        streamed = stream.get_final_completion().choices[0]
    for choice in (whole, streamed):
        assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "days": 2})]
        assert choice.finish_reason == "tool_calls"


# --- forced calls (required, named) stream as written; a cut-off one keeps what it had --

NAMED = {"type": "function", "function": {"name": "get_weather"}}
REQUIRED_CUT = '[{"name": "get_weather", "parameters": {"city": "Par'


def streamed_chunks(client, **body) -> list:
    """The chunks of a streamed answer, as the SDK reads them."""
    return list(client.chat.completions.create(model=MODEL, messages=USER, stream=True, **body))


def tool_deltas(chunks) -> list:
    return [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]


@pytest.mark.parametrize(
    ("tool_choice", "text", "arguments"),
    [("required", REQUIRED_CUT, '{"city": "Par'), (NAMED, '{"city": "Par', '{"city": "Par')],
    ids=["required", "named"],
)
def test_a_forced_call_cut_off_by_max_tokens_comes_back_as_written(
    sdk, tokenizer, tool_choice, text, arguments
):
    client, engine = sdk
    engine.reset(scripted(tokenizer, text, finish_reason="length"))
    body = {"tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": 30}
    whole = client.chat.completions.create(model=MODEL, messages=USER, **body).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.content is None
    [call] = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)

    chunks = streamed_chunks(client, **body)
    deltas = tool_deltas(chunks)
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert all(d.index == 0 and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == arguments
    assert len(deltas) > 2  # the arguments came as they were written
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_required_call_streams_its_name_before_its_arguments_end(sdk, tokenizer):
    client, engine = sdk
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]'
    engine.reset(scripted(tokenizer, text))
    chunks = streamed_chunks(client, tools=[WEATHER, TIME], tool_choice="required")
    with_calls = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls]
    first = chunks[with_calls[0]].choices[0].delta.tool_calls[0]
    assert first.function.name == "get_weather"
    assert len(with_calls) > 2  # the name first, then the arguments in pieces
    deltas = tool_deltas(chunks)
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {
        "city": "Paris",
        "days": 2,
    }
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
