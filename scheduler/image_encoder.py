"""Lazy, chunk-aware image encoding (invariant 4) on top of the shared embedding cache.

For each step, `prepare(chunks)` makes `request.image_embeddings[i]` hold the embedding
of every image `i` a prefill chunk needs: with chunked encoding the images whose spans
overlap the chunk, otherwise every image from the chunk on (all of them in the first
chunk). An image whose entry is cached, or already being encoded for another request in
this step, costs a pin; the rest go through the vision tower in calls of at most
`max_num_encoder_tokens` image tokens (an image larger than that goes alone).

Pixels. Once a request pins an image's entry, the entry outlives any preemption of the
request (see `EmbeddingCache`), so the request drops its `pixel_values` and reports
`(request_id, image_index)` through `pop_pixels_done()`: the scheduler process releases
those shared-memory pins at once. An image a request never needs (its tokens came from
the prefix cache) keeps its pixels until the request finishes or is aborted, and so does
one whose key hit an entry of another token count (encoded for its request alone).

Baselines: `shared=False` keys entries by (request id, image key) in a cache of capacity
0, so an embedding lives exactly as long as the request that computed it; "request"
granularity is applied earlier, by re-keying images (`request_scoped_keys`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import xxhash

from iris_serve.scheduler.batch_planner import ScheduledChunk
from iris_serve.scheduler.embedding_cache import CacheKey, EmbeddingCache, Lookup
from iris_serve.scheduler.request import ImageInput, Request

MAX_TIMINGS = 4096  # encoder durations kept until drained (a histogram feed, not a log)


@dataclass
class _Job:
    """One image to run through the vision tower and the (request, index) pairs it serves."""

    key: CacheKey | None  # None: uncacheable, for its one waiter alone
    image: ImageInput
    waiters: list[tuple[Request, int]] = field(default_factory=list)


class ImageEncoder:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: EmbeddingCache,
        device: torch.device,
        dtype: torch.dtype,
        max_num_encoder_tokens: int,
        chunked: bool = True,
        shared: bool = True,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.dtype = dtype
        self.max_num_encoder_tokens = max_num_encoder_tokens
        self.chunked = chunked
        self.shared = shared  # False: entries are per request (no reuse across requests)
        self.images_encoded = 0  # images run through the vision tower
        self._timings: deque[float | tuple[torch.cuda.Event, torch.cuda.Event]] = deque(
            maxlen=MAX_TIMINGS
        )
        self._pixels_done: dict[str, list[int]] = {}

    # -- the engine's surface ---------------------------------------------------------------

    def cache_key(self, request: Request, index: int) -> CacheKey:
        key = request.images[index].key
        return key if self.shared else (request.request_id, key)

    def prepare(self, chunks: list[ScheduledChunk]) -> None:
        """Fills `request.image_embeddings` with what the step's chunks need (see above)."""
        jobs: dict[CacheKey, _Job] = {}
        private: list[_Job] = []
        for chunk in chunks:
            request = chunk.request
            for index in self._needed(chunk):
                if index in request.image_embeddings:
                    continue
                image = request.images[index]
                key = self.cache_key(request, index)
                found = self.cache.lookup(key, image.length, request.request_id)
                cached = self.cache.get(key) if found is Lookup.HIT else None
                if found is Lookup.UNCACHEABLE:
                    private.append(_Job(None, image, [(request, index)]))
                elif cached is None:  # a miss, or a hit on an encode pending this step
                    jobs.setdefault(key, _Job(key, image)).waiters.append((request, index))
                else:
                    self._deliver(request, index, key, cached)
        for batch in _batches([*jobs.values(), *private], self.max_num_encoder_tokens):
            self._encode(batch)

    def pop_pixels_done(self) -> list[tuple[str, int]]:
        done = [(rid, index) for rid, indices in self._pixels_done.items() for index in indices]
        self._pixels_done.clear()
        return done

    def forget(self, request_id: str) -> None:
        """Drops unreported pixel releases of an aborted request (its pins go anyway)."""
        self._pixels_done.pop(request_id, None)

    def drain_seconds(self) -> list[float]:
        seconds = []
        for timing in self._timings:
            if isinstance(timing, tuple):
                start, end = timing
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1000)
            else:
                seconds.append(timing)
        self._timings.clear()
        return seconds

    # -- internals --------------------------------------------------------------------------

    def _needed(self, chunk: ScheduledChunk) -> list[int]:
        request = chunk.request
        if chunk.start >= request.prompt_len or not request.images:
            return []
        end = chunk.end if self.chunked else request.prompt_len
        return [i for i, image in enumerate(request.images) if image.overlaps(chunk.start, end)]

    def _encode(self, batch: list[_Job]) -> None:
        images = [job.image for job in batch]
        pixel_values = torch.cat([_pixels(image) for image in images])
        pixel_values = pixel_values.to(self.device, self.dtype)
        grid_thw = torch.tensor([image.grid_thw for image in images], device=self.device)
        with self._timed():
            embeddings = self.model.encode_images(pixel_values, grid_thw)
        self.images_encoded += len(batch)
        parts = embeddings.split([image.length for image in images])
        if len(parts) > 1:  # own storage each, so evicting one entry frees its bytes
            parts = tuple(part.clone() for part in parts)
        for job, part in zip(batch, parts, strict=True):
            if job.key is None:
                [(request, index)] = job.waiters
                request.image_embeddings[index] = part  # keeps its pixels (may re-encode)
                continue
            self.cache.put(job.key, part)
            for request, index in job.waiters:
                self._deliver(request, index, job.key, part)

    def _deliver(self, request: Request, index: int, key: CacheKey, part: torch.Tensor) -> None:
        """Hands a pinned entry to the request and lets go of the pixels it covers."""
        request.image_embeddings[index] = part
        length = request.images[index].length
        for i, image in enumerate(request.images):
            if image.pixel_values is None or image.length != length:
                continue
            if i == index or self.cache_key(request, i) == key:
                image.pixel_values = None  # never read again: the shm pin goes now
                self._pixels_done.setdefault(request.request_id, []).append(i)

    def _timed(self) -> _Timer:
        return _Timer(self._timings, self.device)


class _Timer:
    """Times a vision-tower call: CUDA events on a GPU (read when drained), else wall time."""

    def __init__(self, sink: deque, device: torch.device) -> None:
        self.sink = sink
        self.cuda = device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.began = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.sink.append((self.start, end))
        else:
            self.sink.append(time.perf_counter() - self.began)


def _pixels(image: ImageInput) -> torch.Tensor:
    if image.pixel_values is None:
        raise RuntimeError(f"image {image.key!r} is to be encoded but its pixels were released")
    return image.pixel_values


def _batches(jobs: list[_Job], budget: int) -> Iterator[list[_Job]]:
    """Consecutive groups of at most `budget` image tokens; a larger image goes alone."""
    batch: list[_Job] = []
    tokens = 0
    for job in jobs:
        if batch and tokens + job.image.length > budget:
            yield batch
            batch, tokens = [], 0
        batch.append(job)
        tokens += job.image.length
    if batch:
        yield batch


def request_scoped_keys(keys: list[bytes]) -> list[bytes]:
    """Per-request granularity: image i's key becomes xxh3_128(all keys in order ‖ i).

    Combines the 16-byte keys (never the pixels), so adding an image to a conversation
    changes every image's key: the baseline that per-image keys improve on.
    """
    prefix = xxhash.xxh3_128()
    prefix.update(len(keys).to_bytes(8, "little"))
    for key in keys:
        prefix.update(len(key).to_bytes(8, "little"))
        prefix.update(key)
    scoped = []
    for index in range(len(keys)):
        hasher = prefix.copy()
        hasher.update(index.to_bytes(8, "little"))
        scoped.append(hasher.digest())
    return scoped
