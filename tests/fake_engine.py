"""A scripted in-process `EngineClient` and helpers for the HTTP server tests.

`FakeEngine` plays a `Script` per request (token chunks, a finish, an error, or a hang
until aborted) and records the `TokenizeRequest`s and aborts it got; the threading
events let a test on another thread wait for them, bounded.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from iris_serve.ipc.messages import RequestOutput, TokenizeRequest, TokenLogprob
from iris_serve.server.app import AppSettings
from iris_serve.server.engine_client import EngineRequestError

MODEL = "tiny-vl"
MAX_MODEL_LEN = 256
WAIT = 10.0  # upper bound of every wait on another thread
TEXT = "Hello world, how are you?"
USER = [{"role": "user", "content": "Say hello."}]


@dataclass
class Script:
    """What the fake engine answers: token chunks (one output each), then the finish."""

    chunks: list[list[int]]
    finish_reason: str = "length"
    prompt_tokens: int = 11
    cached_tokens: int = 3
    error: EngineRequestError | None = None  # raised after the chunks
    hang: bool = False  # after the chunks, wait until aborted


def scripted_logprobs(tokens: list[int], top: int | None) -> list[TokenLogprob] | None:
    """Made-up logprobs, one per token: token t has -t/1000 and its top are t, t+1, ..."""
    if top is None:
        return None
    return [
        TokenLogprob(t, -t / 1000, tuple((t + i, -(t + i) / 1000) for i in range(top)))
        for t in tokens
    ]


@dataclass
class FakeEngine:
    """`EngineClient` that plays a `Script` and records what it was sent."""

    script: Callable[[TokenizeRequest], Script] = lambda _: Script([])
    requests: list[TokenizeRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    got_request: threading.Event = field(default_factory=threading.Event)
    got_abort: threading.Event = field(default_factory=threading.Event)
    _wakeups: dict[str, asyncio.Event] = field(default_factory=dict)

    def reset(self, script: Callable[[TokenizeRequest], Script]) -> None:
        self.script = script
        self.requests.clear()
        self.aborted.clear()
        self.got_request.clear()
        self.got_abort.clear()

    async def generate(self, request: TokenizeRequest):
        self.requests.append(request)
        self.got_request.set()
        script = self.script(request)
        rid, total = request.request_id, 0
        for n, chunk in enumerate(script.chunks):
            if rid in self.aborted:
                return
            total += len(chunk)
            last = n == len(script.chunks) - 1 and not script.hang and script.error is None
            yield RequestOutput(
                rid,
                list(chunk),
                finished=last,
                finish_reason=script.finish_reason if last else None,
                prompt_tokens=script.prompt_tokens,
                cached_tokens=script.cached_tokens,
                completion_tokens=total,
                logprobs=scripted_logprobs(chunk, request.sampling.logprobs),
            )
        if script.error is not None:
            raise script.error
        if script.hang and rid not in self.aborted:
            self._wakeups[rid] = wakeup = asyncio.Event()
            await wakeup.wait()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.got_abort.set()
        if request_id in self._wakeups:
            self._wakeups.pop(request_id).set()


def settings(model_dir: Path, **kwargs: Any) -> AppSettings:
    return AppSettings(str(model_dir), (MODEL, "alias"), MAX_MODEL_LEN, **kwargs)


def one_token_each(tokenizer: Any, text: str = TEXT) -> Callable[[TokenizeRequest], Script]:
    chunks = [[i] for i in tokenizer.encode(text)]
    return lambda _: Script(chunks)


def sse_events(body: str) -> list[Any]:
    """Parses an SSE body strictly: only `data: <json>\\n\\n` events, `[DONE]` last."""
    assert "\r" not in body
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(event.startswith("data: ") for event in events), events
    payloads = [event.removeprefix("data: ") for event in events]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def chat(client: TestClient, **body: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **body})


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """A real uvicorn server on a free 127.0.0.1 port; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT
        while not server.started:  # bounded wait for the server to listen
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT)
        sock.close()
