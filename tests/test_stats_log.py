"""The launcher's start-up banner and throughput line (server.stats_log)."""

from __future__ import annotations

from iris_serve.common.version import iris_version
from iris_serve.ipc.messages import EngineStats, SchedulerReady
from iris_serve.server.stats_log import banner, throughput_line


def stats(**fields: int) -> EngineStats:
    return EngineStats(
        fields.pop("num_running", 0), fields.pop("num_waiting", 0),
        fields.pop("kv_pages_used", 0), fields.pop("kv_pages_total", 100), 0, **fields,
    )  # fmt: skip


def test_the_throughput_line_sums_replicas_and_is_quiet_when_idle():
    before = [stats(prompt_tokens=100, generation_tokens=10), stats()]
    now = [
        stats(prompt_tokens=300, generation_tokens=30, num_running=2, kv_pages_used=50,
              prefix_cache_hit_tokens=100, prefix_cache_query_tokens=400,
              mm_embedding_cache_hits=3,
              mm_embedding_cache_misses=1),
        stats(generation_tokens=20, num_waiting=1, kv_pages_used=10),
    ]  # fmt: skip
    line = throughput_line(before, now, seconds=10.0)
    assert line is not None
    assert "prompt 20.0 tok/s, generation 4.0 tok/s, running 2, waiting 1" in line
    assert "KV cache 30.0% used" in line and "prefix cache hit rate 25.0%" in line
    assert "image embeddings 75.0% cached" in line
    still_running = throughput_line(now, now, seconds=10.0)  # nothing new, work in flight
    assert still_running is not None and "prompt 0.0 tok/s" in still_running
    idle = [stats(prompt_tokens=5)]
    assert throughput_line(idle, idle, seconds=10.0) is None
    assert "linear-state" not in line  # only a hybrid model's line says it


def test_a_hybrid_models_line_says_how_often_a_snapshot_was_restored():
    before = [stats()]
    now = [stats(prompt_tokens=100, linear_state_snapshot_queries=4,
                 linear_state_snapshot_hits=3)]  # fmt: skip
    line = throughput_line(before, now, seconds=1.0)
    assert line is not None and line.endswith("linear-state snapshots restored for 75.0%")


def test_the_banner_names_the_model_device_cache_and_url():
    scheduler = SchedulerReady(
        name="scheduler", max_model_len=4096, architecture="Qwen3VLForConditionalGeneration",
        device="cuda:0", dtype="bfloat16", kv_pages=1000, page_size=16, max_num_seqs=256,
        max_num_batched_tokens=2048,
    )  # fmt: skip
    line = banner("q3", "http://0.0.0.0:8000", [scheduler, scheduler], 4, 2**30)
    assert line.startswith(f"Iris {iris_version()} ready at http://0.0.0.0:8000, serving 'q3'")
    assert "(Qwen3VLForConditionalGeneration, bfloat16 on cuda:0)" in line
    assert "max_model_len 4096, up to 256 sequences and 2048 tokens per step" in line
    assert "16000 tokens per rank" in line
    assert "2 scheduler replica(s); 4 tokenizer worker(s) with 1.00 GiB arenas" in line
