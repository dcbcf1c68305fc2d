"""The shared-memory arena: allocator, pins, LRU, staleness, cross-process use, cleanup."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from iris_serve.ipc.messages import ShmPointer
from iris_serve.ipc.shm_arena import (
    ArenaFull,
    EntryTooLarge,
    ShmArena,
    ShmReader,
    StaleHandle,
    StalePointer,
)
from iris_serve.ipc.shm_names import SHM_DIR, instance_prefix, segment_name, sweep, sweep_orphans

KiB = 1024
CHILD_TIMEOUT_S = 60


def leftovers(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


@pytest.fixture
def instance() -> Iterator[str]:
    """A unique instance id; whatever a test leaves under it is swept, even on failure."""
    instance = f"test-{uuid.uuid4().hex[:12]}"
    yield instance
    sweep(instance_prefix(instance))


@pytest.fixture
def prefix(instance: str) -> str:
    return instance_prefix(instance)


@pytest.fixture
def make_arena(prefix: str) -> Iterator[Callable[..., ShmArena]]:
    arenas: list[ShmArena] = []

    def make(capacity: int = 64 * KiB, worker_id: int = 0) -> ShmArena:
        arena = ShmArena(f"{prefix}w{worker_id}", capacity, worker_id=worker_id)
        arenas.append(arena)
        return arena

    yield make
    for arena in arenas:
        arena.close()
        arena.unlink()


@pytest.fixture
def reader() -> Iterator[ShmReader]:
    with ShmReader() as r:
        yield r


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


# --- round trips -------------------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [
        np.random.default_rng(0).standard_normal((13, 1176), dtype=np.float32),
        torch.randn(5, 7, 3).to(torch.bfloat16),
        np.arange(1000, dtype=np.uint8).reshape(10, 100),
        np.zeros((0, 4), dtype=np.float32),
        np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
    ],
    ids=["fp32", "bf16", "uint8", "empty", "fortran"],
)
def test_put_view_round_trip(make_arena, reader: ShmReader, array) -> None:
    arena = make_arena()
    pointer = arena.put(key(1), array)
    expected = (
        torch.as_tensor(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array
    )
    view = reader.view(pointer)
    assert view.dtype == expected.dtype and tuple(view.shape) == tuple(expected.shape)
    assert as_bytes(view) == as_bytes(expected)
    assert pointer.offset % 64 == 0
    hit = arena.get(key(1))
    assert hit is not None and hit.pointer == pointer
    assert arena.num_pinned == 1 and arena.num_entries == 1


def test_allocate_writes_in_place(make_arena, reader: ShmReader) -> None:
    arena = make_arena()
    pointer, dst = arena.allocate("float32", (4, 8))
    dst.copy_(torch.arange(32, dtype=torch.float32).view(4, 8))
    assert torch.equal(reader.view(pointer), torch.arange(32, dtype=torch.float32).view(4, 8))
    arena.release(pointer)
    assert arena.num_entries == 0 and arena.usage_bytes == 0  # anonymous: freed at once


def test_larger_alignment(prefix: str, reader: ShmReader) -> None:
    with ShmArena(f"{prefix}w0", 24 * KiB, alignment=4096, preallocate=False) as arena:
        pointers = [arena.put(None, np.full(n, n % 251, np.uint8)) for n in (1, 4096, 10)]
        assert all(p.offset % 4096 == 0 for p in pointers)
        for p in pointers:
            assert reader.view(p).eq(p.nbytes % 251).all()


# --- allocator, pins and LRU ---------------------------------------------------------


def test_freed_space_is_reused(make_arena) -> None:
    arena = make_arena(capacity=4 * KiB)
    first = arena.put(key(1), np.ones(3000, np.uint8))
    arena.release(first)
    second = arena.put(key(2), np.full(3500, 7, np.uint8))  # needs the evicted bytes
    assert second.offset == first.offset
    assert arena.get(key(1)) is None
    assert arena.usage_bytes <= arena.capacity_bytes


def test_adjacent_free_blocks_coalesce(make_arena) -> None:
    arena = make_arena(capacity=4 * KiB)
    a, b, c = (arena.put(None, np.zeros(1000, np.uint8)) for _ in range(3))
    arena.release(b)
    arena.release(a)
    merged = arena.put(None, np.zeros(2000, np.uint8))  # fits only in a + b together
    assert merged.offset == a.offset
    arena.release(c)
    arena.release(merged)
    assert arena.put(None, np.zeros(4 * KiB - 64, np.uint8)).offset == 64  # one block again


def test_pins_prevent_eviction_and_release_allows_it(make_arena, reader: ShmReader) -> None:
    arena = make_arena(capacity=4 * KiB)
    held = arena.put(key(1), np.full(3000, 1, np.uint8))
    with pytest.raises(ArenaFull, match="1 pinned entries"):
        arena.put(key(2), np.zeros(3000, np.uint8))
    assert bytes(reader.view(held).numpy()) == b"\x01" * 3000
    arena.pin(held)  # a second request uses it
    arena.release(held)
    with pytest.raises(ArenaFull):
        arena.put(key(2), np.zeros(3000, np.uint8))
    arena.release(held)  # now unpinned: evictable
    arena.put(key(2), np.zeros(3000, np.uint8))
    assert arena.get(key(1)) is None


def test_full_arena_keeps_pinned_entries_intact(make_arena, reader: ShmReader) -> None:
    arena = make_arena(capacity=8 * KiB)
    arrays = [np.full(1000, i, np.uint8) for i in range(7)]
    pointers = [arena.put(key(i), a) for i, a in enumerate(arrays)]
    usage = arena.usage_bytes
    with pytest.raises(ArenaFull, match="no room for 2000 bytes"):
        arena.put(key(99), np.zeros(2000, np.uint8))
    assert arena.usage_bytes == usage and arena.num_pinned == 7
    for pointer, array in zip(pointers, arrays, strict=True):
        assert np.array_equal(reader.view(pointer).numpy(), array)
    with pytest.raises(EntryTooLarge):
        arena.put(None, np.zeros(8 * KiB, np.uint8))


def test_lru_evicts_least_recently_released_first(make_arena) -> None:
    arena = make_arena(capacity=5 * (64 + 1024))
    pointers = {i: arena.put(key(i), np.zeros(1024, np.uint8)) for i in range(5)}
    for i in (2, 0, 4, 1, 3):
        arena.release(pointers[i])
    hit = arena.get(key(2))  # used again: leaves the LRU while pinned...
    assert hit is not None
    arena.release(hit.pointer)  # ...and comes back as the most recent
    arena.put(key(10), np.zeros(1024, np.uint8))  # each needs one entry's room
    arena.put(key(11), np.zeros(1024, np.uint8))
    assert [i for i in range(5) if arena.get(key(i)) is None] == [0, 4]


def test_put_of_a_present_key_pins_the_existing_entry(make_arena) -> None:
    arena = make_arena()
    first = arena.put(key(1), np.ones(10, np.float32), meta={"tokens": 4})
    assert arena.put(key(1), np.ones(10, np.float32)) == first
    hit = arena.get(key(1))
    assert hit is not None and hit.meta == {"tokens": 4}
    for _ in range(3):
        arena.release(first)
    assert arena.num_pinned == 0 and arena.get(key(1)) is not None


# --- staleness ---------------------------------------------------------------------


def test_stale_handles_and_pointers_are_refused(make_arena, reader: ShmReader) -> None:
    arena = make_arena(capacity=4 * KiB)
    old = arena.put(None, np.ones(1000, np.uint8))
    assert reader.is_current(old)
    arena.release(old)
    with pytest.raises(StaleHandle):
        arena.release(old)  # double release
    with pytest.raises(StalePointer):
        reader.view(old)  # freed
    new = arena.put(None, np.full(1000, 2, np.uint8))
    assert new.offset == old.offset and new.generation != old.generation
    with pytest.raises(StaleHandle):
        arena.pin(old)  # same place, another allocation
    with pytest.raises(StalePointer):
        reader.view(old)  # reused: never someone else's bytes
    assert not reader.is_current(old) and reader.is_current(new)
    forged = ShmPointer(0, arena.name, new.offset, 4096, "uint8", (4096,), new.generation)
    assert not reader.is_current(forged)


def test_reader_follows_a_restarted_worker(prefix: str, reader: ShmReader) -> None:
    for value in (1, 2):  # the same segment name, two incarnations
        with ShmArena(f"{prefix}w0", 4 * KiB) as arena:
            pointer = arena.put(None, np.full(100, value, np.uint8))
            assert reader.view(pointer).eq(value).all()
    with ShmReader() as fresh, pytest.raises(StalePointer, match="gone"):
        fresh.view(pointer)


def test_every_segment_is_shown_to_on_map_once_and_undone_once(prefix: str) -> None:
    """The scheduler registers each segment with CUDA as it maps it (`on_map`): once per
    mapping, over the whole segment, undone when a restarted worker's new file replaces
    it and when the reader closes."""
    mapped: list[tuple[int, int]] = []
    undone: list[int] = []

    def on_map(address: int, size: int) -> Callable[[], None]:
        mapped.append((address, size))
        return lambda: undone.append(address)

    with ShmReader(on_map=on_map) as reader:
        for value in (1, 2):  # the same segment name, two incarnations
            with ShmArena(f"{prefix}w0", 4 * KiB) as arena:
                first = reader.view(arena.put(None, np.full(100, value, np.uint8)))
                second = reader.view(arena.put(None, np.full(50, value, np.uint8)))
                assert first.eq(value).all() and second.eq(value).all()
                address, size = mapped[-1]
                assert size == arena.path.stat().st_size
                for view in (first, second):  # the views lie in the registered range
                    assert (
                        address
                        <= view.data_ptr()
                        < view.data_ptr() + view.numel()
                        <= address + size
                    )
                del first, second
        assert len(mapped) == 2 and undone == [mapped[0][0]]  # the first, on the remap
    assert undone == [address for address, _ in mapped]


# --- processes and cleanup ---------------------------------------------------------


def _child_checksum(pointer: ShmPointer, results: mp.Queue) -> None:
    with ShmReader() as r:
        results.put(hashlib.sha256(as_bytes(r.view(pointer))).hexdigest())


def _child_owner(name: str, ready: mp.Queue) -> None:
    arena = ShmArena(name, 64 * KiB)
    arena.put(key(1), np.ones(1000, np.float32))
    ready.put(arena.path.name)
    ready.get()  # parks until killed (the parent never answers)


def _spawn(target: Callable[..., None], *args: object) -> tuple[mp.Process, mp.Queue]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue), daemon=True)
    process.start()
    return process, queue


def test_another_process_reads_by_name(make_arena) -> None:
    arena = make_arena(capacity=256 * KiB)
    tensor = torch.randn(50, 1176).to(torch.bfloat16)
    pointer = arena.put(key(1), tensor)
    process, results = _spawn(_child_checksum, pointer)
    try:
        checksum = results.get(timeout=CHILD_TIMEOUT_S)
    finally:
        process.join(timeout=CHILD_TIMEOUT_S)
    assert checksum == hashlib.sha256(as_bytes(tensor)).hexdigest()
    assert process.exitcode == 0
    assert arena.path.exists()  # the reader's exit did not unlink the owner's segment


def test_close_and_unlink_leave_nothing(instance: str, prefix: str) -> None:
    with ShmArena(segment_name(instance, 3), 4 * KiB) as a:
        a.put(key(1), np.ones(10, np.uint8))
        assert leftovers(prefix) == [f"{prefix}w3"]
    assert leftovers(prefix) == []


def test_sweep_removes_a_killed_owners_segment(prefix: str) -> None:
    process, ready = _spawn(_child_owner, f"{prefix}w0")
    try:
        name = ready.get(timeout=CHILD_TIMEOUT_S)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=CHILD_TIMEOUT_S)
    assert process.exitcode == -signal.SIGKILL
    assert leftovers(prefix) == [name]
    assert sweep(prefix) == [name]
    assert leftovers(prefix) == []


def test_sweep_orphans_removes_only_dead_instances(prefix: str) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    orphan = SHM_DIR / segment_name(f"{dead.stdout.strip()}-{uuid.uuid4().hex[:8]}", 0)
    alive = SHM_DIR / segment_name(f"{os.getpid()}-{uuid.uuid4().hex[:8]}", 0)
    try:
        orphan.touch()
        alive.touch()
        assert orphan.name in sweep_orphans()
        assert not orphan.exists() and alive.exists()
    finally:
        orphan.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)


def test_sweep_refuses_a_broad_prefix() -> None:
    for bad in ("", "iris-", "/tmp", "foo-"):
        with pytest.raises(ValueError):
            sweep(bad)


def test_arena_names_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ShmArena("../etc/passwd", 4 * KiB, shm_dir=tmp_path)
