"""Every field of the OpenAI SDK's chat and completion requests, one by one: honoured
(its effect checked: on what reaches the engine or on the response), refused with a 400
naming it, or a field that by definition changes nothing in the answer (then what reaches
the engine is exactly what it is without the field). The field lists are read from the
installed SDK, so a field the SDK adds fails here until Iris decides what to do with it."""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from iris_serve.ipc.messages import StructuredOutput
from iris_serve.server.app import create_app
from tests.fake_engine import MODEL, TEXT, USER, FakeEngine, one_token_each, settings, sse_events

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
Check = Callable[[httpx.Response, FakeEngine], bool]


def sampled(**expected: Any) -> Check:
    def check(_: httpx.Response, engine: FakeEngine) -> bool:
        sampling = engine.requests[0].sampling
        return all(getattr(sampling, k) == v for k, v in expected.items())

    return check


def answer(test: Callable[[dict], bool]) -> Check:
    return lambda response, _: test(response.json())


def streamed(test: Callable[[list[Any]], bool]) -> Check:
    return lambda response, _: test(sse_events(response.text))


def required_schema(engine: FakeEngine) -> dict:
    return json.loads(engine.requests[0].sampling.structured.spec)


# field -> (value, other fields it needs, how its effect shows)
CHAT_HONOURED: dict[str, tuple[Any, dict, Check]] = {
    "messages": (USER, {}, lambda _, e: e.requests[0].messages[0]["content"] == "Say hello."),
    "model": ("alias", {}, answer(lambda a: a["model"] == "alias")),
    "frequency_penalty": (0.5, {}, sampled(frequency_penalty=0.5)),
    "presence_penalty": (-0.5, {}, sampled(presence_penalty=-0.5)),
    "logit_bias": ({"5": 10}, {}, sampled(logit_bias=((5, 10.0),))),
    "logprobs": (True, {}, answer(lambda a: len(a["choices"][0]["logprobs"]["content"]) > 0)),
    "top_logprobs": (2, {"logprobs": True}, answer(
        lambda a: len(a["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2)),
    "max_completion_tokens": (7, {}, sampled(max_tokens=7)),
    "max_tokens": (6, {}, sampled(max_tokens=6)),
    "n": (2, {}, answer(lambda a: [c["index"] for c in a["choices"]] == [0, 1])),
    "response_format": ({"type": "json_object"}, {},
                        sampled(structured=StructuredOutput("json_object"))),
    "seed": (3, {}, sampled(seed=3)),
    "stop": ([" world"], {}, answer(
        lambda a: a["choices"][0]["message"]["content"] == TEXT[: TEXT.index(" world")])),
    "stream": (True, {}, streamed(lambda events: "".join(
        e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == TEXT)),
    "stream_options": ({"include_usage": True}, {"stream": True},
                       streamed(lambda events: events[-1]["usage"]["completion_tokens"] > 0)),
    "temperature": (0.3, {}, sampled(temperature=0.3)),
    "top_p": (0.5, {}, sampled(top_p=0.5)),
    "tools": ([TOOL], {}, lambda _, e: e.requests[0].tools == [TOOL]),
    "tool_choice": ("required", {"tools": [TOOL]},
                    lambda _, e: required_schema(e)["type"] == "array"),
    "parallel_tool_calls": (False, {"tools": [TOOL], "tool_choice": "required"},
                            lambda _, e: required_schema(e)["maxItems"] == 1),
}  # fmt: skip
CHAT_REFUSED: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": {"name": "f"},
    "functions": [{"name": "f"}],
    "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
}
NO_EFFECT: dict[str, Any] = {
    "metadata": {"k": "v"},
    "prompt_cache_key": "agent-7",
    "prompt_cache_options": {},
    "prompt_cache_retention": "24h",
    "safety_identifier": "user-1",
    "service_tier": "auto",
    "store": False,
    "user": "user-1",
}
COMPLETION_HONOURED: dict[str, tuple[Any, dict, Check]] = {
    "prompt": ("Once upon", {}, lambda _, e: e.requests[0].prompt == "Once upon"),
    "model": ("alias", {}, answer(lambda a: a["model"] == "alias")),
    "frequency_penalty": (0.5, {}, sampled(frequency_penalty=0.5)),
    "presence_penalty": (0.5, {}, sampled(presence_penalty=0.5)),
    "logit_bias": ({"7": -5}, {}, sampled(logit_bias=((7, -5.0),))),
    "logprobs": (1, {}, answer(lambda a: len(a["choices"][0]["logprobs"]["top_logprobs"][0]) == 1)),
    "max_tokens": (5, {}, sampled(max_tokens=5)),
    "n": (2, {}, answer(lambda a: len(a["choices"]) == 2)),
    "seed": (9, {}, sampled(seed=9)),
    "stop": ("world", {}, answer(lambda a: a["choices"][0]["text"] == TEXT[: TEXT.index("world")])),
    "stream": (True, {}, streamed(lambda events: "".join(
        e["choices"][0]["text"] for e in events if e["choices"]) == TEXT)),
    "stream_options": ({"include_usage": True}, {"stream": True},
                       streamed(lambda events: events[-1]["usage"]["completion_tokens"] > 0)),
    "temperature": (0.2, {}, sampled(temperature=0.2)),
    "top_p": (0.9, {}, sampled(top_p=0.9)),
}  # fmt: skip
COMPLETION_REFUSED: dict[str, Any] = {"best_of": 2, "echo": True, "suffix": "end"}
COMPLETION_NO_EFFECT = {"user": "user-1"}


def sdk_fields(params: Any) -> set[str]:
    """The SDK's request fields (`stream` is declared by its streaming variant)."""
    return set(typing.get_type_hints(params.CompletionCreateParamsStreaming))


def test_every_sdk_field_has_a_decision():
    chat = set(CHAT_HONOURED) | set(CHAT_REFUSED) | set(NO_EFFECT)
    assert chat == sdk_fields(chat_create_params)
    completion = set(COMPLETION_HONOURED) | set(COMPLETION_REFUSED) | set(COMPLETION_NO_EFFECT)
    assert completion == sdk_fields(completion_create_params)


@pytest.fixture(scope="module")
def _app(qwen2_vl_tiny: Path) -> Iterator[tuple[TestClient, FakeEngine]]:
    engine = FakeEngine()
    app = create_app(settings(qwen2_vl_tiny, tool_call_parser="hermes"), engine)
    with TestClient(app) as client:
        yield client, engine


@pytest.fixture
def api(_app, tokenizer) -> tuple[TestClient, FakeEngine]:
    _app[1].reset(one_token_each(tokenizer))
    return _app


def post(api, path: str, body: dict) -> httpx.Response:
    client, engine = api
    engine.requests.clear()
    return client.post(path, json={"model": MODEL, **body})


CHAT = ("/v1/chat/completions", {"messages": USER})
COMPLETIONS = ("/v1/completions", {"prompt": "Once"})


@pytest.mark.parametrize(
    ("endpoint", "field", "value", "needs", "effect"),
    [(CHAT, f, *spec) for f, spec in CHAT_HONOURED.items()]
    + [(COMPLETIONS, f, *spec) for f, spec in COMPLETION_HONOURED.items()],
    ids=[f"chat-{f}" for f in CHAT_HONOURED] + [f"completions-{f}" for f in COMPLETION_HONOURED],
)
def test_a_field_is_honoured(api, endpoint, field, value, needs, effect):
    path, base = endpoint
    response = post(api, path, {**base, **needs, field: value})
    assert response.status_code == 200, response.text
    assert effect(response, api[1]), response.text


@pytest.mark.parametrize(
    ("endpoint", "field", "value"),
    [(CHAT, f, v) for f, v in CHAT_REFUSED.items()]
    + [(COMPLETIONS, f, v) for f, v in COMPLETION_REFUSED.items()],
    ids=[f"chat-{f}" for f in CHAT_REFUSED] + [f"completions-{f}" for f in COMPLETION_REFUSED],
)
def test_a_field_is_refused_naming_it(api, endpoint, field, value):
    path, base = endpoint
    response = post(api, path, {**base, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert api[1].requests == []


@pytest.mark.parametrize(
    ("endpoint", "field", "value"),
    [(CHAT, f, v) for f, v in NO_EFFECT.items()]
    + [(COMPLETIONS, f, v) for f, v in COMPLETION_NO_EFFECT.items()],
    ids=[f"chat-{f}" for f in NO_EFFECT] + [f"completions-{f}" for f in COMPLETION_NO_EFFECT],
)
def test_a_field_without_effect_changes_nothing(api, endpoint, field, value):
    path, base = endpoint
    assert post(api, path, base).status_code == 200
    without = api[1].requests[0]
    assert post(api, path, {**base, field: value}).status_code == 200
    with_field = api[1].requests[0]
    assert (with_field.sampling, with_field.messages, with_field.prompt) == (
        without.sampling, without.messages, without.prompt,
    )  # fmt: skip
