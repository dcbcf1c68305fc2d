"""Which tokenizer worker gets a request (`docs/design.md`, "Life of a request", routing).

Each worker has its own processor cache, which the server cannot see; it knows where it
sent every image. `ImageRouter` keeps a bounded table, image URL hash → the worker it
last went to, and sends a request to the worker most of its known images went to. That
covers a multi-turn chat (every earlier image re-sent, all pointing at one worker) and an
agent's sliding window of screenshots (the first image changes at every step, the other
nine point at the last step's worker). A wrong guess costs one preprocessing, never a
wrong answer.

No image known: the worker the first image's hash picks (even spread, the same after a
restart). Text only: the fewest requests in flight (ties round-robin). Affinity yields
when the preferred worker has more than `IMBALANCE_MIN_GAP` requests in flight above the
least loaded one and more than `IMBALANCE_RATIO` times as many (SGLang's cache-aware
router's rule).

Only the worker that bound a uuid (sent with its data) can serve a part that sends the
uuid alone (`tokenizer_worker.image_uuids`), so a second table keeps uuid → that worker,
and a request with a known uuid-only part goes there whatever the load (several: the
worker most of them name; the others get a 400 asking for their data). An unknown one
goes where its hash points, which answers the 400.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import xxhash

from ..common.content_parts import (
    media_part_type,
    part_data,
    part_modality,
    part_url,
    part_uuid,
)

AFFINITY_EDGE_CHARS = 4096  # a long URL (data:) is hashed on its two ends and its length
DEFAULT_CAPACITY = 1 << 16  # image URLs remembered (about 100 bytes each)
IMBALANCE_MIN_GAP = 32  # requests in flight
IMBALANCE_RATIO = 2.0


class ImageRouter:
    """Picks a worker per request and remembers where each image went (`pick`)."""

    def __init__(
        self,
        num_workers: int,
        capacity: int = DEFAULT_CAPACITY,
        uuid_capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        """`uuid_capacity`: uuids remembered, at least as many as all workers keep
        (`--max-image-uuids` × workers), or a forgotten one is sent to a wrong worker."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self.capacity = capacity
        self.uuid_capacity = uuid_capacity
        self._sent_to: OrderedDict[int, int] = OrderedDict()  # image hash → worker, LRU
        self._uuid_home: OrderedDict[str, int] = OrderedDict()  # uuid → worker bound, LRU
        self._turn = itertools.cycle(range(num_workers))

    def pick(self, messages: list[dict[str, Any]] | None, load: Sequence[int]) -> int:
        """The worker for a request with these chat messages (None: a plain prompt), given
        each worker's requests in flight; records the request's images as sent there."""
        parts = image_parts(messages or [])
        if not parts:
            return self._least_loaded(load)
        worker = self._uuid_home_of(parts)
        if worker is None:
            keys = [
                affinity_hash(url if url is not None else f"uuid:{uuid}") for url, uuid in parts
            ]
            worker = self._preferred(keys)
            least = min(load)
            if load[worker] - least > IMBALANCE_MIN_GAP and load[worker] > IMBALANCE_RATIO * least:
                worker = self._least_loaded(load)
        for url, uuid in parts:
            if url is not None:
                _remember(self._sent_to, affinity_hash(url), worker, self.capacity)
                if uuid is not None:  # the worker binds the uuid to this image
                    _remember(self._uuid_home, uuid, worker, self.uuid_capacity)
            elif uuid is not None and self._uuid_home.get(uuid) == worker:
                self._uuid_home.move_to_end(uuid)
        return worker

    def _uuid_home_of(self, parts: list[tuple[str | None, str | None]]) -> int | None:
        """The worker that holds most of the request's uuid-only parts' uuids (ties: the
        earliest part's), or None when none is known."""
        bound_here = {uuid for url, uuid in parts if url is not None}
        votes: dict[int, int] = {}
        for url, uuid in parts:
            if url is None and uuid is not None and uuid not in bound_here:
                home = self._uuid_home.get(uuid)
                if home is not None and home < self.num_workers:
                    votes[home] = votes.get(home, 0) + 1
        return max(votes, key=lambda w: votes[w]) if votes else None

    def _preferred(self, keys: list[int]) -> int:
        """The worker most of the known images went to; ties go to the one of the
        earliest such image; no image known: the first image's hash."""
        votes = [0] * self.num_workers
        first_seen: dict[int, int] = {}
        for position, key in enumerate(keys):
            worker = self._sent_to.get(key)
            if worker is not None and worker < self.num_workers:
                votes[worker] += 1
                first_seen.setdefault(worker, position)
        if not first_seen:
            return keys[0] % self.num_workers
        return max(first_seen, key=lambda w: (votes[w], -first_seen[w]))

    def _least_loaded(self, load: Sequence[int]) -> int:
        least = min(load)
        return next(i for i in self._turn if load[i] == least)


def _remember(table: OrderedDict, key: Any, worker: int, capacity: int) -> None:
    table[key] = worker
    table.move_to_end(key)
    while len(table) > capacity:
        table.popitem(last=False)


def _image_part_dicts(messages: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The media parts of chat messages (`PartType.is_media`), in order (a video is
    routed as an image is); malformed messages are skipped here (the worker rejects them)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            yield from (part for part in content if media_part_type(part) is not None)


def image_parts(messages: list[dict[str, Any]]) -> list[tuple[str | None, str | None]]:
    """(data, uuid) of each image part that has either, in order, read as the worker reads
    them (`common.content_parts`): the data is the URL, or the base64 text of an image_embeds
    part."""
    parts = []
    for part in _image_part_dicts(messages):
        url, uuid = part_data(part), part_uuid(part)
        url = url if isinstance(url, str) and url else None
        uuid = uuid if isinstance(uuid, str) and uuid else None
        if url is not None or uuid is not None:
            parts.append((url, uuid))
    return parts


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The URLs of the image parts of chat messages, in order, read as the worker reads
    them (`common.content_parts.part_url`)."""
    parts = _image_part_dicts(messages)
    urls = (part_url(part) for part in parts if part_modality(part) == "image")
    return [url for url in urls if isinstance(url, str) and url]


def affinity_hash(url: str) -> int:
    """A 64-bit hash of an image URL that costs microseconds on the event loop: a long URL
    (data:) is hashed on its first and last `AFFINITY_EDGE_CHARS` characters and its length.
    Two images that differ only in the middle share an entry: a cache miss at worst."""
    hasher = xxhash.xxh3_64()
    if len(url) <= 2 * AFFINITY_EDGE_CHARS:
        hasher.update(url.encode("utf-8", "surrogatepass"))
    else:
        hasher.update(url[:AFFINITY_EDGE_CHARS].encode("utf-8", "surrogatepass"))
        hasher.update(url[-AFFINITY_EDGE_CHARS:].encode("utf-8", "surrogatepass"))
        hasher.update(len(url).to_bytes(8, "little"))
    return hasher.intdigest()
