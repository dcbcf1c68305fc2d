"""EmbeddingCache alone: holds, LRU by bytes, token-count checks, dedupe (fake tensors)."""

from __future__ import annotations

import logging

import pytest
import torch

from iris_serve.scheduler.encoder.embedding_cache import EmbeddingCache, Lookup
from iris_serve.scheduler.encoder.manager import request_scoped_keys

HIDDEN = 4  # fp32: 16 bytes per token


def emb(num_tokens: int, value: float = 0.0) -> torch.Tensor:
    return torch.full((num_tokens, HIDDEN), value)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(cache: EmbeddingCache, k: bytes, request_id: str, num_tokens: int = 4) -> None:
    """A request's miss, encoded and stored (64 bytes at 4 tokens)."""
    assert cache.lookup(k, num_tokens, request_id) is Lookup.MISS
    cache.put(k, emb(num_tokens, float(k[0])))


def test_miss_then_hit_holds_and_counts() -> None:
    cache = EmbeddingCache(1 << 20)
    fill(cache, key(1), "a")
    assert cache.usage_bytes == 64 and cache.misses == 1 and cache.hits == 0
    assert cache.lookup(key(1), 4, "b") is Lookup.HIT
    assert cache.lookup(key(1), 4, "b") is Lookup.HIT  # again by the same request: no count
    assert cache.hits == 1 and cache.users(key(1)) == {"a", "b"}
    assert torch.equal(cache.get(key(1)), emb(4, 1.0))
    cache.release("a")
    cache.release("b")
    cache.release("b")  # twice is harmless
    assert cache.num_held == 0 and key(1) in cache and cache.usage_bytes == 64


def test_lru_eviction_by_bytes_takes_the_least_recently_released() -> None:
    cache = EmbeddingCache(3 * 64)
    for i in range(3):
        fill(cache, key(i), f"r{i}")
    for i in (1, 0, 2):  # released in this order: 1 is the least recently used
        cache.release(f"r{i}")
    assert len(cache) == 3 and cache.usage_bytes == 192
    assert cache.lookup(key(0), 4, "again") is Lookup.HIT  # 0 leaves the LRU while held
    fill(cache, key(3), "new")
    assert key(1) not in cache and {key(0), key(2), key(3)} <= set(cache.keys())
    fill(cache, key(4), "newer")
    assert key(2) not in cache and key(0) in cache  # 0 is held, 2 was next in the LRU
    assert cache.usage_bytes == 192


def test_held_entries_are_never_evicted_the_cache_goes_over_capacity() -> None:
    cache = EmbeddingCache(100)
    for i in range(4):
        fill(cache, key(i), "long-running")
    assert len(cache) == 4 and cache.usage_bytes == 256 > cache.capacity_bytes
    assert all(torch.equal(cache.get(key(i)), emb(4, float(i))) for i in range(4))
    cache.release("long-running")  # let go: shrinks back to the capacity, oldest first
    assert cache.usage_bytes == 64 and list(cache.keys()) == [key(3)]


def test_letting_go_makes_an_entry_evictable_only_when_its_last_user_leaves() -> None:
    cache = EmbeddingCache(0)  # capacity 0: an entry lives exactly as long as a user
    fill(cache, key(1), "a")
    assert cache.lookup(key(1), 4, "b") is Lookup.HIT
    cache.release("a")
    assert key(1) in cache and cache.users(key(1)) == {"b"}
    cache.release("b")
    assert key(1) not in cache and cache.usage_bytes == 0


def test_a_token_count_mismatch_is_a_miss_never_a_hit(caplog: pytest.LogCaptureFixture) -> None:
    cache = EmbeddingCache(1 << 20)
    fill(cache, key(1), "a", num_tokens=4)
    with caplog.at_level(logging.ERROR, logger="iris_serve.scheduler.encoder.embedding_cache"):
        # in use by "a": the other request must encode for itself, the entry stays
        assert cache.lookup(key(1), 6, "b") is Lookup.UNCACHEABLE
        assert cache.users(key(1)) == {"a"} and cache.get(key(1)).shape[0] == 4
        cache.release("a")
        # unused: replaced by the caller's encode
        assert cache.lookup(key(1), 6, "c") is Lookup.MISS
    assert "has 4 tokens but the image spans 6" in caplog.text
    assert cache.get(key(1)) is None and cache.usage_bytes == 0
    cache.put(key(1), emb(6))
    assert cache.usage_bytes == 96 and cache.hits == 0 and cache.misses == 3
    with pytest.raises(ValueError, match="already filled"):
        cache.put(key(1), emb(6))


def test_concurrent_requests_in_one_step_share_one_pending_encode() -> None:
    cache = EmbeddingCache(1 << 20)
    results = [cache.lookup(key(7), 4, f"r{i}") for i in range(8)]
    assert results == [Lookup.MISS] + [Lookup.HIT] * 7
    assert cache.pending_keys() == [key(7)] and cache.get(key(7)) is None
    assert cache.usage_bytes == 0  # nothing to count until the tensor arrives
    cache.put(key(7), emb(4))
    assert cache.pending_keys() == [] and cache.misses == 1 and cache.hits == 7
    assert cache.users(key(7)) == {f"r{i}" for i in range(8)}
    assert cache.lookup(key(8), 4, "r0") is Lookup.MISS
    with pytest.raises(ValueError, match="5 tokens for an entry of 4"):
        cache.put(key(8), emb(5))


def test_an_abandoned_pending_entry_is_dropped_with_its_last_user() -> None:
    cache = EmbeddingCache(1 << 20)
    assert cache.lookup(key(1), 4, "aborted") is Lookup.MISS
    cache.release("aborted")
    assert key(1) not in cache and cache.usage_bytes == 0
    assert cache.lookup(key(1), 4, "next") is Lookup.MISS


def test_request_scoped_keys_change_with_any_image_of_the_request() -> None:
    a, b, c = key(1), key(2), key(3)
    two = request_scoped_keys([a, b])
    three = request_scoped_keys([a, b, c])
    assert len(set(two + three)) == 5 and all(len(k) == 16 for k in two + three)
    assert request_scoped_keys([a, b]) == two  # deterministic
    assert request_scoped_keys([a, a])[0] != request_scoped_keys([a, a])[1]  # by index
