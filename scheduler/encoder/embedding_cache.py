"""Per-image vision-tower outputs, shared by every request, LRU-bounded in bytes.

Two parts, as with KV pages (and as vLLM's `EncoderCacheManager`): the bookkeeping (which
requests use an entry, the LRU of unused ones, the bytes) and the `dict[key, Tensor]` it
describes. `lookup` of an absent key creates a *pending* entry that the caller fills with
`put` in the same step, so a second request for the key in that step is a hit and the
image is encoded once.

A request holds an entry from its first `lookup` until `release(request_id)`,
preemption included ("hold" here; "pin" is the shared-memory arena's word). An entry
nobody holds joins the tail of the LRU; eviction takes from its head while the bytes
exceed the capacity and never touches a held entry: **when every entry is held the cache
goes over capacity rather than evict one**. Capacity 0 therefore keeps an entry exactly as
long as some request uses it.

Why holds do not end once the prefill has passed the image: a preempted request would
then re-encode, so its pixels (the larger: 4 patches of 3·2·14·14 values per image token
against one hidden vector) would stay pinned in shared memory until it ends. Held from
first use to the end, the entry lets the pixels go at first use.

With a host tier (host_tier.py), an entry evicted here moves to host memory, and a
lookup that misses here but finds it there fills the entry at once: a hit (`host_hits`
counts them), no vision tower.

A hit whose token count is not the caller's (`docs/design.md`, "One cache entry per
image") is logged and treated as a miss: the entry is replaced when nobody uses it,
otherwise the caller gets `Lookup.UNCACHEABLE` and encodes the image for its request alone.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..kv.host_tier import HostTier

logger = logging.getLogger(__name__)

CacheKey = Hashable  # an image's 16-byte key, or a request-scoped key when sharing is off


class Lookup(enum.Enum):
    HIT = "hit"  # present or being encoded this step; now held by the request
    MISS = "miss"  # a new pending entry held by the request: encode, then `put`
    UNCACHEABLE = "uncacheable"  # token-count mismatch with an entry in use: encode privately


@dataclass
class _Entry:
    num_tokens: int
    users: set[str] = field(default_factory=set)
    nbytes: int = 0  # 0 while pending


class EmbeddingCache:
    def __init__(self, capacity_bytes: int, host: HostTier | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError("the embedding cache capacity must not be negative")
        self.capacity_bytes = capacity_bytes
        self.host = host  # where evicted embeddings go (None: nowhere)
        self.usage_bytes = 0
        self.hits = 0
        self.host_hits = 0  # of `hits`, entries reloaded from the host tier
        self.misses = 0
        self._entries: dict[CacheKey, _Entry] = {}
        self._unused: OrderedDict[CacheKey, None] = OrderedDict()  # no users, LRU first
        self._keys_of: dict[str, dict[CacheKey, None]] = {}  # request id -> keys, in order
        self._tensors: dict[CacheKey, torch.Tensor] = {}

    # -- queries --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    @property
    def num_held(self) -> int:
        """Entries some request holds."""
        return len(self._entries) - len(self._unused)

    def keys(self) -> list[CacheKey]:
        return list(self._entries)

    def users(self, key: CacheKey) -> frozenset[str]:
        entry = self._entries.get(key)
        return frozenset(entry.users) if entry else frozenset()

    def pending_keys(self) -> list[CacheKey]:
        return [key for key in self._entries if key not in self._tensors]

    def get(self, key: CacheKey) -> torch.Tensor | None:
        """The embedding of a filled entry; None while pending or absent."""
        return self._tensors.get(key)

    # -- holds ----------------------------------------------------------------------------

    def lookup(self, key: CacheKey, num_tokens: int, request_id: str) -> Lookup:
        """Holds `key` for `request_id`; a request's second lookup of a key counts nothing."""
        entry = self._entries.get(key)
        if entry is not None and entry.num_tokens != num_tokens:
            logger.error(
                "embedding cache entry %s has %d tokens but the image spans %d: treated as a miss",
                key.hex() if isinstance(key, bytes) else key,
                entry.num_tokens,
                num_tokens,
            )
            if entry.users:
                self.misses += 1
                return Lookup.UNCACHEABLE
            self._drop(key)
            entry = None
        if entry is None:
            self._entries[key] = _Entry(num_tokens, {request_id})
            self._keys_of.setdefault(request_id, {})[key] = None
            reloaded = None if self.host is None else self.host.reload_embedding(key, num_tokens)
            if reloaded is None:
                self.misses += 1
                return Lookup.MISS
            self.hits += 1
            self.host_hits += 1
            self._fill(key, reloaded)
            self._evict()
            return Lookup.HIT
        if request_id not in entry.users:
            self.hits += 1
            if not entry.users:
                del self._unused[key]
            entry.users.add(request_id)
            self._keys_of.setdefault(request_id, {})[key] = None
        return Lookup.HIT

    def put(self, key: CacheKey, embedding: torch.Tensor) -> None:
        """Fills a pending entry with the vision tower's `[num_tokens, hidden]` output."""
        entry = self._entries[key]
        if key in self._tensors:
            raise ValueError(f"embedding cache entry {key!r} is already filled")
        if embedding.shape[0] != entry.num_tokens:
            raise ValueError(
                f"an embedding of {embedding.shape[0]} tokens for an entry of {entry.num_tokens}"
            )
        self._fill(key, embedding)
        self._evict()

    def release(self, request_id: str) -> None:
        """Lets go of every entry a finished or aborted request holds (safe twice); entries
        nobody holds any more join the LRU in the order the request took them."""
        for key in self._keys_of.pop(request_id, ()):
            entry = self._entries[key]
            entry.users.discard(request_id)
            if entry.users:
                continue
            if key in self._tensors:
                self._unused[key] = None
            else:
                self._drop(key)  # pending and abandoned (its encode never happened)
        self._evict()

    # -- internals ------------------------------------------------------------------------

    def _fill(self, key: CacheKey, embedding: torch.Tensor) -> None:
        entry = self._entries[key]
        self._tensors[key] = embedding
        entry.nbytes = embedding.numel() * embedding.element_size()
        self.usage_bytes += entry.nbytes

    def _evict(self) -> None:
        while self.usage_bytes > self.capacity_bytes and self._unused:
            key, _ = self._unused.popitem(last=False)
            if self.host is not None:
                self.host.spill_embedding(key, self._tensors[key])
            self._drop(key)

    def _drop(self, key: CacheKey) -> None:
        entry = self._entries.pop(key)
        self._unused.pop(key, None)
        self._tensors.pop(key, None)
        self.usage_bytes -= entry.nbytes
