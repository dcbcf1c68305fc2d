"""`/metrics` in the Prometheus text format, from the gauges the other processes send.

The scheduler and every tokenizer worker push `EngineStats` / `WorkerStats` when their
values change; the server keeps the latest of each and renders them on request, so a
scrape never waits on another process. Worker counters are summed across workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.messages import EngineStats, WorkerStats


@dataclass
class MetricsBoard:
    engine: EngineStats | None = None
    workers: dict[int, WorkerStats] = field(default_factory=dict)

    def update(self, stats: EngineStats | WorkerStats) -> None:
        if isinstance(stats, EngineStats):
            self.engine = stats
        else:
            self.workers[stats.worker_id] = stats

    def render(self) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name} {value}")

        e = self.engine
        if e is not None:
            metric(
                "iris_num_requests_running",
                "gauge",
                "Requests in the running batch.",
                e.num_running,
            )
            metric("iris_num_requests_waiting", "gauge", "Requests waiting to run.", e.num_waiting)
            usage = e.kv_pages_used / e.kv_pages_total if e.kv_pages_total else 0.0
            metric("iris_kv_cache_usage_ratio", "gauge", "Fraction of KV pages in use.", usage)
            metric("iris_kv_cache_used_pages", "gauge", "KV pages in use.", e.kv_pages_used)
            metric("iris_kv_cache_total_pages", "gauge", "KV pages in the pool.", e.kv_pages_total)
            metric(
                "iris_scheduler_pinned_images",
                "gauge",
                "Arena entries pinned by requests in the scheduler.",
                e.pinned_images,
            )
            metric(
                "iris_num_preemptions_total", "counter", "Requests preempted.", e.num_preemptions
            )
            metric(
                "iris_mm_images_encoded_total",
                "counter",
                "Images run through the ViT.",
                e.images_encoded,
            )
            metric(
                "iris_prompt_tokens_total", "counter", "Prompt tokens admitted.", e.prompt_tokens
            )
            metric(
                "iris_generation_tokens_total", "counter", "Tokens generated.", e.generation_tokens
            )
        if self.workers:
            workers = self.workers.values()
            metric(
                "iris_shm_arena_usage_bytes",
                "gauge",
                "Bytes allocated in the tokenizer workers' shared-memory arenas.",
                sum(w.arena_used_bytes for w in workers),
            )
            metric(
                "iris_shm_arena_capacity_bytes",
                "gauge",
                "Capacity of the tokenizer workers' shared-memory arenas.",
                sum(w.arena_capacity_bytes for w in workers),
            )
            metric(
                "iris_shm_arena_pinned_entries",
                "gauge",
                "Arena entries pinned by requests in flight.",
                sum(w.arena_pinned_entries for w in workers),
            )
            metric(
                "iris_tokenizer_requests_total",
                "counter",
                "Requests processed by the tokenizer workers.",
                sum(w.requests_processed for w in workers),
            )
            metric(
                "iris_tokenizer_images_total",
                "counter",
                "Images processed by the tokenizer workers.",
                sum(w.images_processed for w in workers),
            )
        return "\n".join(lines) + "\n"
