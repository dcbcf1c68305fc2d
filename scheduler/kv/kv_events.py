"""KV events: what the prefix cache holds, told to a cluster router (vLLM's event format).

Routers that send a request to the engine already holding its prefix (NVIDIA Dynamo's
KV router, llm-d's precise prefix-cache scorer) follow each engine's KV events: a
`BlockStored` for every full page cached, a `BlockRemoved` for every eviction, an
`AllBlocksCleared` when the cache starts empty. The prefix cache is their one source:
it announces a request's pages as it registers them or finds them cached
(`PrefixCache.register`), and the page pool's evictions remove them (`wiring.py`).
`publisher.py` sends the batches.

**The host tier** is a medium of its own (`medium` "CPU", vLLM's name for its CPU
offload tier, which Dynamo's router weighs apart from the device's): an evicted page the
host tier takes is removed from the device and stored on the host under the same block
ids, and removed from the host when the tier drops it. A page reloaded from the host is
announced on the device again and stays on the host.

**Block ids.** A router links blocks by opaque 63-bit ids (parents, removals) and matches
by a hash it computes itself over each block's tokens and the ids of the images in it.
Iris keys a page by content; a router keys an image by its own id (`ImageRef.routing_hash`:
Dynamo's frontend hashes the image's URL string), so one cached page reached through two
URLs is two blocks to the router. A block's id is therefore a chain like the page keys:

    id(page i) = xxh3_64(id(page i-1) ‖ key(page i) ‖ routing hash of each image in it)

and every id announced for a page key goes when that page is evicted. A request whose
page is cached under another routing hash announces it again under its own (an alias).

**Images in a block** ride twice. In vLLM's `extra_keys`: per block, for each image
overlapping it, `(identifier, where its tokens start in the block)`, the identifier 64
hex digits: the image's 64-bit routing hash, then Iris's 128-bit content key, then
zeros. In Dynamo's `block_mm_infos`, a field after vLLM's that vLLM's decoders skip: the
routing hash and the block-relative span of the image's tokens, from which Dynamo's relay
turns the placeholders into its pad values before hashing the block, exactly as its
frontend hashes a request (Dynamo 1.6.1 reads no image from `extra_keys`). Without a
routing hash, the first 8 bytes of the content key stand in for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from ...ipc.messages import ImageRef
from ..step.request import Request

BLOCK_ID_MASK = (1 << 63) - 1  # routers take signed 64-bit ids
HOST_MEDIUM = "CPU"  # vLLM's medium of its CPU offload tier


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's event base (`vllm.distributed.kv_events`): tagged by class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # None: the device's KV cache
    lora_name: str | None = None
    extra_keys: list[list[tuple[str, int]] | None] | None = None
    # Dynamo's extension (after vLLM's fields, which vLLM's decoders read alone): per
    # block, {"mm_objects": [{"mm_hash": routing hash, "offsets": [[start, end]]}]}
    block_mm_infos: list[dict[str, Any] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events, as vLLM sends them: `[ts, [events], data_parallel_rank]`."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def routing_hash(image: ImageRef) -> int:
    """The 64-bit id a router knows the image by (see the module)."""
    if image.routing_hash is not None:
        return image.routing_hash
    return int.from_bytes(image.key[:8], "big")


def image_identifier(image: ImageRef) -> str:
    """The image's `extra_keys` identifier: routing hash, content key, zeros (64 hex)."""
    return f"{routing_hash(image):016x}{image.key.hex()}{0:016x}"


@dataclass(frozen=True)
class _Block:
    """One announced block, as its `BlockStored` said it (to say it again on the host)."""

    id: int
    parent: int | None
    token_ids: list[int]
    extra_keys: list[tuple[str, int]] | None
    mm_info: dict[str, Any] | None


class KvEventLog:
    """The events since the last `take`, and which block ids stand for which page key, on
    the device and on the host tier."""

    def __init__(self, page_size: int, host_tier: bool = False) -> None:
        self.page_size = page_size
        self.host_tier = host_tier  # blocks keep what their host announcement needs
        self._blocks_by_key: dict[bytes, list[_Block]] = {}
        self._announced: set[int] = set()
        self._host_by_key: dict[bytes, list[_Block]] = {}
        self._events: list[KvEvent] = [AllBlocksCleared()]  # whatever a router knew is gone

    @property
    def num_blocks(self) -> int:
        """Block ids announced on the device and not removed (a page may stand for several)."""
        return len(self._announced)

    @property
    def num_host_blocks(self) -> int:
        """Block ids announced on the host tier and not removed."""
        return sum(len(blocks) for blocks in self._host_by_key.values())

    def announce(self, request: Request) -> None:
        """The request's first `page_table.num_registered_pages` pages are cached (its own
        or found): announces those whose id under this request's images is not yet."""
        table = request.page_table
        count = table.num_registered_pages
        first = table.num_announced_pages
        if count <= first:
            return
        ids = self._block_ids(request, count)
        run_start: int | None = None
        for index in range(first, count + 1):
            new = index < count and ids[index] not in self._announced
            if new and run_start is None:
                run_start = index
            elif not new and run_start is not None:
                self._store(request, ids, run_start, index)
                run_start = None
        table.mark_announced(count)

    def removed(self, key: bytes, to_host: bool = False) -> None:
        """The page cached under `key` was evicted from the device: every id announced for
        it goes; `to_host`: the host tier holds the page now, so its ids are stored there
        (those not yet)."""
        blocks = self._blocks_by_key.pop(key, None)
        if not blocks:
            return
        self._announced.difference_update(block.id for block in blocks)
        self._events.append(BlockRemoved([block.id for block in blocks]))
        if not to_host:
            return
        on_host = self._host_by_key.setdefault(key, [])
        known = {block.id for block in on_host}
        for block in blocks:
            if block.id in known:
                continue
            on_host.append(block)
            self._events.append(
                BlockStored(
                    block_hashes=[block.id],
                    parent_block_hash=block.parent,
                    token_ids=block.token_ids,
                    block_size=self.page_size,
                    medium=HOST_MEDIUM,
                    extra_keys=None if block.extra_keys is None else [block.extra_keys],
                    block_mm_infos=None if block.mm_info is None else [block.mm_info],
                )
            )

    def host_dropped(self, key: bytes) -> None:
        """The host tier dropped the page `key`: every id stored there for it goes."""
        blocks = self._host_by_key.pop(key, None)
        if blocks:
            self._events.append(BlockRemoved([block.id for block in blocks], HOST_MEDIUM))

    def take(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def _block_ids(self, request: Request, count: int) -> Sequence[int]:
        """The request's first `count` block ids, extending the chain its table keeps."""
        table = request.page_table
        ids, keys, size = table.event_ids, table.keys, self.page_size
        while len(ids) < count:
            index = len(ids)
            hasher = xxhash.xxh3_64()
            hasher.update((ids[-1] if ids else 0).to_bytes(8, "little"))
            hasher.update(keys[index])
            for image in self._images(request, index * size, (index + 1) * size):
                hasher.update(routing_hash(image).to_bytes(8, "little"))
            table.add_event_id(hasher.intdigest() & BLOCK_ID_MASK)
        return ids

    def _store(self, request: Request, ids: Sequence[int], start: int, end: int) -> None:
        """One `BlockStored` for the request's pages `start..end`, all new."""
        size = self.page_size
        extra: list[list[tuple[str, int]] | None] = []
        mm_infos: list[dict[str, Any] | None] = []
        for index in range(start, end):
            low = index * size
            spans = [
                (image, max(image.offset - low, 0), min(image.end - low, size))
                for image in self._images(request, low, low + size)
            ]
            extra.append([(image_identifier(image), first) for image, first, _ in spans] or None)
            objects = [
                {"mm_hash": routing_hash(image), "offsets": [[first, last]]}
                for image, first, last in spans
            ]
            mm_infos.append({"mm_objects": objects} if objects else None)
        keys = request.page_table.keys
        tokens = request.token_ids(start * size, end * size)
        for offset, index in enumerate(range(start, end)):
            self._announced.add(ids[index])
            if self.host_tier:
                parent = ids[index - 1] if index else None
                page = tokens[offset * size : (offset + 1) * size]
                block = _Block(ids[index], parent, page, extra[offset], mm_infos[offset])
            else:
                block = _Block(ids[index], None, [], None, None)
            self._blocks_by_key.setdefault(keys[index], []).append(block)
        self._events.append(
            BlockStored(
                block_hashes=list(ids[start:end]),
                parent_block_hash=ids[start - 1] if start else None,
                token_ids=tokens,
                block_size=size,
                extra_keys=extra if any(item is not None for item in extra) else None,
                block_mm_infos=mm_infos if any(item is not None for item in mm_infos) else None,
            )
        )

    @staticmethod
    def _images(request: Request, start: int, end: int) -> list[ImageRef]:
        if start >= request.prompt_len:
            return []
        return [image for image in request.images if image.overlaps(start, end)]
