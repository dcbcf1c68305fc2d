"""The per-image caches end to end, asserted through /metrics on real `iris serve`s.

An 8-round conversation that adds one image per round must process one image in the
tokenizer worker and encode one image in the ViT per round, and reuse the earlier
rounds' KV; the SGLang-style request granularity re-encodes every image every round.
"""

from __future__ import annotations

import functools
import io
import random
import threading
from pathlib import Path

import httpx
import pytest
from PIL import Image

from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import make_image, reference_tokens
from tests.server_harness import RunningServer, iris_server
from tests.test_server_e2e import IDLE, data_url, png_bytes

ROUNDS = 8
PAGE = 16
MAX_TOKENS = 6


def conversation_round(history: list[dict], image: bytes, text: str) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}]
    return [*history, {"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def single_turn(images: list[bytes], text: str) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def chat(server: RunningServer, messages: list[dict], **extra) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={**body, **extra}, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()


@functools.cache
def prompt_builder(model_dir: Path) -> PromptBuilder:
    return PromptBuilder(model_dir)


def reference_answer(model_dir: Path, messages: list[dict], images: list[bytes]) -> str:
    """transformers `generate` on the same conversation (images in message order)."""
    builder = prompt_builder(model_dir)
    template = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else [
                {"type": "image"} if part["type"] == "image_url" else part for part in m["content"]
            ],
        }
        for m in messages
    ]
    pil = [Image.open(io.BytesIO(b)) for b in images]
    prompt = builder.build(builder.render_chat(template), pil)
    ids = reference_tokens(model_dir, prompt, MAX_TOKENS)
    return builder.tokenizer.decode(ids, skip_special_tokens=True)


def run_conversation(server: RunningServer, model_dir: Path, granularity: str) -> None:
    history: list[dict] = []
    images: list[bytes] = []
    previous_prompt_tokens = 0
    for k in range(1, ROUNDS + 1):
        image = png_bytes(make_image(48 + 8 * k, 40 + 4 * k, seed=100 + k))
        images.append(image)
        messages = conversation_round(history, image, f"And picture {k}?")
        body = chat(server, messages)
        answer = body["choices"][0]["message"]["content"]
        assert answer == reference_answer(model_dir, messages, images), f"round {k}"

        encoded = k if granularity == "image" else k * (k + 1) // 2
        server.wait_for_metrics(
            {
                **IDLE,
                "iris_mm_images_encoded_total": float(encoded),
                "iris_mm_processor_cache_misses_total": float(k),  # one new image per round
                "iris_mm_processor_cache_hits_total": float(k * (k - 1) // 2),
            }
        )
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        if granularity == "image" and k > 1:
            # The previous round's prompt is a prefix of this one; all its full pages hit.
            assert cached >= previous_prompt_tokens // PAGE * PAGE, f"round {k}: {cached}"
        previous_prompt_tokens = body["usage"]["prompt_tokens"]
        history = [*messages, {"role": "assistant", "content": answer}]


@pytest.mark.parametrize(
    "arch, granularity, tensor_parallel",
    [
        ("qwen2_5_vl", "image", 1),
        ("qwen2_5_vl", "request", 1),
        ("qwen3_vl", "image", 2),  # DeepStack entries and two ranks: one case, not two
    ],
)
def test_an_eight_round_conversation_does_one_image_of_work_per_round(
    request, tmp_path, arch, granularity, tensor_parallel
):
    """Qwen3-VL's entries carry DeepStack levels; the same one-image-per-round holds, and
    holds with the model split over two ranks (rank 0 encodes, caches and plans)."""
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    flags = ["--served-model-name", "tiny", "--block-size", str(PAGE)]
    flags += ["--mm-cache-granularity", granularity, "--max-model-len", "4096"]
    flags += ["--tensor-parallel-size", str(tensor_parallel)]
    with iris_server(model_dir, *flags, tmp_path=tmp_path) as server:
        run_conversation(server, model_dir, granularity)


def test_eight_concurrent_requests_with_one_new_image_encode_it_once(qwen2_vl_tiny, tmp_path):
    with iris_server(
        qwen2_vl_tiny, "--served-model-name", "tiny", "--tokenizer-workers", "2", tmp_path=tmp_path
    ) as server:  # fmt: skip  (two workers, one encode)
        image = png_bytes(make_image(90, 70, seed=7))
        messages = conversation_round([], image, "Same picture for all.")
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            answers[i] = chat(server, messages)["choices"][0]["message"]["content"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        server.wait_for_metrics({**IDLE, "iris_mm_images_encoded_total": 1.0})
    # Each answer is the reference's, not merely the same as the others (one shared wrong
    # embedding would give eight equal wrong answers).
    expected = reference_answer(qwen2_vl_tiny, messages, [image])
    assert answers == dict.fromkeys(range(8), expected)


def test_two_hundred_requests_under_constant_eviction_leak_nothing(qwen2_vl_tiny, tmp_path):
    flags = [
        "--served-model-name", "tiny",
        "--kv-cache-memory", "512KiB",  # 64 pages of 16 tokens: prefix pages evicted constantly
        "--mm-embedding-cache-gb", "0.00002",  # ~20 KB: about one image's embedding
        "--mm-shm-arena-bytes", "512KiB",  # a handful of resized images per worker
        "--max-model-len", "1024",
        "--tokenizer-workers", "2",  # the default: requests spread over both
    ]  # fmt: skip
    pool = [png_bytes(make_image(40 + 6 * i, 36 + 5 * i, seed=200 + i)) for i in range(12)]
    rng = random.Random(0)
    cases = [(rng.sample(pool, rng.randint(0, 2)), f"request {i}") for i in range(200)]
    with iris_server(qwen2_vl_tiny, *flags, tmp_path=tmp_path) as server:
        failures: list[str] = []
        answers: dict[int, str] = {}

        def worker(indices: list[int]) -> None:
            for i in indices:
                messages = single_turn(*cases[i])
                try:
                    answers[i] = chat(server, messages)["choices"][0]["message"]["content"]
                except AssertionError as error:
                    failures.append(str(error))

        threads = [
            threading.Thread(target=worker, args=(list(range(t, 200, 6)),)) for t in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        assert not failures, failures[:3]
        assert len(answers) == 200
        server.wait_for_metrics(IDLE)
        metrics = server.metrics()
        assert metrics["iris_mm_embedding_cache_misses_total"] > 12, "the cache was meant to evict"
    # Answers under eviction equal the reference: every fifth request, which spreads over the
    # whole run and all six client threads (all 200 would add ~35 s of transformers `generate`).
    for i in range(0, 200, 5):
        images, text = cases[i]
        expected = reference_answer(qwen2_vl_tiny, single_turn(images, text), images)
        assert answers[i] == expected, f"request {i} with {len(images)} image(s)"
