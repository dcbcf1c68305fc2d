"""The engine's caches and the host tier under them, and who hears of whom among them,
wired in this one place (`Engine.__init__` calls `build_caches`; `docs/design.md`, "The
engine's step"). No constructor installs a hook on another object: each cache is given
what it calls, and the two cross-owner links are made here.

- The KV page pool's evictions go to the host tier (`PagePool.on_evict`), which copies
  each evicted page to host memory before its new owner writes it.
- A hybrid model's prefix matches end at a page whose linear-state snapshot the state
  slots can restore (`PrefixCache.require_snapshots`).
- With KV events (`--kv-events-config`), the prefix cache announces what it registers
  (`PrefixCache.events`) and the pool's evictions remove it (`KvEventLog.removed`), or
  move it to the host tier's medium where the tier took the page; the tier's own drops
  remove it there (`HostTier.on_page_drop`).

What the caches decide for the device during planning (slot clears and copies, host
copies) they record for the planner, which hands it over in the step plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import EngineConfig
from ..device_state import DeviceState
from ..encoder.embedding_cache import EmbeddingCache
from ..hybrid.state_slots import StateSlots
from ..kv.host_tier import HostTier
from ..kv.kv_events import KvEventLog
from ..kv.prefix_cache import PrefixCache


@dataclass(frozen=True)
class Caches:
    host_tier: HostTier | None  # evicted pages, embeddings and snapshots, in host memory
    prefix_cache: PrefixCache | None
    embedding_cache: EmbeddingCache
    state_slots: StateSlots | None  # a hybrid model's linear-attention state
    kv_events: KvEventLog | None = None  # what a cluster router hears of the prefix cache


def build_caches(config: EngineConfig, state: DeviceState, record_copies: bool) -> Caches:
    """The caches over `state`'s pools, wired to each other. `record_copies`: the host tier
    keeps its copies for the other tensor-parallel ranks (the step plan carries them)."""
    host_tier = (
        None
        if state.host_memory is None
        else HostTier(config.kv_offload_bytes, state.host_memory, state.device, record_copies)
    )
    pool = state.kv_cache.pool
    prefix_cache = (
        PrefixCache(pool, config.page_size, host_tier) if config.enable_prefix_caching else None
    )
    embedding_cache = EmbeddingCache(
        config.mm_embedding_cache_bytes if config.enable_mm_embedding_cache else 0,
        host_tier if config.enable_mm_embedding_cache else None,
    )
    state_slots = (
        None
        if state.linear_states is None
        else StateSlots.for_pool(config, state.linear_states, prefix_cache, host_tier)
    )
    kv_events = (
        KvEventLog(config.page_size, host_tier=host_tier is not None)
        if config.kv_events is not None and prefix_cache is not None
        else None
    )
    if prefix_cache is not None:
        prefix_cache.events = kv_events
        if host_tier is not None or kv_events is not None:
            pool.on_evict = _evicted(host_tier, kv_events)
        if host_tier is not None and kv_events is not None:
            host_tier.on_page_drop = kv_events.host_dropped
    if state_slots is not None and prefix_cache is not None:
        prefix_cache.require_snapshots(state_slots.has_snapshot)
    return Caches(host_tier, prefix_cache, embedding_cache, state_slots, kv_events)


def _evicted(
    host_tier: HostTier | None, kv_events: KvEventLog | None
) -> Callable[[int, bytes, bytes], None]:
    """The pool's eviction hook: the page to the host tier (where there is one), then its
    events (removed from the device; stored on the host if the tier took it)."""

    def evicted(page: int, key: bytes, tokens: bytes) -> None:
        on_host = host_tier is not None and host_tier.spill_page(page, key, tokens)
        if kv_events is not None:
            kv_events.removed(key, to_host=on_host)

    return evicted
