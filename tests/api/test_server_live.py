"""A real uvicorn server in a thread: the official `openai` client, and client
disconnects (streaming or not, before or after the first token) abort the request."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from iris_serve.ipc.messages import Sampling
from iris_serve.server.app import create_app
from tests.fake_engine import (
    MODEL,
    TEXT,
    USER,
    WAIT,
    FakeEngine,
    Script,
    one_token_each,
    serve_in_thread,
    settings,
)


@pytest.fixture(scope="module")
def _server(qwen2_vl_tiny: Path) -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine()
    with serve_in_thread(create_app(settings(qwen2_vl_tiny), engine)) as url:
        yield url, engine


@pytest.fixture
def server(_server, tokenizer) -> tuple[str, FakeEngine]:
    _server[1].reset(one_token_each(tokenizer))
    return _server


def test_openai_client(server, tokenizer):
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=WAIT)
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, max_completion_tokens=32, temperature=0
    )
    assert engine.requests[0].sampling == Sampling(max_tokens=32, temperature=0.0)
    assert completion.choices[0].message.content == TEXT
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == 11
    assert completion.usage.prompt_tokens_details.cached_tokens == 3

    stream = client.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        tokenizer.encode(TEXT)
    )

    text = client.completions.create(model=MODEL, prompt="Once", max_tokens=8, stop=["how"])
    assert text.choices[0].text == "Hello world, " and text.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=[1, 2], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == TEXT

    assert [m.id for m in client.models.list()] == [MODEL, "alias"]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=USER, n=0)
    assert error.value.body["param"] == "n"
    texts = ["", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [TEXT, TEXT]
    with pytest.raises(openai.NotFoundError):  # as from OpenAI and vLLM
        client.chat.completions.create(model="nope", messages=USER)
    assert client.models.retrieve("alias").id == "alias"
    assert client.chat.completions.create(model=MODEL, messages=USER).choices[0].message.content


def test_disconnect_mid_stream_aborts(server, tokenizer):
    url, engine = server
    engine.reset(lambda _: Script([tokenizer.encode("Hi")], hang=True))
    with (
        httpx.Client(timeout=WAIT) as http,
        http.stream(
            "POST", f"{url}/v1/chat/completions", json={"messages": USER, "stream": True}
        ) as response,
    ):
        assert response.status_code == 200
        first = next(response.iter_raw())
        assert first.startswith(b"data: ")
    assert engine.got_abort.wait(WAIT), "no abort after the client left"
    assert engine.aborted == [engine.requests[0].request_id]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_any_token_aborts(server, stream):
    url, engine = server
    engine.reset(lambda _: Script([], hang=True))
    body = json.dumps({"messages": USER, "stream": stream}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        assert engine.got_request.wait(WAIT)
    assert engine.got_abort.wait(WAIT), "no abort after the client left"
    assert engine.aborted == [engine.requests[0].request_id]


def test_logprobs_through_the_openai_client(server, tokenizer):
    """Chat (streamed and not) and completions carry one entry per token with its top
    alternatives, in OpenAI's shapes; the engine was asked for the right number."""
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=WAIT)
    ids = tokenizer.encode(TEXT)

    completion = client.chat.completions.create(
        model=MODEL, messages=USER, logprobs=True, top_logprobs=2
    )
    assert engine.requests[-1].sampling.logprobs == 2
    content = completion.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ids]
    assert [c.logprob for c in content] == [-t / 1000 for t in ids]
    assert [c.bytes for c in content] == [list(c.token.encode()) for c in content]
    assert [[top.logprob for top in c.top_logprobs] for c in content] == [
        [-t / 1000, -(t + 1) / 1000] for t in ids
    ]

    chunks = list(
        client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, stream=True)
    )
    streamed = [
        c
        for chunk in chunks
        if chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert [c.logprob for c in streamed] == [-t / 1000 for t in ids]
    assert all(c.top_logprobs == [] for c in streamed)

    plain = client.chat.completions.create(model=MODEL, messages=USER)
    assert plain.choices[0].logprobs is None and engine.requests[-1].sampling.logprobs is None

    text = client.completions.create(model=MODEL, prompt="Once", logprobs=1)
    logprobs = text.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs == [-t / 1000 for t in ids]
    assert logprobs.top_logprobs == [{tokenizer.decode([t]): -t / 1000} for t in ids]
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[-1] == len("".join(logprobs.tokens[:-1]))
