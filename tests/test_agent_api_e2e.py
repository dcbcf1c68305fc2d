"""The agent-facing API end to end: the real `iris serve` on a tiny checkpoint with random
weights, driven by the OpenAI SDK. Random weights never write valid JSON on their own
(tests/test_structured_output.py shows it), so every valid answer here is the grammar's
doing: json_schema output on every sample, required and named tool calls whose
arguments satisfy the tool's schema, streamed and not."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.server_harness import iris_server

MODEL = "tiny"
CITY = {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


def weather_arguments_ok(arguments: dict) -> bool:
    return (
        set(arguments) == {"city", "days"}
        and re.fullmatch(CITY["pattern"], arguments["city"]) is not None
        and type(arguments["days"]) is int and 1 <= arguments["days"] <= 7
    )  # fmt: skip


def call_ok(name: str, arguments: str) -> bool:
    parsed = json.loads(arguments)
    return weather_arguments_ok(parsed) if name == "get_weather" else parsed == {}


@pytest.fixture(scope="module")
def client(qwen2_5_vl_tiny, tmp_path_factory):
    with iris_server(
        qwen2_5_vl_tiny,
        "--served-model-name", MODEL,
        "--max-model-len", "1024",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        tmp_path=tmp_path_factory.mktemp("server"),
    ) as server, openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0
    ) as sdk:  # fmt: skip
        yield sdk


def test_json_schema_output_is_valid_on_every_sample(client):
    schema = WEATHER["function"]["parameters"]
    completion = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": schema, "strict": True},
        },
        n=3,
        temperature=1.0,
        seed=11,
        max_completion_tokens=64,
    )
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert weather_arguments_ok(json.loads(choice.message.content))


def test_required_tool_choice_returns_valid_calls(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, CLOCK], tool_choice="required",
        temperature=1.0, seed=5, max_completion_tokens=96,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(call_ok(c.function.name, c.function.arguments) for c in calls)
    assert choice.message.content is None


def test_a_required_call_cut_off_by_max_tokens_keeps_what_was_written(client):
    """Streamed, the name comes as soon as it is written; streamed or not, the call
    comes back with its partial arguments and finish_reason "length"."""
    body = dict(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required",
        temperature=1.0, seed=5, max_completion_tokens=26,  # about half the call
    )  # fmt: skip
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "length"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)  # cut: the arguments as far as they went
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_named_tool_streams_its_arguments_and_the_round_trip_continues(client):
    with client.chat.completions.stream(
        model=MODEL, messages=USER, tools=[WEATHER, CLOCK], temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_completion_tokens=64,
    ) as stream:  # fmt: skip
        events = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        message = stream.get_final_completion().choices[0].message
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and call_ok(
        call.function.name, call.function.arguments
    )
    assert len(events) > 1  # the arguments arrived in pieces

    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22C"},
    ]
    follow_up = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER, CLOCK], max_completion_tokens=4
    )
    assert follow_up.usage.prompt_tokens > 60  # the tools, the call and its result rendered


def test_vllm_constraints_on_both_apis(client):
    choice = client.chat.completions.create(
        model=MODEL, messages=USER, max_completion_tokens=16, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    ).choices[0]  # fmt: skip
    assert choice.message.content in ("sunny", "rainy")
    text = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=16, temperature=1.0,
        extra_body={"guided_regex": r"\d{3}-\d{4}"},
    ).choices[0].text  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text


def test_bad_constraints_are_400s_naming_the_field(client):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "object", "properties": {"a": {"type": "array",
                                                             "uniqueItems": True}}}}}},
         "response_format"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"},
          "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
    ]  # fmt: skip
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=USER, **extra)
        assert refused.value.body["param"] == param, refused.value.body


# A model that answers with a Hermes tool call, forced by a grammar: auto tool choice
# then reads the real engine's tokens, streamed and not.
HERMES_CALL = r"""
start: "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"" CITY "\", \"days\": " DAYS "}}\n</tool_call>"
CITY: /[A-Z][a-z]{1,8}/
DAYS: /[1-7]/
"""


def test_auto_tool_choice_reads_the_engines_hermes_answer(client):
    forced = {"structured_outputs": {"grammar": HERMES_CALL}}
    whole = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, CLOCK], temperature=1.0, seed=2,
        max_completion_tokens=80, extra_body=forced,
    ).choices[0]  # fmt: skip
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert call_ok(call.function.name, call.function.arguments)
    with client.chat.completions.stream(
        model=MODEL, messages=USER, tools=[WEATHER, CLOCK], temperature=1.0, seed=2,
        max_completion_tokens=80, extra_body=forced,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)  # the same seed: the same answer
    ]
