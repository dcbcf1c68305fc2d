"""The host tier over HTTP: `iris serve --kv-offload-gib` with a KV cache that holds about
one conversation. Agents take turns; one that comes back after the others pushed its
pages out gets transformers' answer, `usage.prompt_tokens_details.host_cached_tokens`
says how much came back from host memory, and /metrics shows the tier."""

from __future__ import annotations

import httpx
import pytest
import torch

from iris_serve.scheduler.kv.kv_cache import KVLayout
from iris_serve.scheduler.models.registry import load_config
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import make_image
from tests.server_harness import iris_server
from tests.test_server_e2e import IDLE, chat_body, png_bytes, reference_text

PAGE = 8
POOL_TOKENS = 192  # one agent's turn fits, three do not


@pytest.fixture(scope="module")
def server(qwen2_5_vl_tiny, tmp_path_factory):
    per_token = KVLayout.of(load_config(qwen2_5_vl_tiny), 1, torch.float32).bytes_per_page
    with iris_server(
        qwen2_5_vl_tiny,
        "--served-model-name", "tiny",
        "--block-size", str(PAGE),
        "--kv-cache-memory", str(per_token * POOL_TOKENS),
        "--kv-offload-gib", "0.01",
        "--mm-embedding-cache-gb", "0",
        tmp_path=tmp_path_factory.mktemp("server"),
    ) as running:  # fmt: skip
        yield running


def ask(server, text: str, image: bytes) -> dict:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=chat_body(text, [image]), timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_a_returning_agent_reloads_its_history_from_host_memory(server, qwen2_5_vl_tiny):
    screens = [png_bytes(make_image(224, 168, seed=200 + i)) for i in range(3)]
    first = [ask(server, f"Agent {i}: what is on screen?", s) for i, s in enumerate(screens)]
    again = ask(server, "Agent 0: what is on screen?", screens[0])
    builder = PromptBuilder(qwen2_5_vl_tiny)
    question = "Agent 0: what is on screen?"
    text, prompt_len, _ = reference_text(qwen2_5_vl_tiny, builder, question, screens[:1])
    answers = [body["choices"][0]["message"]["content"] for body in (first[0], again)]
    assert answers == [text, text]
    details = again["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == (prompt_len - 1) // PAGE * PAGE
    assert 0 < details["host_cached_tokens"] <= details["cached_tokens"]
    assert first[0]["usage"]["prompt_tokens_details"]["host_cached_tokens"] == 0
    server.wait_for_metrics(IDLE)
    metrics = server.metrics()
    assert metrics["iris_prefix_cache_host_hit_tokens_total"] >= details["host_cached_tokens"]
    assert metrics["iris_host_tier_pages"] > 0
    assert metrics["iris_host_tier_reloaded_bytes_total"] > 0
    assert metrics["iris_host_tier_capacity_bytes"] == int(0.01 * 2**30)
    assert "host tier: 0.01 GiB" in server.log
