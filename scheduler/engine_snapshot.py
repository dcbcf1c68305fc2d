"""The engine's gauges and counters at one moment: what `Engine.stats` returns and the
scheduler process sends as `ipc.EngineStats` (the same names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges and counters at one moment (names as in `ipc.EngineStats`)."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    pinned_images: int  # shared-memory pins held (none in process)
    num_preemptions: int
    images_encoded: int  # images run through the vision tower
    prompt_tokens: int  # of the requests admitted
    generation_tokens: int
    prefix_cache_hit_tokens: int  # prompt tokens found in the prefix cache
    prefix_cache_query_tokens: int  # prompt tokens looked up in it
    mm_embedding_cache_hits: int  # images a request got without the vision tower
    mm_embedding_cache_misses: int
    mm_embedding_cache_usage_bytes: int
    # a hybrid model's: first admissions, those that restored a linear-state snapshot,
    # and the snapshots kept
    linear_state_snapshot_queries: int = 0
    linear_state_snapshot_hits: int = 0
    linear_state_snapshots: int = 0
    # the host tier's (`kv_offload_bytes`; zeros without it): prompt tokens reloaded at
    # first admission, embeddings reloaded, its bytes, entries, traffic and copy time
    prefix_cache_host_hit_tokens: int = 0
    mm_embedding_cache_host_hits: int = 0
    host_tier_capacity_bytes: int = 0
    host_tier_usage_bytes: int = 0
    host_tier_pages: int = 0
    host_tier_embeddings: int = 0
    host_tier_bytes_to_host: int = 0
    host_tier_bytes_to_device: int = 0
    host_tier_copy_seconds: float = 0.0
    host_tier_page_copies: int = 0  # KV pages copied either way
    host_tier_failed_reloads: int = 0
