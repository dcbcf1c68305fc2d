"""One bounded shared-memory arena per tokenizer worker, and its readers (`docs/design.md`,
"Shared memory has an owner and a lifetime").

The segment is a plain file in /dev/shm mapped with mmap, not
`multiprocessing.shared_memory`: on Python < 3.13 every process that *attaches* a
SharedMemory registers it with its resource_tracker, which unlinks it when that process
exits — the scheduler would delete a live worker's arena. With a file the owner unlinks
at close and `shm_names` sweeps what dead processes left.

Layout: a first-fit free list with coalescing. Every block's data is aligned and
preceded by a 64-byte header (magic, generation, nbytes). Each allocation gets a fresh
generation (random start, so a restarted worker never repeats one); the owner checks pins
and releases against it, and a reader checks the header before it hands out a view, so a
pointer to a freed or reused entry fails instead of reading someone else's pixels. Keyed
entries stay after their last release, in an LRU evicted only when space is needed;
pinned entries are never evicted or overwritten.

Not thread-safe: one arena belongs to one worker thread.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import secrets
import struct
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .messages import ShmHandle, ShmPointer
from .shm_names import SHM_DIR, check_name

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        *("bool", "uint8", "int8", "int16", "int32", "int64"),
        *("float16", "bfloat16", "float32", "float64"),
    )
}

_HEADER = struct.Struct("<IIQQ")  # magic, reserved, generation, nbytes
_HEADER_BYTES = 64
_MAGIC = 0x53495249  # "IRIS"


class ArenaError(RuntimeError):
    pass


class ArenaFull(ArenaError):
    """No room even after evicting every unpinned entry: wait for pins to be released.
    `nbytes` is the size of the tensor that found no room."""

    def __init__(self, message: str, nbytes: int) -> None:
        super().__init__(message)
        self.nbytes = nbytes


class EntryTooLarge(ArenaError, ValueError):
    """The tensor is larger than the whole arena: no amount of waiting helps (400)."""


class StaleHandle(ArenaError):
    """Owner side: a pin or release of an allocation that is not live (double release)."""


class StalePointer(ArenaError):
    """Reader side: the segment is gone, or the entry was freed or reused."""


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    if dtype not in DTYPES or any(d < 0 for d in shape):
        raise ValueError(f"unsupported dtype {dtype!r} or shape {shape}")
    return int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize


def _as_bytes(array: np.ndarray | torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(torch dtype name, shape, flat uint8 view) of a numpy array or a CPU-able tensor."""
    if isinstance(array, np.ndarray):
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return str(array.dtype), array.shape, flat
    tensor = array.detach().cpu().contiguous()
    flat = tensor.reshape(-1).view(torch.uint8).numpy()
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), flat


@dataclass(slots=True, eq=False)
class _Entry:
    pointer: ShmPointer
    block: int  # start of the block (its header area, then the data)
    size: int  # header + data + padding
    pins: int
    key: bytes | None
    meta: Any


class Hit(NamedTuple):
    pointer: ShmPointer  # pinned for the caller
    meta: Any


class ShmArena:
    """The owner's side: allocate, pin/release and cache tensors in one segment."""

    def __init__(
        self,
        name: str,
        capacity_bytes: int,
        *,
        worker_id: int = 0,
        alignment: int = 64,
        shm_dir: Path = SHM_DIR,
        preallocate: bool = True,
    ) -> None:
        check_name(name)
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.name, self.worker_id, self.path = name, worker_id, shm_dir / name
        self._align = alignment
        self._header = max(_HEADER_BYTES, alignment)
        self.capacity_bytes = -(-capacity_bytes // alignment) * alignment
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the pages now: a full tmpfs fails here with ENOSPC instead of
            # killing the worker with SIGBUS on its first write past the limit.
            if preallocate:
                os.posix_fallocate(fd, 0, self.capacity_bytes)
            else:
                os.ftruncate(fd, self.capacity_bytes)
            self._mmap = mmap.mmap(fd, self.capacity_bytes)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        # Safety net for an owner that exits without unlink (not for SIGKILL: sweep).
        self._finalizer = weakref.finalize(self, _unlink_if_owner, self.path, os.getpid())
        self._free: list[tuple[int, int]] = [(0, self.capacity_bytes)]  # (start, size)
        self._entries: dict[int, _Entry] = {}  # by data offset
        self._by_key: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, _Entry] = OrderedDict()  # unpinned, oldest first
        self._next_generation = secrets.randbits(62) + 1
        self._usage = 0  # bytes of live blocks, headers and padding included
        self._num_pinned = 0

    # --- writing ---------------------------------------------------------------

    def allocate(
        self, dtype: str, shape: tuple[int, ...], *, key: bytes | None = None, meta: Any = None
    ) -> tuple[ShmPointer, torch.Tensor]:
        """Reserve room for one tensor, pinned once; returns it and a writable view, to write once,
        before sending the pointer. A keyed entry stays cached after its last release."""
        if key is not None and key in self._by_key:
            raise KeyError(f"key {key.hex()} is already in arena {self.name}")
        shape = tuple(int(d) for d in shape)
        nbytes = _nbytes(dtype, shape)
        size = self.block_bytes(nbytes)
        block = self._reserve(size, nbytes)
        generation, self._next_generation = self._next_generation, self._next_generation + 1
        offset = block + self._header
        _HEADER.pack_into(self._mmap, offset - _HEADER_BYTES, _MAGIC, 0, generation, nbytes)
        pointer = ShmPointer(self.worker_id, self.name, offset, nbytes, dtype, shape, generation)
        entry = _Entry(pointer, block, size, 1, key, meta)
        self._entries[offset] = entry
        if key is not None:
            self._by_key[key] = entry
        self._usage += size
        self._num_pinned += 1
        data = np.frombuffer(self._mmap, np.uint8, count=nbytes, offset=offset)
        return pointer, torch.from_numpy(data).view(DTYPES[dtype]).view(shape)

    def put(
        self, key: bytes | None, array: np.ndarray | torch.Tensor, *, meta: Any = None
    ) -> ShmPointer:
        """Copy `array` in, pinned once; a key already present is pinned and returned. `meta` is
        kept with a keyed entry and handed back by `get` (e.g. the processor cache's grid)."""
        if key is not None and (hit := self.get(key)) is not None:
            return hit.pointer
        dtype, shape, flat = _as_bytes(array)
        pointer, _ = self.allocate(dtype, shape, key=key, meta=meta)
        dst = np.frombuffer(self._mmap, np.uint8, count=pointer.nbytes, offset=pointer.offset)
        np.copyto(dst, flat)
        return pointer

    # --- pins and the cache ----------------------------------------------------

    def get(self, key: bytes) -> Hit | None:
        """The cached entry for `key`, pinned for the caller, or None."""
        entry = self._by_key.get(key)
        if entry is None:
            return None
        self._pin(entry)
        return Hit(entry.pointer, entry.meta)

    def pin(self, handle: ShmHandle | ShmPointer) -> None:
        self._pin(self._live(handle))

    def release(self, handle: ShmHandle | ShmPointer) -> None:
        """Drop one pin; at zero a keyed entry joins the LRU, an anonymous one is freed."""
        entry = self._live(handle)
        if entry.pins == 0:
            raise StaleHandle(f"{handle} released more often than pinned")
        entry.pins -= 1
        if entry.pins:
            return
        self._num_pinned -= 1
        if entry.key is None:
            self._free_entry(entry)
        else:
            self._lru[entry.key] = entry

    def _pin(self, entry: _Entry) -> None:
        if entry.pins == 0:
            self._num_pinned += 1
            if entry.key is not None:
                self._lru.pop(entry.key, None)
        entry.pins += 1

    def _live(self, handle: ShmHandle | ShmPointer) -> _Entry:
        entry = self._entries.get(handle.offset)
        if (
            handle.segment != self.name
            or entry is None
            or entry.pointer.generation != handle.generation
        ):
            raise StaleHandle(f"{handle} is not a live allocation of arena {self.name}")
        return entry

    def block_bytes(self, nbytes: int) -> int:
        """The room an entry of `nbytes` takes in the arena: its header and padding too."""
        return self._header + -(-nbytes // self._align) * self._align

    @property
    def usage_bytes(self) -> int:
        """Bytes held by pinned and cached entries, headers and padding included."""
        return self._usage

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def cached_bytes(self) -> int:
        """Bytes held by unpinned entries (evictable)."""
        return sum(entry.size for entry in self._lru.values())

    # --- the allocator ---------------------------------------------------------

    def _reserve(self, size: int, nbytes: int) -> int:
        if size > self.capacity_bytes:
            raise EntryTooLarge(
                f"{nbytes} bytes do not fit arena {self.name} of {self.capacity_bytes} bytes"
            )
        while (block := self._first_fit(size)) is None:
            if not self._lru:
                largest = max((s for _, s in self._free), default=0)
                raise ArenaFull(
                    f"arena {self.name} has no room for {nbytes} bytes: "
                    f"{self._usage} of {self.capacity_bytes} bytes held by "
                    f"{self._num_pinned} pinned entries, largest free block {largest} bytes",
                    nbytes,
                )
            self._free_entry(self._lru.popitem(last=False)[1])
        return block

    def _first_fit(self, size: int) -> int | None:
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                return start
        return None

    def _free_entry(self, entry: _Entry) -> None:
        del self._entries[entry.pointer.offset]
        if entry.key is not None:
            del self._by_key[entry.key]
        self._usage -= entry.size
        # Zero the header so that readers see a stale pointer even before reuse.
        _HEADER.pack_into(self._mmap, entry.pointer.offset - _HEADER_BYTES, 0, 0, 0, 0)
        start, size = entry.block, entry.size
        i = bisect.bisect(self._free, (start,))
        if i < len(self._free) and start + size == self._free[i][0]:  # merge the next
            size += self._free.pop(i)[1]
        if i > 0:
            prev_start, prev_size = self._free[i - 1]
            if prev_start + prev_size == start:  # merge into the previous
                start, size, i = prev_start, prev_size + size, i - 1
                del self._free[i]
        self._free.insert(i, (start, size))

    # --- lifetime --------------------------------------------------------------

    def close(self) -> None:
        """Unmap (deferred while views handed out by `allocate` are alive)."""
        _close_mmap(self._mmap)

    def unlink(self) -> None:
        """Remove the segment's name; readers' existing mappings stay valid."""
        self._finalizer.detach()
        _unlink_if_owner(self.path, os.getpid())

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.unlink()


def _unlink_if_owner(path: Path, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # not from a forked child that inherited the finalizer
        path.unlink(missing_ok=True)


def _close_mmap(mapping: mmap.mmap) -> None:
    # With views alive close() fails; the mapping then goes with the last of them.
    with contextlib.suppress(BufferError):
        mapping.close()


# Called with a newly mapped segment's address and length; returns the call that undoes
# what it did, run before the mapping is closed (`ShmReader(on_map=...)`).
MappingHook = Callable[[int, int], Callable[[], None]]


def _release(mapping: _Mapping) -> None:
    if mapping.undo is not None:
        mapping.undo()
    _close_mmap(mapping.mmap)


class _Mapping(NamedTuple):
    mmap: mmap.mmap
    inode: int
    undo: Callable[[], None] | None = None


class ShmReader:
    """The scheduler's side: attach workers' segments read-only and view tensors.

    `view` is zero-copy over read-only memory (writing to it kills the process with
    SIGSEGV; `clone()` first), valid while the entry is pinned: copy it, or finish using it,
    before sending the `ReleaseImages` for it. `on_map` sees every segment once, as it is
    mapped (on CUDA the scheduler registers it as pinned host memory, `pinned_host.py`)."""

    def __init__(self, shm_dir: Path = SHM_DIR, on_map: MappingHook | None = None) -> None:
        self.shm_dir = shm_dir
        self.on_map = on_map
        self._mappings: dict[str, _Mapping] = {}

    def view(self, pointer: ShmPointer) -> torch.Tensor:
        mapping = self._attach(pointer.segment)
        if not self._is_current(mapping, pointer):
            # A restarted worker makes a new file under the same name: map it again.
            mapping = self._attach(pointer.segment, refresh=True)
            if not self._is_current(mapping, pointer):
                raise StalePointer(f"{pointer} was freed or reused")
        data = np.frombuffer(mapping.mmap, np.uint8, count=pointer.nbytes, offset=pointer.offset)
        with warnings.catch_warnings():  # torch warns (once) about read-only memory
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            tensor = torch.from_numpy(data)
        return tensor.view(DTYPES[pointer.dtype]).view(pointer.shape)

    def is_current(self, pointer: ShmPointer) -> bool:
        """Whether `pointer`'s entry is still live (e.g. to check after a copy)."""
        try:
            return self._is_current(self._attach(pointer.segment), pointer)
        except StalePointer:
            return False

    def _is_current(self, mapping: _Mapping, pointer: ShmPointer) -> bool:
        if pointer.nbytes != _nbytes(pointer.dtype, pointer.shape):
            raise ValueError(f"{pointer}: nbytes does not match dtype and shape")
        header = pointer.offset - _HEADER_BYTES
        if header < 0 or pointer.offset + pointer.nbytes > len(mapping.mmap):
            return False
        magic, _, generation, nbytes = _HEADER.unpack_from(mapping.mmap, header)
        return (magic, generation, nbytes) == (_MAGIC, pointer.generation, pointer.nbytes)

    def _attach(self, segment: str, refresh: bool = False) -> _Mapping:
        mapping = self._mappings.get(segment)
        if mapping is not None and not refresh:
            return mapping
        check_name(segment)
        try:
            fd = os.open(self.shm_dir / segment, os.O_RDONLY)
        except FileNotFoundError:
            raise StalePointer(f"segment {segment} is gone") from None
        try:
            stat = os.fstat(fd)
            if mapping is not None and mapping.inode == stat.st_ino:
                return mapping
            mapped = mmap.mmap(fd, stat.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        undo = None
        if self.on_map is not None:
            undo = self.on_map(np.frombuffer(mapped, np.uint8).ctypes.data, len(mapped))
        if mapping is not None:
            _release(mapping)
        new = _Mapping(mapped, stat.st_ino, undo)
        self._mappings[segment] = new
        return new

    def detach(self, segment: str) -> None:
        """Forget a segment (e.g. its worker exited) so its memory can be returned."""
        mapping = self._mappings.pop(segment, None)
        if mapping is not None:
            _release(mapping)

    def close(self) -> None:
        for segment in list(self._mappings):
            self.detach(segment)

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
