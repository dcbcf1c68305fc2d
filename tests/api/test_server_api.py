"""The HTTP server's API shapes against a scripted engine (`tests.fake_engine`) and the
tiny checkpoint's real tokenizer, through Starlette's TestClient."""

from __future__ import annotations

import base64
import json

import pytest
from fastapi.testclient import TestClient

from iris_serve.ipc.messages import Sampling
from iris_serve.server.app import create_app
from tests.fake_engine import (
    MAX_MODEL_LEN,
    MODEL,
    TEXT,
    USER,
    FakeEngine,
    Script,
    chat,
    one_token_each,
    settings,
    sse_events,
)

# --- chat completions ---------------------------------------------------------------


def test_chat_completion(client, engine, tokenizer):
    response = chat(client)
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": TEXT}
    assert choice["finish_reason"] == "length"
    n = len(tokenizer.encode(TEXT))
    assert body["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": n,
        "total_tokens": 11 + n,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    [request] = engine.requests
    assert request.request_id == body["id"] and request.messages == USER
    # No max_tokens: 0 lets the scheduler fill the context; vLLM's sampling defaults.
    assert request.sampling == Sampling(max_tokens=0, temperature=1.0, top_p=1.0)
    assert engine.aborted == []


def test_chat_stream_with_usage(client, engine, tokenizer):
    response = chat(client, stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    events = sse_events(response.text)
    first, *contents, finish, usage = events
    assert {e["id"] for e in events} == {engine.requests[0].request_id}
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL for e in events)
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["delta"]["content"] for c in contents)
    assert all(c["choices"][0]["finish_reason"] is None for c in [first, *contents])
    text = first["choices"][0]["delta"]["content"]
    text += "".join(c["choices"][0]["delta"]["content"] for c in contents)
    assert text == TEXT
    assert finish["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert usage["choices"] == []
    n = len(tokenizer.encode(TEXT))
    assert usage["usage"]["completion_tokens"] == n and usage["usage"]["prompt_tokens"] == 11
    assert all("usage" not in e for e in events[:-1])


def test_chat_stream_without_usage_and_a_one_token_answer(client, engine, tokenizer):
    engine.reset(lambda _: Script([tokenizer.encode("Hi")], finish_reason="stop"))
    events = sse_events(chat(client, stream=True).text)
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": "H"},  # "Hi" minus the stop token ("i" here)
        {},
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_utf8_split_over_tokens_streams_whole_characters(client, engine, tokenizer):
    text = "Hi 😀 世界! 👩‍👩‍👧"
    engine.reset(lambda _: Script([[i] for i in tokenizer.encode(text)]))
    events = sse_events(chat(client, stream=True).text)
    pieces = [e["choices"][0]["delta"].get("content", "") for e in events]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert chat(client).json()["choices"][0]["message"]["content"] == text


# --- stop strings -------------------------------------------------------------------


def test_stop_string_across_tokens_cuts_and_aborts(client, engine):
    body = chat(client, stop="lo w").json()  # "Hello world" is H|el|lo| wor|ld
    assert body["choices"][0]["message"]["content"] == "Hel"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted == [body["id"]]


def test_stop_string_in_a_stream_never_leaks_past_it(client, engine):
    events = sse_events(chat(client, stream=True, stop=["xyz", ", how"]).text)
    pieces = [e["choices"][0]["delta"].get("content", "") for e in events]
    assert "".join(pieces) == "Hello world"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted == [events[0]["id"]]


def test_stop_string_in_the_last_output_needs_no_abort(client, engine):
    body = chat(client, stop=["you?"]).json()
    assert body["choices"][0]["message"]["content"] == "Hello world, how are "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted == []  # the engine had finished it already


# --- completions --------------------------------------------------------------------


def test_completion_and_its_stream(client, engine, tokenizer):
    response = client.post("/v1/completions", json={"model": "alias", "prompt": "Once"})
    body = response.json()
    assert response.status_code == 200 and body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-") and body["model"] == "alias"
    assert body["choices"] == [
        {"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"]["total_tokens"] == 11 + len(tokenizer.encode(TEXT))
    assert engine.requests[0].prompt == "Once" and engine.requests[0].messages is None

    response = client.post(
        "/v1/completions",
        json={"prompt": [[5, 6, 7]], "stream": True, "stream_options": {"include_usage": True}},
    )
    *chunks, finish, usage = sse_events(response.text)
    assert engine.requests[1].prompt == [5, 6, 7]
    assert all(c["object"] == "text_completion" for c in [*chunks, finish, usage])
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT
    assert all(c["choices"][0]["text"] for c in chunks)
    assert finish["choices"][0]["text"] == "" and finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 11
    assert finish["model"] == MODEL  # no model named: the first served name


# --- request fields -----------------------------------------------------------------


def test_sampling_fields_reach_the_engine(client, engine):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]},
    ]
    response = chat(
        client,
        messages=messages,
        max_tokens=99,
        max_completion_tokens=20,
        temperature=0.5,
        top_p=0.9,
        top_k=-1,
        seed=42,
        min_tokens=2,
        stop_token_ids=[7, 8],
        ignore_eos=True,
        mm_processor_kwargs={"max_pixels": 50176, "min_pixels": 3136},
        chat_template_kwargs={"enable_thinking": False},
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.05,
        logit_bias={"9": 5, "3": -100, "4": 0},
    )
    assert response.status_code == 200
    [request] = engine.requests
    assert request.sampling == Sampling(
        max_tokens=20,  # max_completion_tokens wins over the older max_tokens
        temperature=0.5,
        top_p=0.9,
        top_k=0,
        seed=42,
        min_tokens=2,
        stop_token_ids=(7, 8),
        ignore_eos=True,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.05,
        logit_bias=((3, -100.0), (9, 5.0)),  # a zero bias is no bias
    )
    assert request.messages == messages  # images pass through as URLs
    assert (request.max_pixels, request.min_pixels) == (50176, 3136)
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_unknown_fields_are_ignored(client, engine):
    response = chat(
        client,
        frequency_penalty=0.0,
        logit_bias={},
        user="me",
        some_future_field={"x": 1},
        messages=[{"role": "user", "content": "hi", "name": "bob"}],
    )
    assert response.status_code == 200
    assert engine.requests[0].messages == [{"role": "user", "content": "hi", "name": "bob"}]


def test_a_request_shaped_like_vllm_bench_random_mm(client, engine, tokenizer):
    """The body `vllm bench serve --backend openai-chat --dataset-name random-mm` posts,
    parsed the way its client parses the stream (split on blank lines, `data: ` prefix,
    text from choices[0].delta.content, counts from the usage-only chunk)."""
    jpeg = "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff\xe0fake").decode()
    content = [
        {"type": "text", "text": "random words " * 8},
        {"type": "image_url", "image_url": {"url": jpeg}},
    ]
    ids = tokenizer.encode("tokens " * 20)[:16]
    engine.reset(lambda _: Script([[i] for i in ids], prompt_tokens=1234))
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_completion_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    response = client.post(
        "/v1/chat/completions", json=payload, headers={"x-request-id": "bench-0"}
    )
    assert response.status_code == 200
    generated, chunks_with_choices, output_tokens, prompt_len, buffer = "", 0, None, None, ""
    for piece in response.iter_bytes(chunk_size=7):  # arbitrary network splits
        buffer += piece.decode()
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            chunk = message.strip().removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if choices := data.get("choices"):
                chunks_with_choices += 1
                generated += choices[0]["delta"].get("content") or ""
            elif usage := data.get("usage"):
                output_tokens = usage.get("completion_tokens")
                prompt_len = usage.get("prompt_tokens")
    assert buffer == ""
    assert generated == tokenizer.decode(ids)
    assert (output_tokens, prompt_len) == (16, 1234)  # prompt_tokens count image tokens
    assert chunks_with_choices >= 2
    [request] = engine.requests
    assert request.messages == payload["messages"]
    assert request.sampling == Sampling(max_tokens=16, temperature=0.0, ignore_eos=True)


# --- the small endpoints --------------------------------------------------------------


def test_models_health_version(client, qwen2_vl_tiny):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"]
    for card in models["data"]:
        assert card["object"] == "model" and card["owned_by"] == "iris"
        assert card["root"] == str(qwen2_vl_tiny) and card["max_model_len"] == MAX_MODEL_LEN
        assert isinstance(card["created"], int)
    health = client.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert client.get("/version").json() == {"version": "0.1.0"}
    metrics = client.get("/metrics")  # the fake engine sends no stats: zeros, histograms
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")


def test_tokenize_and_detokenize(client, tokenizer):
    body = client.post("/tokenize", json={"model": MODEL, "prompt": TEXT}).json()
    assert body == {
        "tokens": tokenizer.encode(TEXT),
        "count": len(tokenizer.encode(TEXT)),
        "max_model_len": MAX_MODEL_LEN,
    }
    body = client.post("/tokenize", json={"messages": USER}).json()
    templated = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tokenizer.encode(templated) and body["count"] == len(body["tokens"])

    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    response = client.post("/tokenize", json={"messages": [{"role": "user", "content": [image]}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    for neither_or_both in ({}, {"prompt": "hi", "messages": USER}):  # the error names one
        response = client.post("/tokenize", json=neither_or_both)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    schema = client.get("/openapi.json").json()["components"]["schemas"]["TokenizeBody"]
    assert schema["oneOf"] == [{"required": ["prompt"]}, {"required": ["messages"]}]
    assert client.post("/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404

    tokens = tokenizer.encode("Hi 😀 世界")
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "Hi 😀 世界"}
    response = client.post("/detokenize", json={"tokens": [1, 10**6]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"


def test_the_models_generation_config_fills_only_the_fields_a_request_leaves_out(
    qwen2_vl_tiny, tokenizer, tmp_path
):
    """As vLLM's `--generation-config auto`: Qwen's published sampling settings are the
    defaults; a request's own value wins; `vllm` ignores the file."""
    from iris_serve.server.generation_config import sampling_defaults

    folder = tmp_path / "config"
    folder.mkdir()
    published = {"temperature": 0.1, "top_k": 1, "top_p": 0.001, "repetition_penalty": 1.05}
    (folder / "generation_config.json").write_text(json.dumps({**published, "do_sample": True}))
    defaults = sampling_defaults(str(folder), qwen2_vl_tiny)
    assert defaults == published
    assert sampling_defaults("vllm", folder) == {}
    assert sampling_defaults("auto", qwen2_vl_tiny) == {}  # the tiny model publishes none
    with pytest.raises(FileNotFoundError):
        sampling_defaults(str(tmp_path / "nowhere"), qwen2_vl_tiny)

    engine = FakeEngine()
    engine.reset(one_token_each(tokenizer))
    app = create_app(settings(qwen2_vl_tiny, sampling_defaults=defaults), engine)
    with TestClient(app) as client:
        assert chat(client).status_code == 200
        assert chat(client, temperature=0.7, top_k=-1).status_code == 200
    first, second = (request.sampling for request in engine.requests)
    assert (first.temperature, first.top_k, first.top_p, first.repetition_penalty) == (
        0.1, 1, 0.001, 1.05,
    )  # fmt: skip
    assert (second.temperature, second.top_k, second.top_p) == (0.7, 0, 0.001)


def test_n_choices_are_separate_seeded_requests_after_the_first_has_begun(
    client, engine, tokenizer
):
    response = chat(client, n=3, seed=7, temperature=0.8)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == TEXT for c in body["choices"])
    ids = [r.request_id for r in engine.requests]
    assert ids == [f"{body['id']}-{i}" for i in range(3)]  # the first went out first
    assert [r.sampling.seed for r in engine.requests] == [7, 8, 9]
    usage = body["usage"]
    assert usage["prompt_tokens"] == 11  # the prompt once, as OpenAI counts it
    assert usage["completion_tokens"] == 3 * len(tokenizer.encode(TEXT))  # every choice's
    text = client.post("/v1/completions", json={"prompt": "Once", "n": 2}).json()
    assert [c["index"] for c in text["choices"]] == [0, 1]


def test_n_choices_stream_interleaved_with_their_indices_and_one_usage(client, engine, tokenizer):
    """Each choice's chunks carry its index and arrive in its own order; every choice
    opens with the role and ends with its finish reason; the usage chunk counts the
    prompt once and every choice's tokens, then [DONE]."""
    body = {"n": 3, "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(chat(client, **body).text)
    *chunks, usage = events
    per_choice: dict[int, list[dict]] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        per_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(per_choice) == [0, 1, 2]
    for choices in per_choice.values():
        assert choices[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in choices) == TEXT
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])
    assert [r.sampling.seed for r in engine.requests] == [1, 2, 3]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 11
    assert usage["usage"]["completion_tokens"] == 3 * len(tokenizer.encode(TEXT))
    completion = sse_events(
        client.post("/v1/completions", json={"prompt": "Once", "n": 2, "stream": True}).text
    )
    assert {c["choices"][0]["index"] for c in completion} == {0, 1}


def test_a_chat_template_given_to_the_server_renders_tokenize(qwen2_vl_tiny, tokenizer):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    app = create_app(settings(qwen2_vl_tiny, chat_template=template), FakeEngine())
    with TestClient(app) as client:
        body = client.post("/tokenize", json={"messages": USER}).json()
    assert body["tokens"] == tokenizer.encode("<<Say hello.>>", add_special_tokens=False)


def test_video_parts_and_their_settings_reach_the_worker_as_sent(client, engine):
    video = {"type": "video_url", "video_url": {"url": "https://x/clip.mp4"}, "uuid": "v1"}
    messages = [{"role": "user", "content": [video, {"type": "text", "text": "What happens?"}]}]
    kwargs = {"fps": 1.5, "min_frames": 4, "max_frames": 64, "max_pixels": 50176}
    response = chat(client, messages=messages, mm_processor_kwargs=kwargs)
    assert response.status_code == 200, response.text
    [request] = engine.requests
    assert request.messages == messages  # the server never fetches or decodes a video
    assert (request.fps, request.num_frames, request.min_frames, request.max_frames) == (
        1.5,
        None,
        4,
        64,
    )
    assert request.max_pixels == 50176
