"""`/metrics` in the Prometheus text format: the other processes' totals and gauges, and
the histograms the server observes.

The scheduler and every tokenizer worker push `EngineStats` / `WorkerStats` when their
values change; the board keeps the latest of each, and a collector reads them at
scrape time, so a scrape never waits on another process. Their counters arrive as
totals since start and are exposed as they are (worker totals summed across workers):
nothing is added up here, so nothing is counted twice. Histograms are observed here:
`iris_mm_encoder_seconds` from the encoder timings each `EngineStats` carries (those
since the previous one), `iris_time_to_first_token_seconds` by the HTTP handlers.

With data-parallel replicas (`num_replicas > 1`) every engine metric has one sample per
replica, labelled `replica="r"`; a single scheduler's are unlabelled.

Every board has its own `CollectorRegistry`, so several apps in one process (tests)
never clash. Before the first stats arrive, every value reads zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from iris_serve.ipc.messages import EngineStats, WorkerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes

ENCODER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (
    *(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0),
)

_NO_ENGINE = EngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=0,
                         pinned_images=0)  # fmt: skip

# name, type, help, value from the latest EngineStats
_ENGINE: list[tuple[str, str, str, Callable[[EngineStats], float]]] = [
    ("iris_num_requests_running", "gauge", "Requests in the running batch.",
     lambda e: e.num_running),
    ("iris_num_requests_waiting", "gauge", "Requests waiting to run.", lambda e: e.num_waiting),
    ("iris_kv_cache_usage_ratio", "gauge", "Fraction of KV pages in use.",
     lambda e: e.kv_pages_used / e.kv_pages_total if e.kv_pages_total else 0.0),
    ("iris_kv_cache_used_pages", "gauge", "KV pages in use.", lambda e: e.kv_pages_used),
    ("iris_kv_cache_total_pages", "gauge", "KV pages in the pool.", lambda e: e.kv_pages_total),
    ("iris_scheduler_pinned_images", "gauge",
     "Arena entries pinned by requests in the scheduler.", lambda e: e.pinned_images),
    ("iris_mm_embedding_cache_usage_bytes", "gauge",
     "Device bytes held by the image embedding cache.",
     lambda e: e.mm_embedding_cache_usage_bytes),
    ("iris_device_memory_allocated_bytes", "gauge",
     "Device memory allocated by the scheduler's torch now (CUDA; 0 on CPU).",
     lambda e: e.device_memory_allocated_bytes),
    ("iris_device_memory_peak_bytes", "gauge",
     "Most device memory the scheduler's torch has allocated since it started "
     "(torch.cuda.max_memory_allocated; 0 on CPU).",
     lambda e: e.device_memory_peak_bytes),
    ("iris_num_preemptions_total", "counter", "Requests preempted.",
     lambda e: e.num_preemptions),
    ("iris_prompt_tokens_total", "counter", "Prompt tokens admitted.", lambda e: e.prompt_tokens),
    ("iris_generation_tokens_total", "counter", "Tokens generated.",
     lambda e: e.generation_tokens),
    ("iris_prefix_cache_hit_tokens_total", "counter",
     "Prompt tokens whose KV came from the prefix cache.",
     lambda e: e.prefix_cache_hit_tokens),
    ("iris_mm_images_encoded_total", "counter", "Images run through the vision encoder.",
     lambda e: e.images_encoded),
    ("iris_mm_embedding_cache_hits_total", "counter",
     "Images whose embedding was found in the embedding cache.",
     lambda e: e.mm_embedding_cache_hits),
    ("iris_mm_embedding_cache_misses_total", "counter",
     "Images whose embedding was not in the embedding cache.",
     lambda e: e.mm_embedding_cache_misses),
]  # fmt: skip

# name, type, help, value of one WorkerStats (summed across workers)
_WORKERS: list[tuple[str, str, str, Callable[[WorkerStats], float]]] = [
    ("iris_shm_arena_usage_bytes", "gauge",
     "Bytes held in the tokenizer workers' shared-memory arenas (in flight and cached).",
     lambda w: w.arena_used_bytes),
    ("iris_shm_arena_capacity_bytes", "gauge",
     "Capacity of the tokenizer workers' shared-memory arenas.",
     lambda w: w.arena_capacity_bytes),
    ("iris_shm_arena_pinned_entries", "gauge", "Arena entries pinned by requests in flight.",
     lambda w: w.arena_pinned_entries),
    ("iris_tokenizer_requests_total", "counter",
     "Requests processed by the tokenizer workers.", lambda w: w.requests_processed),
    ("iris_tokenizer_images_total", "counter",
     "Images decoded and processed by the tokenizer workers (processor cache misses, or "
     "every image with the cache disabled).",
     lambda w: w.images_processed),
    ("iris_mm_processor_cache_hits_total", "counter",
     "Images found in a tokenizer worker's processor cache (not decoded again).",
     lambda w: w.processor_cache_hits),
    ("iris_mm_processor_cache_misses_total", "counter",
     "Images not in a tokenizer worker's processor cache.",
     lambda w: w.processor_cache_misses),
]  # fmt: skip


class MetricsBoard:
    """The latest stats of every process, and the server's histograms, in one registry."""

    def __init__(self, num_replicas: int = 1) -> None:
        self.num_replicas = num_replicas
        self.engines: dict[int, EngineStats] = {}  # the latest of each replica
        self.workers: dict[int, WorkerStats] = {}
        self.registry = CollectorRegistry()
        self.registry.register(_LatestStats(self))
        self.encoder_seconds = Histogram(
            "iris_mm_encoder_seconds",
            "Duration of one vision-encoder call.",
            buckets=ENCODER_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "iris_time_to_first_token_seconds",
            "From a request's arrival at the server to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )

    def update(self, stats: EngineStats | WorkerStats) -> None:
        if isinstance(stats, EngineStats):
            self.engines[stats.replica] = stats
            for seconds in stats.encoder_seconds:
                self.encoder_seconds.observe(seconds)
        else:
            self.workers[stats.worker_id] = stats

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LatestStats:
    """A collector over the board's latest stats (read at scrape time)."""

    def __init__(self, board: MetricsBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        board = self.board
        engines = [board.engines.get(r, _NO_ENGINE) for r in range(board.num_replicas)]
        for name, kind, help_text, value in _ENGINE:
            if board.num_replicas == 1:
                yield _family(name, kind, help_text, value(engines[0]))
            else:
                yield _per_replica(name, kind, help_text, [value(e) for e in engines])
        workers = list(self.board.workers.values())
        for name, kind, help_text, value in _WORKERS:
            yield _family(name, kind, help_text, sum(value(w) for w in workers))


def _per_replica(name: str, kind: str, help_text: str, values: list[float]) -> Metric:
    family: CounterMetricFamily | GaugeMetricFamily
    if kind == "counter":
        family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=["replica"])
    else:
        family = GaugeMetricFamily(name, help_text, labels=["replica"])
    for replica, value in enumerate(values):
        family.add_metric([str(replica)], value)
    return family


def _family(name: str, kind: str, help_text: str, value: float) -> Metric:
    if kind == "counter":  # named without `_total`: the family adds it to the sample
        return CounterMetricFamily(name.removesuffix("_total"), help_text, value=value)
    return GaugeMetricFamily(name, help_text, value=value)
