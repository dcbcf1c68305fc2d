"""End to end, one real `iris serve` with faults injected: a step that raises fails its
request with an OpenAI-style 500; a client that leaves while its image is fetched or while
its prompt is prefilled is aborted there. Each leaks nothing, and the server answers the
next request.

The faults come from tests/fault_injection/sitecustomize.py, which the server's processes
load through PYTHONPATH: the request sampled with `FAULT_SEED` makes its step raise, the
one sampled with `HOLD_SEED` holds the scheduler at its first prompt chunk until the test
says go."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from bench.api_fuzz import IDLE  # the owners' counts once nothing runs
from tests.reference import make_image
from tests.server_harness import REPO, RunningServer, iris_server, stop, wait_until_gone

FAULT_SEED = 424242
HOLD_SEED = 515151
CHUNK_TOKENS = 64  # --max-num-batched-tokens: a long prompt is many steps
WAIT = 60.0
ABANDONED = "iris_requests_abandoned_total"


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    make_image(64, 48, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


def chat_body(image_url: str | None = None, text: str = "Hi", **extra) -> dict:
    url = image_url or f"data:image/png;base64,{base64.b64encode(png(9)).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


class HeldImageHost:
    """A media host on 127.0.0.1 whose `/held.png` answers only once the test releases it."""

    def __init__(self) -> None:
        self.asked, self.release = threading.Event(), threading.Event()
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                host.asked.set()
                host.release.wait(WAIT)
                body = png(31)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/held.png"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hold")


@pytest.fixture(scope="module")
def server(qwen2_vl_tiny, hold_dir, tmp_path_factory) -> Iterator[RunningServer]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(REPO / "tests" / "fault_injection"))
        env.setenv("IRIS_TEST_FAULT_SEED", str(FAULT_SEED))
        env.setenv("IRIS_TEST_HOLD_SEED", str(HOLD_SEED))
        env.setenv("IRIS_TEST_HOLD_DIR", str(hold_dir))
        with iris_server(
            qwen2_vl_tiny, "--served-model-name", "tiny", "--allow-private-media-hosts",
            "--max-num-batched-tokens", str(CHUNK_TOKENS),
            tmp_path=tmp_path_factory.mktemp("server"),
        ) as running:  # fmt: skip
            yield running
            assert stop(running) == 0
            wait_until_gone(running)


def send_and_leave(server: RunningServer, body: dict, arrived: threading.Event | Path) -> None:
    """Posts `body` on a raw connection, waits (bounded) until `arrived` says the server is
    at the point under test, hangs up, and waits until the server has given the request up."""
    abandoned = server.metrics()[ABANDONED]
    data = json.dumps(body).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
        )
        if isinstance(arrived, Path):
            deadline = time.monotonic() + WAIT
            while not arrived.exists():
                assert time.monotonic() < deadline, f"the request never reached {arrived.name}"
                time.sleep(0.01)  # polling another process's file, bounded above
        else:
            assert arrived.wait(WAIT), "the request never reached the point under test"
    server.wait_for_metrics({ABANDONED: abandoned + 1})


def test_a_failed_step_is_a_500_for_its_request_and_the_next_one_is_served(server):
    url = f"{server.base_url}/v1/chat/completions"
    failed = httpx.post(url, json=chat_body(seed=FAULT_SEED), timeout=WAIT)
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["type"] == "server_error" and error["code"] == 500
    assert error["message"].startswith("internal error in the engine"), error
    server.wait_for_metrics(IDLE)  # its pages, image pins and arena entries came back

    answered = httpx.post(url, json=chat_body(), timeout=WAIT)
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["completion_tokens"] == 4
    streamed = httpx.post(url, json=chat_body(seed=FAULT_SEED, stream=True), timeout=WAIT)
    assert streamed.status_code == 500, streamed.text
    server.wait_for_metrics(IDLE)

    assert server.log.count("a step failed; ending its 1 requests") == 2
    assert "RuntimeError: fault injected by tests/fault_injection" in server.log
    assert server.log.count("Traceback") == 2, server.log  # logged once per failure


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_its_image_is_fetched_costs_nothing(server, stream):
    """The worker is blocked on the media host when the client hangs up; once the host
    answers, the request is dropped before it generates its answer, and every pin and
    page comes back."""
    host = HeldImageHost()
    try:
        before = server.metrics()
        max_tokens = 200
        body = chat_body(host.url, max_tokens=max_tokens, ignore_eos=True, stream=stream)
        send_and_leave(server, body, host.asked)
        host.release.set()
        server.wait_for_metrics(IDLE)
        after = server.metrics()
        generated = after["iris_generation_tokens_total"] - before["iris_generation_tokens_total"]
        assert generated < max_tokens, "the request ran to the end after its client left"
        answered = httpx.post(
            f"{server.base_url}/v1/chat/completions", json=chat_body(host.url), timeout=WAIT
        )
        assert answered.status_code == 200, answered.text
        server.wait_for_metrics(IDLE)
    finally:
        host.close()


def test_a_client_that_leaves_mid_prefill_stops_the_prefill(server, hold_dir):
    text = " ".join(f"word{i}" for i in range(400))  # ~1,600 tokens: ~25 chunks
    body = {
        **chat_body(seed=HOLD_SEED, max_tokens=50, ignore_eos=True),
        "messages": [{"role": "user", "content": text}],
    }
    prompt_tokens = httpx.post(
        f"{server.base_url}/tokenize", json={"model": "tiny", "messages": body["messages"]},
        timeout=WAIT,
    ).json()["count"]  # fmt: skip
    needed = -(-prompt_tokens // CHUNK_TOKENS)
    assert needed >= 10, prompt_tokens
    before = server.metrics()
    send_and_leave(server, body, hold_dir / "held")
    (hold_dir / "go").write_text("")
    server.wait_for_metrics(IDLE)
    chunks = (hold_dir / "chunks").read_text().splitlines()
    assert len(chunks) < needed - 3, f"{len(chunks)} of {needed} chunks ran after the client left"
    after = server.metrics()
    assert after["iris_generation_tokens_total"] == before["iris_generation_tokens_total"]
    answered = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat_body(), timeout=WAIT)
    assert answered.status_code == 200, answered.text


def test_every_arena_page_is_reserved_at_start_so_a_filling_dev_shm_cannot_kill_a_worker(
    server,
):
    """tmpfs gives a mapped file's pages on first write; a page it cannot give is a SIGBUS.
    Every segment the server made holds its whole size already, so another process filling
    /dev/shm afterwards cannot take a worker down."""
    segments = list(Path("/dev/shm").glob(f"iris-{server.process.pid}-*"))
    assert segments
    for segment in segments:
        stat = os.stat(segment)
        assert stat.st_blocks * 512 >= stat.st_size, f"{segment.name} is sparse"
