"""End to end: a step that raises in the real scheduler process fails its request with
an OpenAI-style 500, leaks nothing, and the server answers the next request.

The fault comes from tests/fault_injection/sitecustomize.py, which the server's processes
load through PYTHONPATH: the request sampled with `FAULT_SEED` makes its step raise."""

from __future__ import annotations

import base64
import io

import httpx

from bench.api_fuzz import IDLE  # the owners' counts once nothing runs
from tests.reference import make_image
from tests.server_harness import REPO, iris_server, stop, wait_until_gone

FAULT_SEED = 424242


def chat_body(**extra) -> dict:
    buffer = io.BytesIO()
    make_image(64, 48, seed=9).save(buffer, format="PNG")
    url = f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]
    messages = [{"role": "user", "content": content}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


def test_a_failed_step_is_a_500_for_its_request_and_the_next_one_is_served(
    qwen2_vl_tiny, tmp_path, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests" / "fault_injection"))
    monkeypatch.setenv("IRIS_TEST_FAULT_SEED", str(FAULT_SEED))
    with iris_server(qwen2_vl_tiny, "--served-model-name", "tiny", tmp_path=tmp_path) as running:
        url = f"{running.base_url}/v1/chat/completions"
        failed = httpx.post(url, json=chat_body(seed=FAULT_SEED), timeout=60)
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["type"] == "server_error" and error["code"] == 500
        assert error["message"].startswith("internal error in the engine"), error
        running.wait_for_metrics(IDLE)  # its pages, image pins and arena entries came back

        answered = httpx.post(url, json=chat_body(), timeout=60)
        assert answered.status_code == 200, answered.text
        assert answered.json()["usage"]["completion_tokens"] == 4
        streamed = httpx.post(url, json=chat_body(seed=FAULT_SEED, stream=True), timeout=60)
        assert streamed.status_code == 500, streamed.text
        running.wait_for_metrics(IDLE)

        assert running.log.count("a step failed; ending its 1 requests") == 2
        assert "RuntimeError: fault injected by tests/fault_injection" in running.log
        assert running.log.count("Traceback") == 2, running.log  # logged once per failure
        assert stop(running) == 0
        wait_until_gone(running)
