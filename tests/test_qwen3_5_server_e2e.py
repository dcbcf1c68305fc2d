"""Qwen3.5 over HTTP: the real `iris serve` on the tiny hybrid checkpoint answers as
transformers does, a repeated conversation hits the prefix cache through a state
snapshot (usage and /metrics say so), and a refused image leaves nothing held."""

from __future__ import annotations

import httpx
import pytest

from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import make_image
from tests.server_harness import iris_server
from tests.test_server_e2e import IDLE, chat_body, png_bytes, reference_text


@pytest.fixture(scope="module")
def server(qwen3_5_tiny, tmp_path_factory):
    with iris_server(
        qwen3_5_tiny,
        "--served-model-name", "tiny",
        "--max-model-len", "1024",
        "--limit-mm-per-prompt", "2",
        tmp_path=tmp_path_factory.mktemp("server"),
    ) as running:  # fmt: skip
        yield running


def test_a_repeated_chat_equals_transformers_and_resumes_from_a_snapshot(server, qwen3_5_tiny):
    builder = PromptBuilder(qwen3_5_tiny)
    images = [png_bytes(make_image(96, 64, seed=1))]
    text, prompt_len, output_len = reference_text(qwen3_5_tiny, builder, "Describe.", images)
    usages = []
    for _ in range(2):
        response = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json=chat_body("Describe.", images),
            timeout=120,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["message"]["content"] == text
        assert body["usage"]["completion_tokens"] == output_len
        usages.append(body["usage"])
    assert usages[0]["prompt_tokens"] == prompt_len
    assert (usages[0].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    server.wait_for_metrics(
        {
            **IDLE,
            "iris_linear_state_snapshot_queries_total": 2.0,
            "iris_linear_state_snapshot_hits_total": 1.0,
        }
    )
    assert server.metrics()["iris_linear_state_snapshots"] > 0


def test_an_image_past_the_limits_gets_a_400_and_holds_nothing(server):
    images = [png_bytes(make_image(32, 32, seed=s)) for s in range(3)]  # the limit is 2
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=chat_body("Three?", images), timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    server.wait_for_metrics(IDLE)
