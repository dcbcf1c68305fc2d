"""/metrics: every Iris metric from fed `EngineStats` / `WorkerStats`, the histograms, and
one registry per app, on the app with a scripted engine (`tests.fake_engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from iris_serve.ipc.messages import EngineStats, WorkerStats
from iris_serve.server.app import create_app
from iris_serve.server.metrics import MetricsBoard
from tests.fake_engine import FakeEngine, chat, one_token_each, settings


@dataclass
class FakeEngineWithStats(FakeEngine):
    """The scripted engine, with the board a `ZmqEngineClient` feeds from its sockets."""

    metrics: MetricsBoard = field(default_factory=MetricsBoard)


def scrape(client: TestClient) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {
        sample.name + "".join(f'{{le="{v}"}}' for k, v in sample.labels.items() if k == "le"): (
            sample.value
        )
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


ENGINE = EngineStats(
    num_running=3,
    num_waiting=2,
    kv_pages_used=10,
    kv_pages_total=40,
    pinned_images=4,
    num_preemptions=1,
    device_memory_allocated_bytes=3 << 30,
    device_memory_peak_bytes=5 << 30,
    images_encoded=7,
    prompt_tokens=900,
    generation_tokens=120,
    prefix_cache_hit_tokens=256,
    mm_embedding_cache_hits=5,
    mm_embedding_cache_misses=7,
    mm_embedding_cache_usage_bytes=1 << 20,
    encoder_seconds=[0.02, 0.3],
)
WORKERS = [
    WorkerStats(0, 1000, 4096, 1, requests_processed=6, images_processed=3,
                processor_cache_hits=4, processor_cache_misses=3),
    WorkerStats(1, 500, 4096, 2, requests_processed=2, images_processed=1,
                processor_cache_hits=1, processor_cache_misses=1),
]  # fmt: skip
EXPECTED = {
    "iris_num_requests_running": 3,
    "iris_num_requests_waiting": 2,
    "iris_kv_cache_usage_ratio": 0.25,
    "iris_kv_cache_used_pages": 10,
    "iris_kv_cache_total_pages": 40,
    "iris_scheduler_pinned_images": 4,
    "iris_mm_embedding_cache_usage_bytes": 1 << 20,
    "iris_device_memory_allocated_bytes": 3 << 30,
    "iris_device_memory_peak_bytes": 5 << 30,
    "iris_num_preemptions_total": 1,
    "iris_prompt_tokens_total": 900,
    "iris_generation_tokens_total": 120,
    "iris_prefix_cache_hit_tokens_total": 256,
    "iris_mm_images_encoded_total": 7,
    "iris_mm_embedding_cache_hits_total": 5,
    "iris_mm_embedding_cache_misses_total": 7,
    "iris_shm_arena_usage_bytes": 1500,
    "iris_shm_arena_capacity_bytes": 8192,
    "iris_shm_arena_pinned_entries": 3,
    "iris_tokenizer_requests_total": 8,
    "iris_tokenizer_images_total": 4,
    "iris_mm_processor_cache_hits_total": 5,
    "iris_mm_processor_cache_misses_total": 4,
}


@pytest.fixture(scope="module")
def tokenizer(qwen2_vl_tiny: Path):
    return AutoTokenizer.from_pretrained(qwen2_vl_tiny)


def test_every_metric_from_the_latest_stats(qwen2_vl_tiny: Path):
    engine = FakeEngineWithStats()
    with TestClient(create_app(settings(qwen2_vl_tiny), engine)) as client:
        before = scrape(client)  # nothing reported yet: every value reads zero
        assert all(before[name] == 0 for name in EXPECTED)
        for stats in (ENGINE, *WORKERS):
            engine.metrics.update(stats)
        values = scrape(client)
        assert {name: values[name] for name in EXPECTED} == EXPECTED
        assert values["iris_mm_encoder_seconds_count"] == 2
        assert values["iris_mm_encoder_seconds_sum"] == pytest.approx(0.32)
        assert values['iris_mm_encoder_seconds_bucket{le="0.025"}'] == 1

        # Totals are exposed as sent, never added up: the same totals again change
        # nothing; the encoder timings are new observations each time.
        newer = WorkerStats(1, 0, 4096, 0, 3, 2, processor_cache_hits=2, processor_cache_misses=2)
        for stats in (ENGINE, newer):
            engine.metrics.update(stats)
        values = scrape(client)
        assert values["iris_prompt_tokens_total"] == 900
        assert values["iris_mm_processor_cache_hits_total"] == 4 + 2
        assert values["iris_shm_arena_pinned_entries"] == 1
        assert values["iris_mm_encoder_seconds_count"] == 4


def test_time_to_first_token_is_observed_per_request(qwen2_vl_tiny: Path, tokenizer):
    engine = FakeEngine(one_token_each(tokenizer))  # no board of its own: the app makes one
    with TestClient(create_app(settings(qwen2_vl_tiny), engine)) as client:
        assert scrape(client)["iris_time_to_first_token_seconds_count"] == 0
        assert chat(client).status_code == 200
        assert chat(client, stream=True).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
        values = scrape(client)
        assert values["iris_time_to_first_token_seconds_count"] == 3
        assert 0 < values["iris_time_to_first_token_seconds_sum"] < 60
        assert chat(client, max_tokens=5000).status_code == 400  # never reached the engine
        assert scrape(client)["iris_time_to_first_token_seconds_count"] == 3


def test_each_app_has_its_own_registry(qwen2_vl_tiny: Path):
    engines = [FakeEngineWithStats(), FakeEngineWithStats()]
    apps = [create_app(settings(qwen2_vl_tiny), engine) for engine in engines]
    engines[0].metrics.update(ENGINE)
    with TestClient(apps[0]) as first, TestClient(apps[1]) as second:
        assert scrape(first)["iris_prompt_tokens_total"] == 900
        assert scrape(second)["iris_prompt_tokens_total"] == 0


def test_device_memory_is_reported_only_for_a_cuda_device():
    import torch

    from iris_serve.scheduler.process import device_memory

    assert device_memory(torch.device("cpu")) == {}  # CPU: RSS is the measure, not torch's
    stats = EngineStats(0, 0, 0, 1, 0, **device_memory(torch.device("cpu")))
    assert stats.device_memory_peak_bytes == stats.device_memory_allocated_bytes == 0


def test_each_data_parallel_replica_has_its_own_labelled_engine_figures():
    board = MetricsBoard(num_replicas=2)
    board.update(EngineStats(2, 0, 5, 100, 1, images_encoded=3, replica=0))
    board.update(EngineStats(1, 4, 7, 100, 0, images_encoded=8, replica=1))
    samples = {
        (sample.name, sample.labels.get("replica")): sample.value
        for family in text_string_to_metric_families(board.render().decode())
        for sample in family.samples
        if sample.name.startswith(("iris_mm_images_encoded", "iris_num_requests_waiting"))
    }
    assert samples == {
        ("iris_mm_images_encoded_total", "0"): 3.0,
        ("iris_mm_images_encoded_total", "1"): 8.0,
        ("iris_num_requests_waiting", "0"): 0.0,
        ("iris_num_requests_waiting", "1"): 4.0,
    }
