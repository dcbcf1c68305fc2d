"""The processor cache: LRU by bytes over the worker's arena, pins, checks, and the worker
around it (a hit skips decoding and processing; the disabled mode keeps nothing)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iris_serve.ipc.messages import EngineRequest, RequestError
from iris_serve.ipc.shm_arena import ArenaFull, ShmArena, ShmReader
from iris_serve.ipc.shm_names import instance_prefix, segment_name, sweep
from iris_serve.tokenizer_worker.config import WorkerConfig
from iris_serve.tokenizer_worker.images import parts as image_parts_module
from iris_serve.tokenizer_worker.images.processor_cache import CorruptEntry, ProcessorCache
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from iris_serve.tokenizer_worker.worker import TokenizerWorker
from tests.reference import make_image
from tests.test_tokenizer_worker import chat, data_url, image_part, release_all, request

MiB = 1 << 20
GRID = (1, 4, 4)  # 16 patches, 4 tokens
PATCH = 8  # pixels per patch side: a 32x32 uint8 image, 3 KiB
ENTRY = 64 + prod(GRID) * PATCH * PATCH * 3  # header + data, as the arena counts it


def tokens(grid: tuple[int, int, int]) -> int:
    return prod(grid) // 4


def pixel_shape(grid: tuple[int, int, int], frames: int = 1) -> tuple[int, ...]:
    shape = (grid[1] * PATCH, grid[2] * PATCH, 3)
    return shape if frames == 1 else (frames, *shape)


def pixels(seed: int) -> np.ndarray:
    return np.full(pixel_shape(GRID), seed, dtype=np.uint8)


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


@pytest.fixture
def instance() -> Iterator[str]:
    instance = f"test-{uuid.uuid4().hex[:12]}"
    yield instance
    sweep(instance_prefix(instance))


@pytest.fixture
def make_cache(instance: str) -> Iterator[Callable[..., ProcessorCache]]:
    arenas: list[ShmArena] = []

    def make(entries: int = 3, enabled: bool = True) -> ProcessorCache:
        arena = ShmArena(segment_name(instance, len(arenas)), entries * ENTRY)
        arenas.append(arena)
        return ProcessorCache(arena, tokens, pixel_shape, enabled=enabled)

    yield make
    for arena in arenas:
        arena.close()
        arena.unlink()


def test_lru_eviction_is_bounded_by_the_arena_bytes(make_cache):
    cache = make_cache(entries=3)
    for n in (1, 2, 3):
        stored = cache.store(key(n), pixels(n), GRID)
        assert stored.num_tokens == 4 and stored.grid == GRID
        cache.arena.release(stored.pointer)
    assert cache.arena.usage_bytes == cache.arena.capacity_bytes == 3 * ENTRY
    touched = cache.lookup(key(1))  # 1 becomes the most recently used
    assert touched is not None
    cache.arena.release(touched.pointer)

    cache.arena.release(cache.store(key(4), pixels(4), GRID).pointer)  # evicts 2, the LRU
    assert cache.arena.usage_bytes == 3 * ENTRY
    assert cache.lookup(key(2)) is None
    with ShmReader() as reader:
        for n in (1, 3, 4):
            hit = cache.lookup(key(n))
            assert hit is not None and int(reader.view(hit.pointer)[0, 0, 0]) == n
            cache.arena.release(hit.pointer)
    assert (cache.hits, cache.misses) == (4, 1)


def test_pinned_entries_are_never_evicted(make_cache):
    cache = make_cache(entries=3)
    pinned = cache.store(key(1), pixels(1), GRID)  # a request in flight holds it
    for n in (2, 3):
        cache.arena.release(cache.store(key(n), pixels(n), GRID).pointer)
    held = [cache.store(key(n), pixels(n), GRID) for n in (4, 5)]  # evict 2 and 3, not 1
    assert cache.arena.num_pinned == 3
    with pytest.raises(ArenaFull):  # only pinned entries left: no room, nothing evicted
        cache.store(key(6), pixels(6), GRID)
    again = cache.lookup(key(1))
    assert again is not None and again.pointer == pinned.pointer
    assert cache.lookup(key(2)) is None and cache.lookup(key(3)) is None
    for entry in (pinned, again, *held):
        cache.arena.release(entry.pointer)
    assert cache.arena.num_pinned == 0 and cache.arena.cached_bytes == 3 * ENTRY


def test_disabled_cache_keeps_nothing(make_cache):
    cache = make_cache(enabled=False)
    first = cache.store(key(1), pixels(1), GRID)
    second = cache.store(key(1), pixels(1), GRID)  # the same key: a second, anonymous entry
    assert first.pointer != second.pointer
    assert cache.lookup(key(1)) is None
    for entry in (first, second):
        cache.arena.release(entry.pointer)
    assert cache.arena.usage_bytes == 0 and cache.arena.num_entries == 0
    assert (cache.hits, cache.misses) == (0, 0)  # no lookups happen


def test_a_hit_is_checked_against_its_grid_and_token_count(make_cache):
    cache = make_cache()
    wrong_shape = cache.arena.put(key(1), pixels(1)[:8], meta=(GRID, 4))
    wrong_tokens = cache.arena.put(key(2), pixels(2), meta=(GRID, 5))
    for pointer in (wrong_shape, wrong_tokens):
        cache.arena.release(pointer)
    for n in (1, 2):
        with pytest.raises(CorruptEntry, match="do not match its grid"):
            cache.lookup(key(n))
    assert cache.arena.num_pinned == 0  # the failed hit dropped its pin
    assert cache.hits == 0


# --- the worker around it ---------------------------------------------------------


@pytest.fixture(scope="module")
def builder(qwen2_vl_tiny: Path) -> PromptBuilder:
    return PromptBuilder(qwen2_vl_tiny)


@pytest.fixture
def make_worker(
    builder: PromptBuilder, instance: str, tmp_path: Path
) -> Iterator[Callable[..., TokenizerWorker]]:
    workers: list[TokenizerWorker] = []

    def make(**config: Any) -> TokenizerWorker:
        cfg = WorkerConfig(0, str(builder.model_dir), str(tmp_path), instance, 16 * MiB, **config)
        arena = ShmArena(segment_name(instance, len(workers)), cfg.arena_bytes)
        workers.append(TokenizerWorker(cfg, builder, arena))
        return workers[-1]

    yield make
    for worker in workers:
        worker.close()


class Spy:
    """Counts calls of a function it wraps."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function, self.calls = function, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.function(*args, **kwargs)


@pytest.fixture
def spies(monkeypatch, builder: PromptBuilder) -> tuple[Spy, Spy]:
    decode, process = Spy(image_parts_module.decode_image), Spy(builder.resize_image)
    monkeypatch.setattr(image_parts_module, "decode_image", decode)
    monkeypatch.setattr(builder, "resize_image", process)
    return decode, process


URL = data_url(make_image(200, 150, seed=7), "JPEG")
OTHER = data_url(make_image(90, 120, seed=8))


def test_a_hit_skips_decode_and_processing(make_worker, spies):
    decode, process = spies
    worker = make_worker()
    first = worker.handle(request(chat(image_part(URL))))
    assert isinstance(first, EngineRequest)
    assert (decode.calls, process.calls) == (1, 1)
    # A later turn: the same image again, then a new one; only the new one is processed.
    turn = chat(image_part(URL), image_part(OTHER))
    second = worker.handle(request(turn, rid="r2"))
    assert isinstance(second, EngineRequest)
    assert (decode.calls, process.calls) == (2, 2)
    assert second.images[0].pixels == first.images[0].pixels
    assert second.images[0].length == first.images[0].length
    stats = worker.stats()
    assert (stats.processor_cache_hits, stats.processor_cache_misses) == (1, 2)
    assert stats.images_processed == 2
    for done in (first, second):
        release_all(worker, done)
    assert worker.arena.num_pinned == 0 and worker.arena.num_entries == 2  # both kept


def test_two_max_pixels_settings_are_two_entries(make_worker, spies):
    decode, _ = spies
    worker = make_worker()
    outs = []
    for rid, max_pixels in (("a", None), ("b", 28 * 28 * 4), ("c", None), ("d", 28 * 28 * 4)):
        out = worker.handle(request(chat(image_part(URL)), rid=rid, max_pixels=max_pixels))
        assert isinstance(out, EngineRequest), out
        outs.append(out)
    a, b, c, d = (out.images[0] for out in outs)
    assert a.key == c.key != b.key == d.key
    assert a.grid_thw != b.grid_thw and a.pixels == c.pixels and b.pixels == d.pixels
    assert decode.calls == 2 and worker.arena.num_entries == 2
    stats = worker.stats()
    assert (stats.processor_cache_hits, stats.processor_cache_misses) == (2, 2)
    for out in outs:
        release_all(worker, out)


def test_disabled_processes_every_image_and_frees_it_at_release(make_worker, spies):
    decode, process = spies
    worker = make_worker(enable_processor_cache=False)
    outs = [worker.handle(request(chat(image_part(URL), image_part(URL)), rid=r)) for r in "xy"]
    assert all(isinstance(out, EngineRequest) for out in outs)
    assert (decode.calls, process.calls) == (4, 4)
    refs = [image for out in outs for image in out.images]
    assert len({ref.pixels for ref in refs}) == 4  # four entries
    assert len({ref.key for ref in refs}) == 1  # one key: the scheduler's caches still use it
    assert worker.arena.num_pinned == 4
    for out in outs:
        release_all(worker, out)
    assert worker.arena.usage_bytes == 0 and worker.arena.num_entries == 0
    stats = worker.stats()
    assert (stats.processor_cache_hits, stats.processor_cache_misses) == (0, 0)
    assert stats.images_processed == 4


def test_a_corrupt_entry_is_a_500_that_leaks_no_pin(make_worker):
    worker = make_worker()
    out = worker.handle(request(chat(image_part(URL))))
    assert isinstance(out, EngineRequest)
    release_all(worker, out)
    entry = worker.arena._by_key[out.images[0].key]
    grid, num_tokens = entry.meta
    entry.meta = (grid, num_tokens + 1)  # what a 128-bit collision or a bug would look like
    bad = worker.handle(request(chat(image_part(URL)), rid="r2"))
    assert isinstance(bad, RequestError) and bad.status == 500
    assert "CorruptEntry" in bad.message
    assert worker.arena.num_pinned == 0
