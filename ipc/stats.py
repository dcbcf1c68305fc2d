"""What the figures of `EngineStats` and `WorkerStats` are on /metrics and in the server's
throughput line: one row per figure, the only place its metric is named.

A row says how the figure is read from a message (`value`), the Prometheus family it is
(`name`, `kind`, `help`), vLLM's name for the same figure where vLLM's dashboards read it
(`vllm`), and, for the few the throughput line shows, its part of that line (`log`).
`server.metrics` exposes every row, `server.stats_log` writes the logged parts in row
order: a new figure is a field of its message, set where it is counted, plus a row here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec

from .messages import EngineStats, WorkerStats

Kind = Literal["counter", "gauge"]
S = TypeVar("S", EngineStats, WorkerStats)
Value = Callable[[EngineStats], float]


@dataclass(frozen=True)
class Window:
    """The throughput line's interval, summed over the replicas (`total`): the figures at
    its end, how much each grew over it (`grown`, a difference of totals), its seconds."""

    now: EngineStats
    grown: EngineStats
    seconds: float


def _always(window: Window) -> bool:
    return True


@dataclass(frozen=True)
class LogPart:
    """A figure's part of the throughput line: `text` formatted with `number(the row's
    value, the window)`, left out where `shown` says so. `activity`: a nonzero number
    means the engine worked; the line is written only when some activity part is nonzero."""

    text: str
    number: Callable[[Value, Window], float]
    shown: Callable[[Window], bool] = _always
    activity: bool = False


def rate(text: str) -> LogPart:
    """The figure's growth per second over the window (an activity)."""
    return LogPart(text, lambda value, w: value(w.grown) / w.seconds, activity=True)


def level(text: str, *, unit: int = 1, shown: Callable[[Window], bool] = _always) -> LogPart:
    """The figure at the window's end (in `unit`s)."""
    if unit == 1:
        return LogPart(text, lambda value, w: value(w.now), shown)
    return LogPart(text, lambda value, w: value(w.now) / unit, shown)


def load(text: str) -> LogPart:
    """The figure at the window's end, requests the engine holds: nonzero, it is working
    (an activity)."""
    return LogPart(text, lambda value, w: value(w.now), activity=True)


def percent(
    text: str,
    of: Value,
    *,
    grown: bool = True,
    shown: Callable[[Window], bool] = _always,
    hidden_without_base: bool = False,
) -> LogPart:
    """The figure as a percentage of `of` (0 where `of` is 0): of what both grew over the
    window, or (`grown=False`) of their values at its end. `hidden_without_base`: left out
    where `of` did not grow."""

    def number(value: Value, w: Window) -> float:
        stats = w.grown if grown else w.now
        base = of(stats)
        return 100 * value(stats) / base if base else 0

    if hidden_without_base:
        return LogPart(text, number, lambda w: bool(of(w.grown)) and shown(w))
    return LogPart(text, number, shown)


@dataclass(frozen=True)
class Series(Generic[S]):
    """One figure of a stats message: its metric, and its part of the throughput line."""

    name: str  # a counter's ends in `_total`, as it reads on /metrics
    kind: Kind
    help: str
    value: Callable[[S], float]
    vllm: str | None = None  # also exposed under vLLM's name, with vLLM's `engine` label
    log: LogPart | None = None  # engine figures only


def _kv_usage(e: EngineStats) -> float:
    return e.kv_pages_used / e.kv_pages_total if e.kv_pages_total else 0.0


def _host_tier_on(w: Window) -> bool:  # `--kv-offload-gib`
    return bool(w.now.host_tier_capacity_bytes)


def _prefix_queries(e: EngineStats) -> int:
    return e.prefix_cache_query_tokens


# The scheduler's figures, one sample per replica (`Engine.stats` fills them).
ENGINE_SERIES: tuple[Series[EngineStats], ...] = (
    Series("iris_prompt_tokens_total", "counter",
           "Prompt tokens of the requests the scheduler accepted, image tokens included.",
           lambda e: e.prompt_tokens, vllm="vllm:prompt_tokens_total",
           log=rate("prompt {:.1f} tok/s")),
    Series("iris_generation_tokens_total", "counter", "Tokens the engine sampled.",
           lambda e: e.generation_tokens, vllm="vllm:generation_tokens_total",
           log=rate("generation {:.1f} tok/s")),
    Series("iris_num_requests_running", "gauge", "Requests in the scheduler's running batch.",
           lambda e: e.num_running, vllm="vllm:num_requests_running",
           log=load("running {}")),
    Series("iris_num_requests_waiting", "gauge",
           "Requests the scheduler holds that are not running: not yet admitted, or preempted.",
           lambda e: e.num_waiting, vllm="vllm:num_requests_waiting",
           log=load("waiting {}")),
    Series("iris_kv_cache_usage_ratio", "gauge",
           "Fraction of KV pages held by requests, 0 to 1 (cached pages no request holds "
           "count as free: a new request may take them).",
           _kv_usage, vllm="vllm:kv_cache_usage_perc"),
    Series("iris_kv_cache_used_pages", "gauge", "KV pages held by requests.",
           lambda e: e.kv_pages_used,
           log=percent("KV cache {:.1f}% used", lambda e: e.kv_pages_total, grown=False)),
    Series("iris_kv_cache_total_pages", "gauge", "KV pages in the pool.",
           lambda e: e.kv_pages_total),
    Series("iris_scheduler_pinned_images", "gauge",
           "Arena entries pinned by requests in the scheduler.", lambda e: e.pinned_images),
    Series("iris_mm_embedding_cache_usage_bytes", "gauge",
           "Device bytes held by the image embedding cache.",
           lambda e: e.mm_embedding_cache_usage_bytes),
    Series("iris_device_memory_allocated_bytes", "gauge",
           "Device memory allocated by the scheduler's torch now (CUDA; 0 on CPU).",
           lambda e: e.device_memory_allocated_bytes),
    Series("iris_device_memory_peak_bytes", "gauge",
           "Most device memory the scheduler's torch has allocated since it started "
           "(torch.cuda.max_memory_allocated; 0 on CPU).",
           lambda e: e.device_memory_peak_bytes),
    Series("iris_num_preemptions_total", "counter",
           "Preemptions: a running request sent back to wait, its KV pages freed (a request "
           "preempted twice counts twice).",
           lambda e: e.num_preemptions, vllm="vllm:num_preemptions_total"),
    Series("iris_prefix_cache_hit_tokens_total", "counter",
           "Prompt tokens whose KV the prefix cache held at requests' first admission (a "
           "request admitted again after a preemption is not counted again).",
           lambda e: e.prefix_cache_hit_tokens, vllm="vllm:prefix_cache_hits_total",
           # as vLLM's "Prefix cache hit rate": hit tokens over the tokens looked up
           log=percent("prefix cache hit rate {:.1f}%", _prefix_queries)),
    Series("iris_prefix_cache_query_tokens_total", "counter",
           "Prompt tokens looked up in the prefix cache at requests' first admission.",
           _prefix_queries, vllm="vllm:prefix_cache_queries_total"),
    Series("iris_mm_images_encoded_total", "counter", "Images run through the vision encoder.",
           lambda e: e.images_encoded),
    Series("iris_mm_embedding_cache_hits_total", "counter",
           "Images whose embedding was found in the embedding cache.",
           lambda e: e.mm_embedding_cache_hits,
           log=percent("image embeddings {:.1f}% cached",
                       lambda e: e.mm_embedding_cache_hits + e.mm_embedding_cache_misses)),
    Series("iris_mm_embedding_cache_misses_total", "counter",
           "Images whose embedding was not in the embedding cache.",
           lambda e: e.mm_embedding_cache_misses),
    Series("iris_linear_state_snapshot_queries_total", "counter",
           "Requests admitted for the first time on a hybrid model (Qwen3.5): the "
           "denominator of the snapshot hit rate.",
           lambda e: e.linear_state_snapshot_queries),
    Series("iris_linear_state_snapshot_hits_total", "counter",
           "Of those, requests whose prefix-cache hit restored a snapshot of the "
           "linear-attention state.",
           lambda e: e.linear_state_snapshot_hits,
           log=percent("linear-state snapshots restored for {:.1f}%",
                       lambda e: e.linear_state_snapshot_queries, hidden_without_base=True)),
    Series("iris_linear_state_snapshots", "gauge",
           "Snapshots of the linear-attention state the prefix cache keeps (hybrid models).",
           lambda e: e.linear_state_snapshots),
    Series("iris_linear_state_slots_held", "gauge",
           "Working slots of the linear-attention state held by requests (hybrid models).",
           lambda e: e.linear_state_slots_held),
    Series("iris_prefix_cache_host_hit_tokens_total", "counter",
           "Of the prefix cache's hit tokens, those reloaded from the host tier "
           "(--kv-offload-gib).",
           lambda e: e.prefix_cache_host_hit_tokens,
           log=percent("host tier {:.1f}% of prefix tokens", _prefix_queries,
                       shown=_host_tier_on)),
    Series("iris_mm_embedding_cache_host_hits_total", "counter",
           "Of the embedding cache's hits, images whose embedding was reloaded from the host "
           "tier.",
           lambda e: e.mm_embedding_cache_host_hits),
    Series("iris_host_tier_capacity_bytes", "gauge",
           "Host memory of the tier under the prefix and embedding caches (per "
           "tensor-parallel rank for the KV).",
           lambda e: e.host_tier_capacity_bytes),
    Series("iris_host_tier_usage_bytes", "gauge", "Bytes the host tier holds.",
           lambda e: e.host_tier_usage_bytes,
           log=level("{:.2f} GiB held", unit=2**30, shown=_host_tier_on)),
    Series("iris_host_tier_pages", "gauge", "KV pages the host tier holds.",
           lambda e: e.host_tier_pages),
    Series("iris_host_tier_embeddings", "gauge", "Image embeddings the host tier holds.",
           lambda e: e.host_tier_embeddings),
    Series("iris_host_tier_spilled_bytes_total", "counter",
           "Bytes the device caches evicted into the host tier.",
           lambda e: e.host_tier_bytes_to_host),
    Series("iris_host_tier_reloaded_bytes_total", "counter",
           "Bytes reloaded from the host tier to the device.",
           lambda e: e.host_tier_bytes_to_device),
    Series("iris_host_tier_copy_seconds_total", "counter",
           "Seconds spent copying between the device and the host tier (issuing them, on "
           "CUDA).",
           lambda e: e.host_tier_copy_seconds),
    Series("iris_host_tier_page_copies_total", "counter",
           "KV pages copied between the device and the host tier, either way.",
           lambda e: e.host_tier_page_copies),
    Series("iris_host_tier_failed_reloads_total", "counter",
           "Reloads from the host tier that failed (their tokens were computed instead).",
           lambda e: e.host_tier_failed_reloads),
)  # fmt: skip

# The tokenizer workers' figures, summed over the workers (`TokenizerWorker.stats`).
WORKER_SERIES: tuple[Series[WorkerStats], ...] = (
    Series("iris_shm_arena_usage_bytes", "gauge",
           "Bytes held in the tokenizer workers' shared-memory arenas (in flight and cached).",
           lambda w: w.arena_used_bytes),
    Series("iris_shm_arena_capacity_bytes", "gauge",
           "Capacity of the tokenizer workers' shared-memory arenas.",
           lambda w: w.arena_capacity_bytes),
    Series("iris_shm_arena_pinned_entries", "gauge",
           "Arena entries pinned by requests in flight.", lambda w: w.arena_pinned_entries),
    Series("iris_shm_arena_waiting_requests", "gauge",
           "Requests waiting for room in a tokenizer worker's arena (full of pinned entries).",
           lambda w: w.arena_waiting_requests),
    Series("iris_tokenizer_requests_total", "counter",
           "Requests processed by the tokenizer workers.", lambda w: w.requests_processed),
    Series("iris_tokenizer_images_total", "counter",
           "Images decoded and processed by the tokenizer workers (processor cache misses, "
           "or every image with the cache disabled).",
           lambda w: w.images_processed),
    Series("iris_mm_processor_cache_hits_total", "counter",
           "Images found in a tokenizer worker's processor cache (not decoded again).",
           lambda w: w.processor_cache_hits),
    Series("iris_mm_processor_cache_misses_total", "counter",
           "Images not in a tokenizer worker's processor cache.",
           lambda w: w.processor_cache_misses),
    Series("iris_mm_uuid_hits_total", "counter",
           "Image parts sent with a uuid and no data whose uuid the worker knew (served "
           "from the caches).",
           lambda w: w.image_uuid_hits),
    Series("iris_mm_uuid_misses_total", "counter",
           "Image parts sent with a uuid and no data whose uuid the worker did not know "
           "(400).",
           lambda w: w.image_uuid_misses),
    Series("iris_mm_uuid_entries", "gauge", "Image uuids the tokenizer workers remember.",
           lambda w: w.image_uuids),
)  # fmt: skip

# Fields that are no figure: where the message came from, and a histogram's feed.
NOT_FIGURES = frozenset({"replica", "encoder_seconds", "worker_id"})


def total(stats: Sequence[EngineStats]) -> EngineStats:
    """The replicas' figures summed, field by field (what the throughput line reads)."""
    return _combine(stats, sum)


def difference(later: EngineStats, earlier: EngineStats) -> EngineStats:
    """How much each figure grew from `earlier` to `later`."""
    return _combine([later, earlier], lambda values: values[0] - values[1])


def _combine(stats: Sequence[EngineStats], combine: Callable[[list[float]], float]) -> EngineStats:
    fields: dict[str, Any] = {
        field.name: combine([getattr(s, field.name) for s in stats])
        for field in msgspec.structs.fields(EngineStats)
        if field.name not in NOT_FIGURES
    }
    return EngineStats(**fields)
