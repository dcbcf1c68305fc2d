"""The processor cache: a processed image's pixels in the worker's arena, by image key
(`docs/design.md`, "Life of an image").

The arena is both the cache's storage and its bound: it holds the pixels of the images
in flight, pinned until the scheduler releases them, and in the rest the images kept for
the next request that sends the same bytes under the same settings, evicted least
recently used first (`ipc.shm_arena`).

A value is the arena entry (the resized uint8 image `[H, W, 3]`, or a video's temporal
patch `[frames, H, W, 3]`, `video_loader`), the grid and the token count, and every hit is
checked against both ("One cache entry per image"): a collision or a
bug must fail the request, never hand out another image's pixels or a wrong number of
placeholder tokens.

Disabled (`--disable-mm-processor-cache`): no lookup; every image is processed into an
anonymous entry, freed at its last release, and the counters stay at zero; the key is
still sent along, for the scheduler's caches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from ...ipc.messages import ShmPointer
from ...ipc.shm_arena import ShmArena
from ..prompt import Grid


class CachedImage(NamedTuple):
    pointer: ShmPointer  # pinned once for the caller
    grid: Grid
    num_tokens: int


class CorruptEntry(RuntimeError):
    """A hit whose entry does not match its own grid or token count (never expected)."""


class ProcessorCache:
    def __init__(
        self,
        arena: ShmArena,
        num_tokens: Callable[[Grid], int],
        pixel_shape: Callable[[Grid, int], tuple[int, ...]],
        *,
        enabled: bool = True,
    ) -> None:
        self.arena = arena
        self.enabled = enabled
        self._num_tokens = num_tokens
        self._pixel_shape = pixel_shape
        self.hits = 0
        self.misses = 0

    def lookup(self, key: bytes, frames: int = 1) -> CachedImage | None:
        """The cached image (or temporal patch of `frames` frames) for `key`, pinned for
        the caller; None on a miss (or disabled)."""
        if not self.enabled:
            return None
        hit = self.arena.get(key)
        if hit is None:
            self.misses += 1
            return None
        grid, num_tokens = hit.meta
        shape = tuple(hit.pointer.shape)
        if shape != self._pixel_shape(grid, frames) or num_tokens != self._num_tokens(grid):
            self.arena.release(hit.pointer)
            raise CorruptEntry(
                f"processor cache entry {key.hex()} holds pixels of shape {shape} and "
                f"{num_tokens} tokens, which do not match its grid {grid}"
            )
        self.hits += 1
        return CachedImage(hit.pointer, grid, num_tokens)

    def store(self, key: bytes, pixels: np.ndarray | torch.Tensor, grid: Grid) -> CachedImage:
        """Copy a resized image in, pinned once; kept under `key` when enabled. Raises
        `ipc.shm_arena.ArenaFull` when pinned entries leave no room."""
        num_tokens = self._num_tokens(grid)
        pointer = self.arena.put(key if self.enabled else None, pixels, meta=(grid, num_tokens))
        return CachedImage(pointer, grid, num_tokens)
