"""The manager half of the image encoder (`docs/design.md`, "The engine's step" and
"Lazy and chunk-aware"): it decides what is encoded and when; an `EncoderExecutor`
(encoder_executor.py) runs the vision tower.

It owns the embedding-cache holds (through `EmbeddingCache`) and the embeddings a request
keeps for its later chunks: `release(request)` lets go of both, `preempt(request)` only of
the embeddings in hand (the holds stay, so nothing is re-encoded). Once a request holds an
image's entry its pixels are dropped (`PixelStore.drop`); an image it never needs (prefix
cache) or whose key hit an entry of another token count keeps them until it ends.

`encode(chunks)` returns, per chunk, the images it overlaps with their embeddings (with
chunked encoding the overlapping images, otherwise every image from the chunk on). A
cached image, or one another request is encoding this step, costs a hold; the rest go
through the vision tower in calls of at most `max_num_encoder_tokens` image tokens (a
larger image goes alone).

A pruned video patch (`ImageRef.kept`, `--video-pruning-rate`) is encoded whole, as the
vision tower needs its whole grid, and only its kept rows (every DeepStack level with
them) are cached and delivered: its entry has `length` rows like any other. The encoder
budget counts the rows the tower computes, so pruning never makes a call larger than
the start-up profile measured.

An image that came without pixels is served only from the cache: `hold_cached` holds its
entry at admission, so no eviction takes it before the prefill reads it.
`embedding_hits` remembers what each image's first lookup found, for the client's report.

With the `thread` placement, `collect()` takes the calls the executor finished and
`prefetch(...)` starts the next; the planner schedules a chunk only up to `ready_until`.
The encoder works ahead by at most the encoder budget (image tokens encoding or held and
not yet consumed; at least one image when none is encoding), and a call takes at most the
executor's `call_tokens`.

Without a shared cache (`enable_mm_embedding_cache=False`) entries are keyed by (request
id, image key) in a cache of capacity 0, so an embedding lives as long as its request;
"request" granularity re-keys images earlier (`request_scoped_keys`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import xxhash

from ...ipc.messages import ImageRef
from ..step.batch_planner import ScheduledChunk
from ..step.request import Request, RequestResources, RequestStatus
from .embedding_cache import CacheKey, EmbeddingCache, Lookup
from .executor import EncoderExecutor
from .pixels import PixelStore

if TYPE_CHECKING:
    from ..config import EngineConfig

# Per chunk of a step, the images it overlaps and each one's whole embedding.
ChunkImages = list[tuple[ImageRef, torch.Tensor]]


@dataclass
class _Job:
    """One image to run through the vision tower and the (request, index) pairs it serves."""

    key: CacheKey | None  # None: uncacheable, for its one waiter alone
    image: ImageRef
    source: tuple[str, int]  # (request id, image index) whose pixels are encoded
    waiters: list[tuple[Request, int]] = field(default_factory=list)


@dataclass
class _Call:
    """A batch of jobs in the executor; `future` holds their embeddings."""

    jobs: list[_Job]
    future: Future


class EncoderManager(RequestResources):
    def __init__(
        self,
        config: EngineConfig,
        cache: EmbeddingCache,
        pixels: PixelStore,
        executor: EncoderExecutor,
        merge_size: int,
    ) -> None:
        """Reads the encoder budget (`max_num_encoder_tokens`), `chunked_mm_encoding` and
        whether the embedding cache is shared across requests from `config`; `merge_size`:
        the vision tower's spatial merge, for the rows it computes of a pruned patch."""
        self.cache = cache
        self.merge_size = merge_size
        self.pixels = pixels
        self.executor = executor
        self.max_num_encoder_tokens = config.max_num_encoder_tokens
        self.chunked = config.chunked_mm_encoding
        self.shared = config.enable_mm_embedding_cache  # False: entries are per request
        self._ahead = executor.placement == "thread"  # encodes ahead of the steps
        self._call_tokens = min(
            self.max_num_encoder_tokens, executor.call_tokens or self.max_num_encoder_tokens
        )
        self.images_encoded = 0  # images run through the vision tower
        # request id -> image index -> embedding the request still needs for a later chunk
        self._in_hand: dict[str, dict[int, torch.Tensor]] = {}
        # request id -> image index -> what the request's first lookup of it found
        self._first_lookup: dict[str, dict[int, Lookup]] = {}
        self._calls: deque[_Call] = deque()  # in the executor, in submission order
        self._encoding: dict[CacheKey, _Job] = {}  # the cacheable jobs of those calls
        self._awaited: set[tuple[str, int]] = set()  # (request id, index) a call will serve

    # -- admission ------------------------------------------------------------------------

    def cache_key(self, request: Request, index: int) -> CacheKey:
        key = request.images[index].key
        return key if self.shared else (request.request_id, key)

    def hold_cached(self, request: Request, index: int) -> bool:
        """Holds the cached embedding of an image that came without pixels, for the
        request's lifetime; False (nothing held for it) when the cache has none."""
        key = self.cache_key(request, index)
        if self.cache.get(key) is None:
            return False
        found = self._lookup(request, index, key)
        return found is Lookup.HIT

    def hold_given(self, request: Request, index: int, embedding: torch.Tensor) -> None:
        """Takes a client's embedding of an image (`image_embeds`; on the device, in the model's
        dtype, its own storage) into the cache unless cached already, held for the request's
        lifetime. ValueError (nothing held) if the key's entry has another token count."""
        key = self.cache_key(request, index)
        if self._lookup(request, index, key) is Lookup.UNCACHEABLE:  # a key collision
            raise ValueError(f"image {index + 1}: its embedding cache entry has another size")
        if self.cache.get(key) is None:
            self.cache.put(key, embedding)

    def embedding_hits(self, request_id: str) -> set[int]:
        """The request's images that its first lookup found in the cache (or being
        encoded for another request of the same step): no vision-tower work of its own."""
        found = self._first_lookup.get(request_id, {})
        return {index for index, lookup in found.items() if lookup is Lookup.HIT}

    # -- each step ------------------------------------------------------------------------

    def encode(self, chunks: list[ScheduledChunk]) -> list[ChunkImages]:
        """Gets the embeddings the step's chunks need (see above); per chunk, the images it
        overlaps with their embeddings."""
        jobs: dict[CacheKey, _Job] = {}
        private: list[_Job] = []
        for chunk in chunks:
            request = chunk.request
            in_hand = self._in_hand.get(request.request_id, {})
            for index in self._needed(chunk):
                if index in in_hand:
                    continue
                image = request.images[index]
                key = self.cache_key(request, index)
                found = self._lookup(request, index, key)
                cached = self.cache.get(key) if found is Lookup.HIT else None
                source = (request.request_id, index)
                if found is Lookup.UNCACHEABLE:
                    private.append(_Job(None, image, source, [(request, index)]))
                elif cached is None:  # a miss, or a hit on an encode pending this step
                    job = jobs.setdefault(key, _Job(key, image, source))
                    job.waiters.append((request, index))
                else:
                    self._deliver(request, index, key, cached)
        for batch in _batches(
            [*jobs.values(), *private], self.max_num_encoder_tokens, self.tower_tokens
        ):
            self._store(batch, self._submit_batch(batch).result())
        return [self._take(chunk) for chunk in chunks]

    @property
    def encoding(self) -> bool:
        """Calls are running or queued in the executor (`thread` placement)."""
        return bool(self._calls)

    def ready_until(self, request: Request, start: int) -> int:
        """How far the request's prefill may run from token `start` now: to the first image
        it overlaps from there whose embedding it does not hold (inline: anywhere)."""
        if not self._ahead or start >= request.prompt_len:
            return request.num_tokens
        in_hand = self._in_hand.get(request.request_id, {})
        for index, image in enumerate(request.images):
            if image.end > start and index not in in_hand:
                return image.offset
        return request.num_tokens

    def prefetch(self, wanted: Iterable[tuple[Request, int]]) -> None:
        """Starts encoding, within the encoder budget (`thread` placement; inline,
        nothing), the images from each (request, first uncomputed token) on, in priority
        order. A cached image costs a hold, one already encoding a place among its waiters."""
        if not self._ahead:
            return
        ahead = self.tokens_ahead()
        jobs: dict[CacheKey, _Job] = {}
        private: list[_Job] = []
        for request, start in wanted:
            request_id = request.request_id
            in_hand = self._in_hand.get(request_id, {})
            for index, image in enumerate(request.images):
                if image.end <= start or index in in_hand or (request_id, index) in self._awaited:
                    continue
                if ahead >= self.max_num_encoder_tokens and (self._calls or jobs or private):
                    self._submit([*jobs.values(), *private])
                    return
                ahead += self.tower_tokens(image)
                key = self.cache_key(request, index)
                found = self._lookup(request, index, key)
                cached = self.cache.get(key) if found is Lookup.HIT else None
                if cached is not None:
                    self._deliver(request, index, key, cached)
                    continue
                self._awaited.add((request_id, index))
                source = (request_id, index)
                if found is Lookup.UNCACHEABLE:
                    private.append(_Job(None, image, source, [(request, index)]))
                elif key in self._encoding:
                    self._encoding[key].waiters.append((request, index))
                else:
                    job = jobs.setdefault(key, _Job(key, image, source))
                    job.waiters.append((request, index))
        self._submit([*jobs.values(), *private])

    def collect(self) -> list[tuple[Request, BaseException]]:
        """Takes the calls the executor has finished: their embeddings go into the cache
        and to the requests still waiting for them. Returns the waiting requests of a call
        that raised, each with its error (the engine fails them)."""
        failed: list[tuple[Request, BaseException]] = []
        while self._calls and self._calls[0].future.done():
            call = self._calls.popleft()
            for job in call.jobs:
                if job.key is not None:
                    self._encoding.pop(job.key, None)
                for request, index in job.waiters:
                    self._awaited.discard((request.request_id, index))
            error = call.future.exception()
            if error is None:
                self._store(call.jobs, call.future.result())
                continue
            waiting = {
                request.request_id: request
                for job in call.jobs
                for request, _ in job.waiters
                if request.status is not RequestStatus.FINISHED
            }
            failed.extend((request, error) for request in waiting.values())
        return failed

    def wait(self, timeout: float) -> None:
        """Returns once the oldest call is done, or after `timeout` seconds."""
        if self._calls:
            wait([self._calls[0].future], timeout, return_when=FIRST_COMPLETED)

    def tokens_ahead(self) -> int:
        """Image tokens held by requests for later chunks, or encoding for them."""
        held = sum(part.shape[0] for hand in self._in_hand.values() for part in hand.values())
        encoding = sum(self.tower_tokens(job.image) for call in self._calls for job in call.jobs)
        return held + encoding

    def tower_tokens(self, image: ImageRef) -> int:
        """Rows the vision tower computes for `image`: its whole grid's, pruned or not."""
        if image.kept is None:
            return image.length
        t, h, w = image.grid_thw
        return t * h * w // self.merge_size**2

    # -- lifetimes ------------------------------------------------------------------------

    def preempt(self, request: Request) -> None:
        """A preempted request lets go of the embeddings in hand; its cache holds stay, so
        its recompute gets them back without the vision tower (or the pixels)."""
        self._in_hand.pop(request.request_id, None)

    def release(self, request: Request) -> None:
        """An ended request lets go of its embeddings in hand and its cache holds."""
        self._in_hand.pop(request.request_id, None)
        self._first_lookup.pop(request.request_id, None)
        self.cache.release(request.request_id)

    # -- internals ------------------------------------------------------------------------

    def _submit(self, jobs: list[_Job]) -> None:
        """Queues `jobs` in the executor, in calls of at most `_call_tokens` image tokens."""
        for batch in _batches(jobs, self._call_tokens, self.tower_tokens):
            self._calls.append(_Call(batch, self._submit_batch(batch)))
            self._encoding.update((job.key, job) for job in batch if job.key is not None)

    def _submit_batch(self, batch: list[_Job]) -> Future:
        pixels = [self.pixels.get(*job.source) for job in batch]
        return self.executor.submit(pixels, [job.image.grid_thw for job in batch])

    def _lookup(self, request: Request, index: int, key: CacheKey) -> Lookup:
        """`EmbeddingCache.lookup` (holds the entry), remembering the request's first."""
        found = self.cache.lookup(key, request.images[index].length, request.request_id)
        self._first_lookup.setdefault(request.request_id, {}).setdefault(index, found)
        return found

    def _take(self, chunk: ScheduledChunk) -> ChunkImages:
        """The chunk's images; those that end within it are no longer kept in hand."""
        request = chunk.request
        in_hand = self._in_hand.get(request.request_id, {})
        images = [
            (image, in_hand[index])
            for index, image in enumerate(request.images)
            if image.overlaps(chunk.start, chunk.end)
        ]
        for index in list(in_hand):
            if request.images[index].end <= chunk.end:
                del in_hand[index]
        return images

    def _needed(self, chunk: ScheduledChunk) -> list[int]:
        request = chunk.request
        if chunk.start >= request.prompt_len or not request.images:
            return []
        end = chunk.end if self.chunked else request.prompt_len
        return [i for i, image in enumerate(request.images) if image.overlaps(chunk.start, end)]

    def _store(self, batch: list[_Job], embeddings: torch.Tensor) -> None:
        """A call's embeddings into the cache, and to the requests still waiting for them."""
        self.images_encoded += len(batch)
        parts = list(embeddings.split([self.tower_tokens(job.image) for job in batch]))
        for i, (job, part) in enumerate(zip(batch, parts, strict=True)):
            kept = job.image.kept
            if kept is not None:  # a pruned patch: its kept rows, in storage of their own
                parts[i] = part.index_select(0, torch.tensor(kept, device=part.device))
            elif len(parts) > 1:  # own storage each, so evicting one entry frees its bytes
                parts[i] = part.clone()
        for job, part in zip(batch, parts, strict=True):
            waiters = [w for w in job.waiters if w[0].status is not RequestStatus.FINISHED]
            if job.key is None:
                for request, index in waiters:  # one: the image is encoded for it alone
                    self._in_hand.setdefault(request.request_id, {})[index] = part  # keeps pixels
                continue
            if job.key in self.cache and self.cache.get(job.key) is None:  # still pending
                self.cache.put(job.key, part)
            for request, index in waiters:
                self._deliver(request, index, job.key, part)

    def _deliver(self, request: Request, index: int, key: CacheKey, part: torch.Tensor) -> None:
        """Hands a held entry to the request and lets go of the pixels it covers."""
        request_id = request.request_id
        self._in_hand.setdefault(request_id, {})[index] = part
        length = request.images[index].length
        for i, image in enumerate(request.images):
            if not self.pixels.has(request_id, i) or image.length != length:
                continue
            if i == index or self.cache_key(request, i) == key:
                self.pixels.drop(request_id, i)  # never read again: the shm pin goes now


def _batches(
    jobs: list[_Job], budget: int, cost: Callable[[ImageRef], int]
) -> Iterator[list[_Job]]:
    """Consecutive groups of at most `budget` tower tokens (`cost` of each image); a larger
    image goes alone."""
    batch: list[_Job] = []
    tokens = 0
    for job in jobs:
        if batch and tokens + cost(job.image) > budget:
            yield batch
            batch, tokens = [], 0
        batch.append(job)
        tokens += cost(job.image)
    if batch:
        yield batch


def request_scoped_keys(keys: list[bytes]) -> list[bytes]:
    """Per-request granularity: image i's key becomes xxh3_128(all keys in order ‖ i), so
    adding an image to a conversation changes every image's key (the baseline)."""
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
