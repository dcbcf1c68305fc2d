"""/metrics: every Iris metric from fed `EngineStats` / `WorkerStats`, the histograms, and
one registry per app, on the app with a scripted engine (`tests.fake_engine`); the vLLM
series beside them, and the `model_name` label on every series."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from iris_serve.ipc.messages import EngineStats, WorkerStats
from iris_serve.server.app import create_app
from iris_serve.server.engine_client import EngineRequestError
from iris_serve.server.metrics import MetricsBoard, token_buckets
from iris_serve.server.responses import Usage
from tests.fake_engine import (
    MAX_MODEL_LEN,
    MODEL,
    TEXT,
    FakeEngine,
    Script,
    chat,
    one_token_each,
    settings,
)


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
    prefix_cache_query_tokens=600,
    mm_embedding_cache_hits=5,
    mm_embedding_cache_misses=7,
    mm_embedding_cache_usage_bytes=1 << 20,
    encoder_seconds=[0.02, 0.3],
)
WORKERS = [
    WorkerStats(0, 1000, 4096, 1, requests_processed=6, images_processed=3,
                processor_cache_hits=4, processor_cache_misses=3),
    WorkerStats(1, 500, 4096, 2, requests_processed=2, images_processed=1,
                processor_cache_hits=1, processor_cache_misses=1, arena_waiting_requests=2),
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
    "iris_prefix_cache_query_tokens_total": 600,
    "iris_mm_images_encoded_total": 7,
    "iris_mm_embedding_cache_hits_total": 5,
    "iris_mm_embedding_cache_misses_total": 7,
    "iris_shm_arena_usage_bytes": 1500,
    "iris_shm_arena_capacity_bytes": 8192,
    "iris_shm_arena_pinned_entries": 3,
    "iris_shm_arena_waiting_requests": 2,
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

    assert device_memory(torch.device("cpu")) == (0, 0)  # CPU: RSS is the measure, not torch's


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


# --- the vLLM series and the model_name label ------------------------------------------


def series(client: TestClient) -> dict[str, float]:
    """Every sample as `name{its labels but model_name, sorted}`; every sample must be
    labelled with the served model's first name."""
    values = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name", None) == MODEL, sample
            shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            values[sample.name + (f"{{{shown}}}" if shown else "")] = sample.value
    return values


VLLM_ENGINE = {  # from ENGINE, as vLLM names and labels them
    'vllm:num_requests_running{engine="0"}': 3,
    'vllm:num_requests_waiting{engine="0"}': 2,
    'vllm:kv_cache_usage_perc{engine="0"}': 0.25,
    'vllm:prompt_tokens_total{engine="0"}': 900,
    'vllm:generation_tokens_total{engine="0"}': 120,
    'vllm:num_preemptions_total{engine="0"}': 1,
    'vllm:prefix_cache_queries_total{engine="0"}': 600,
    'vllm:prefix_cache_hits_total{engine="0"}': 256,
}
VLLM_REQUESTS = [  # the server's per-request series
    *(f'vllm:request_success_total{{finished_reason="{r}"}}' for r in ("stop", "length", "abort")),
    *(
        f"vllm:{name}_count"
        for name in (
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
            "request_prompt_tokens",
            "request_generation_tokens",
        )
    ),
]


def test_every_series_is_labelled_with_the_model_and_vllm_reads_the_engine_stats(
    qwen2_vl_tiny: Path,
):
    engine = FakeEngineWithStats()
    with TestClient(create_app(settings(qwen2_vl_tiny), engine)) as client:
        before = series(client)  # the served model on every sample, iris_* and vllm:*
        assert {name: before[name] for name in [*VLLM_ENGINE, *VLLM_REQUESTS]} == dict.fromkeys(
            [*VLLM_ENGINE, *VLLM_REQUESTS], 0
        )
        assert before["iris_prompt_tokens_total"] == 0  # iris_* keep no replica label
        for stats in (ENGINE, *WORKERS):
            engine.metrics.update(stats)
        values = series(client)
        assert {name: values[name] for name in VLLM_ENGINE} == VLLM_ENGINE
        assert values["iris_mm_encoder_seconds_count"] == 2


def test_vllm_request_series_count_each_request_that_ended(qwen2_vl_tiny: Path, tokenizer):
    tokens = tokenizer.encode(TEXT)
    scripts = {  # by the request's first message: what the engine answers
        "length": Script([[t] for t in tokens]),  # one token per output, as Iris's engine
        "stop": Script([tokens[:3], tokens[3:5], tokens[5:6]], finish_reason="stop"),
        "abort": Script([]),  # the engine ends it with no output (the shutdown drain)
        "error": Script([tokens[:2]], error=EngineRequestError(500, "boom")),
    }

    def script(request) -> Script:
        text = request.prompt if request.prompt is not None else request.messages[0]["content"]
        return scripts[text.split()[0]]

    def say(word: str, **body) -> dict:
        response = chat(client, messages=[{"role": "user", "content": word}], **body)
        return response.json() if response.status_code == 200 else {}

    with TestClient(create_app(settings(qwen2_vl_tiny), FakeEngine(script))) as client:
        usages = [
            say("length")["usage"],
            say("stop")["usage"],
            say("length", n=2)["usage"],  # two requests in the engine, one usage
        ]
        stream = chat(client, messages=[{"role": "user", "content": "length"}], stream=True)
        assert stream.status_code == 200
        cut = client.post("/v1/completions", json={"prompt": "length", "stop": [","]}).json()
        say("abort")
        say("error")  # an error after its first token: only the time to first token
        assert chat(client, max_tokens=5000).status_code == 400  # never reached the engine
        values = series(client)

    success = {
        name.split('"')[1]: value
        for name, value in values.items()
        if name.startswith("vllm:request_success_total")
    }
    # the length ones, the engine's stop and the stop string, the engine's abort; a
    # request that failed is not a success of any reason
    assert success == {"length": 4, "stop": 2, "abort": 1}
    finished = 7
    assert values["vllm:e2e_request_latency_seconds_count"] == finished
    assert 0 < values["vllm:e2e_request_latency_seconds_sum"] < 60
    assert values["vllm:request_prompt_tokens_count"] == finished
    assert values["vllm:request_prompt_tokens_sum"] == 6 * 11  # the abort had no output
    cut_tokens = cut["usage"]["completion_tokens"]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut_tokens < len(tokens)
    generated = [len(tokens), 6, len(tokens), len(tokens), len(tokens), cut_tokens, 0]
    assert values["vllm:request_generation_tokens_count"] == finished
    assert values["vllm:request_generation_tokens_sum"] == sum(generated)
    assert [u["completion_tokens"] for u in usages] == [len(tokens), 6, 2 * len(tokens)]
    # One inter-token latency per generated token after a request's first, however the
    # tokens came in outputs (the engine's stop: 6 tokens in 3 outputs)
    itl = 4 * (len(tokens) - 1) + (6 - 1) + (cut_tokens - 1)
    assert values["vllm:inter_token_latency_seconds_count"] == itl
    first_tokens = finished - 1 + 1  # not the abort (no token); the error had one
    assert values["vllm:time_to_first_token_seconds_count"] == first_tokens
    assert values["iris_time_to_first_token_seconds_count"] == first_tokens


def test_merged_outputs_share_their_gap_among_their_tokens():
    board = MetricsBoard(model_name="m")
    usage = Usage.of(prompt_tokens=7, completion_tokens=6, cached_tokens=0)

    def histogram(name: str) -> dict[str, float]:
        """`le` (or `sum`, `count`) → value of one of the board's histograms."""
        family = next(
            f for f in text_string_to_metric_families(board.render().decode()) if f.name == name
        )
        return {s.labels.get("le", s.name.rsplit("_", 1)[1]): s.value for s in family.samples}

    # the first token alone at 10.0, one at 10.5, three merged at 12.0, one at 12.25:
    # latencies 0.5, 0.5 x 3 (1.5 s shared by three tokens), 0.25
    received = [(10.0, 1), (10.5, 1), (12.0, 3), (12.25, 1)]
    board.observe_finished("length", usage, time.perf_counter() - 2.0, received)
    itl = histogram("vllm:inter_token_latency_seconds")
    assert (itl["0.2"], itl["0.3"], itl["0.4"], itl["0.5"], itl["count"]) == (0, 1, 1, 5, 5)
    assert itl["sum"] == pytest.approx(2.25)
    assert 2.0 <= histogram("vllm:e2e_request_latency_seconds")["sum"] < 60

    # tokens merged into the first output follow the first token at once
    board.observe_finished("stop", usage, time.perf_counter(), [(1.0, 3), (2.0, 1)])
    itl = histogram("vllm:inter_token_latency_seconds")
    assert (itl["0.01"], itl["count"], itl["sum"]) == (2, 5 + 3, pytest.approx(2.25 + 1.0))


def test_vllm_histograms_have_vllms_buckets(qwen2_vl_tiny: Path):
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]  # vLLM's build_1_2_5_buckets
    with TestClient(create_app(settings(qwen2_vl_tiny), FakeEngine())) as client:
        families = {
            family.name: {s.labels["le"] for s in family.samples if "le" in s.labels}
            for family in text_string_to_metric_families(client.get("/metrics").text)
        }
    assert max(families["vllm:time_to_first_token_seconds"] - {"+Inf"}, key=float) == "2560.0"
    assert "0.001" in families["vllm:time_to_first_token_seconds"]
    assert max(families["vllm:inter_token_latency_seconds"] - {"+Inf"}, key=float) == "80.0"
    assert max(families["vllm:e2e_request_latency_seconds"] - {"+Inf"}, key=float) == "7680.0"
    # token counts: 1-2-5 up to max_model_len (256)
    assert MAX_MODEL_LEN == 256
    expected = {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"}
    assert families["vllm:request_prompt_tokens"] == expected
    assert families["vllm:request_generation_tokens"] == expected


def test_data_parallel_vllm_series_carry_the_engine_label():
    board = MetricsBoard(num_replicas=2, model_name="m")
    board.update(EngineStats(2, 0, 5, 100, 1, prompt_tokens=30, replica=0))
    board.update(EngineStats(1, 4, 7, 100, 0, prompt_tokens=50, replica=1))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(board.render().decode())
        for sample in family.samples
        if sample.name in ("vllm:num_requests_waiting", "vllm:prompt_tokens_total")
        or sample.name == "iris_prompt_tokens_total"
    }
    assert samples == {
        ("vllm:num_requests_waiting", (("engine", "0"), ("model_name", "m"))): 0.0,
        ("vllm:num_requests_waiting", (("engine", "1"), ("model_name", "m"))): 4.0,
        ("vllm:prompt_tokens_total", (("engine", "0"), ("model_name", "m"))): 30.0,
        ("vllm:prompt_tokens_total", (("engine", "1"), ("model_name", "m"))): 50.0,
        ("iris_prompt_tokens_total", (("model_name", "m"), ("replica", "0"))): 30.0,
        ("iris_prompt_tokens_total", (("model_name", "m"), ("replica", "1"))): 50.0,
    }
