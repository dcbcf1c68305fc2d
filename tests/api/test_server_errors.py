"""Every way a request can fail: status, error.type and error.param, OpenAI-style."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from iris_serve.server.app import create_app
from iris_serve.server.engine_client import EngineRequestError
from tests.fake_engine import (
    MAX_MODEL_LEN,
    MODEL,
    USER,
    FakeEngine,
    Script,
    chat,
    settings,
    sse_events,
)

# --- errors ---------------------------------------------------------------------------

_CHAT_ERRORS = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stream": "maybe"}, "stream"),
    ({"stream_options": {"include_usage": []}}, "stream_options"),
    ({"mm_processor_kwargs": {"max_pixels": -5}}, "mm_processor_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"stop_token_ids": [1696548]}, "stop_token_ids"),  # the sampler indexes logits by it
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),  # over --max-logprobs
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
]


@pytest.mark.parametrize(("fields", "param"), _CHAT_ERRORS)
def test_chat_request_errors(client, engine, fields, param):
    response = chat(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"] and error["code"] == 400
    assert engine.requests == []  # refused before reaching the engine


@pytest.mark.parametrize(
    ("field", "literal"),
    [("temperature", "Infinity"), ("top_p", "NaN"), ("frequency_penalty", "-Infinity")],
)
def test_a_non_finite_number_is_refused_naming_its_field(client, engine, field, literal):
    """Python's JSON reader takes Infinity and NaN, which no client library sends but a
    hand-written body can: a 400 naming the field, not a sampler fed inf."""
    body = json.dumps({"model": MODEL, "messages": USER})[:-1] + f', "{field}": {literal}}}'
    response = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert engine.requests == []


TEXT = {"type": "text", "text": "What is this?"}
SUPPORTED = "the supported types are text, image_url, video_url and image_embeds"
# (the refused part, what the error says of it)
_PARTS_NOT_TAKEN = {
    "video": ({"type": "video", "video": "https://x/v.mp4"},
              "'video' are not supported (send a video as {\"type\": \"video_url\""),
    "input_audio": ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                    "'input_audio' are not supported (audio input is not supported)"),
    "file": ({"type": "file", "file": {"file_id": "f"}},
             "'file' are not supported (file inputs are not supported)"),
    "image": ({"type": "image", "image": "https://x/a.png"}, "'image' are not supported;"),
    "made up": ({"type": "hologram"}, "'hologram' are not supported;"),
    "a type not a string": ({"type": {}}, "of type {} are not supported;"),
    "no type": ({"text": "hi"}, "a content part needs a type"),
    "not an object": ("hi", "a content part must be an object"),
}  # fmt: skip


@pytest.mark.parametrize("case", _PARTS_NOT_TAKEN)
def test_a_content_part_iris_does_not_take_is_named_with_the_supported_types(client, engine, case):
    part, says = _PARTS_NOT_TAKEN[case]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "user", "content": [TEXT, part]},
    ]
    response = chat(client, messages=messages)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    where = "messages[2].content[1]" + (".type" if isinstance(part, dict) else "")
    assert error["param"] == where and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{where}: ") and says in error["message"]
    assert SUPPORTED in error["message"] and "expected tags" not in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_completion_request_errors(client, engine, body, param):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.requests == []


@pytest.mark.parametrize(
    "raw", [b'{"model": "tiny-vl", "messages": [', b"[1, 2]", b"null", b"not json"]
)
def test_malformed_bodies_are_400s(client, raw):
    response = client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_engine_errors_keep_their_status_even_when_streaming(client, engine, tokenizer):
    too_long = EngineRequestError(400, "prompt is 300 tokens; limit 256", param="messages")
    engine.reset(lambda _: Script([], error=too_long))
    for stream in (False, True):
        response = chat(client, stream=stream)
        assert engine.aborted == []  # the engine ended it already
        assert response.status_code == 400
        assert response.json()["error"] == {
            "message": "prompt is 300 tokens; limit 256",
            "type": "invalid_request_error",
            "param": "messages",
            "code": 400,
        }
    crashed = EngineRequestError(500, "engine died", "server_error")
    engine.reset(lambda _: Script([], error=crashed))
    response = client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"

    # An error after the stream started ends it with an error event, then [DONE].
    engine.reset(lambda _: Script([tokenizer.encode("Hi")], error=crashed))
    events = sse_events(chat(client, stream=True).text)
    assert events[0]["choices"][0]["delta"]["content"] == "Hi"
    assert events[-1] == {
        "error": {"message": "engine died", "type": "server_error", "param": None, "code": 500}
    }
    # ... and the server goes on serving.
    engine.reset(lambda _: Script([tokenizer.encode("ok")]))
    assert chat(client).json()["choices"][0]["message"]["content"] == "ok"


def test_unknown_route_and_method(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == 404
    assert client.get("/v1/chat/completions").status_code == 405


def test_api_key(qwen2_vl_tiny, tokenizer):
    engine = FakeEngine(lambda _: Script([tokenizer.encode("ok")]))
    with TestClient(create_app(settings(qwen2_vl_tiny, api_key="sekret"), engine)) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for path, method in [("/v1/models", "GET"), ("/v1/chat/completions", "POST")]:
                response = c.request(method, path, headers=headers, json={"messages": USER})
                assert response.status_code == 401
                assert response.json()["error"]["type"] == "authentication_error"
        assert engine.requests == []
        ok = {"Authorization": "Bearer sekret"}
        assert (
            c.post("/v1/chat/completions", headers=ok, json={"messages": USER}).status_code == 200
        )
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.get("/health").status_code == 200  # open without a key
        assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 200


# --- known fields not implemented yet: refused, never ignored -------------------------

# (field, a value that changes the answer, the value a client sends for "off")
_UNIMPLEMENTED_CHAT = [
    ("prompt_logprobs", 1, None),
    ("best_of", 2, 1),
    ("use_beam_search", True, False),
    ("length_penalty", 0.5, 1.0),
    ("include_stop_str_in_output", True, False),
    ("bad_words", ["no"], []),
    ("allowed_token_ids", [1, 2], None),
    ("truncate_prompt_tokens", 16, None),
    ("logits_processors", ["x"], None),
    ("prediction", {"type": "content", "content": "x"}, None),
    ("functions", [{"name": "f"}], None),
    ("function_call", {"name": "f"}, "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}, None),
    ("modalities", ["text", "audio"], ["text"]),
    ("web_search_options", {}, None),  # {} asks for web search with default options
    ("reasoning_effort", "low", None),
    ("add_generation_prompt", False, True),
    ("continue_final_message", True, False),
    ("echo", True, False),
    ("chat_template", "{{ messages }}", None),
    ("documents", [{"text": "x"}], None),
]


@pytest.mark.parametrize(("field", "value", "off"), _UNIMPLEMENTED_CHAT)
def test_a_chat_field_not_implemented_is_refused_unless_off(client, engine, field, value, off):
    refused = chat(client, **{field: value})
    assert refused.status_code == 400, f"{field}={value!r} was accepted"
    error = refused.json()["error"]
    assert error["param"] == field and "refuses it rather than ignore it" in error["message"]
    assert engine.requests == []
    assert chat(client, **{field: off}).status_code == 200, f"{field}={off!r} was refused"


@pytest.mark.parametrize(("field", "value", "off"), [("echo", True, False), ("suffix", "end", "")])
def test_a_completion_field_not_implemented_is_refused_unless_off(client, field, value, off):
    body = {"prompt": "Once", "max_tokens": 2}
    refused = client.post("/v1/completions", json={**body, field: value})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    assert client.post("/v1/completions", json={**body, field: off}).status_code == 200


def test_an_unknown_model_is_a_404_everywhere_and_a_known_one_has_its_card(client, engine):
    for response in (
        chat(client, model="gpt-5"),
        client.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"}),
        client.get("/v1/models/gpt-5"),
    ):
        assert response.status_code == 404, response.text
        assert response.json()["error"]["param"] == "model"
    assert engine.requests == []
    card = client.get("/v1/models/alias")
    assert card.status_code == 200 and card.json()["id"] == "alias"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"do_sample_frames": False}, "mm_processor_kwargs.do_sample_frames"),
        ({"size": {"longest_edge": 4096}}, "mm_processor_kwargs.size"),
        ({"fps": 1, "num_frames": 4}, "fps and num_frames are mutually exclusive"),
        ({"fps": 0}, "mm_processor_kwargs.fps"),
        ({"num_frames": 1}, "mm_processor_kwargs.num_frames"),
    ],
)
def test_a_processor_setting_iris_does_not_take_is_refused_by_name(client, engine, kwargs, says):
    response = chat(client, mm_processor_kwargs=kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "mm_processor_kwargs" and says in error["message"]
    assert engine.requests == []


def test_a_video_part_needs_a_url_or_a_uuid(client, engine):
    part = {"type": "video_url", "video_url": None}
    response = chat(client, messages=[{"role": "user", "content": [TEXT, part]}])
    assert response.status_code == 400, response.text
    assert "a video part needs video_url.url" in response.json()["error"]["message"]
    assert engine.requests == []


def test_vllm_media_io_kwargs_are_refused_rather_than_ignored(client, engine):
    response = chat(client, media_io_kwargs={"video": {"num_frames": 8}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "media_io_kwargs" and "mm_processor_kwargs" in error["message"]
    assert engine.requests == []
