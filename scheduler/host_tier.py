"""The host tier: where the prefix cache's evicted KV pages and the embedding cache's
evicted image embeddings go, so that an agent coming back after others pushed its
history out reloads it instead of re-prefilling and re-encoding (`--kv-offload-gib`;
`docs/design.md`, "The host tier").

The device caches stay the one authority on what is resident: the tier hears of an entry
only as the device cache evicts it (`spill_*`) and hands one back only when a device
lookup missed (`reload_*`). Nothing mirrors an LRU, so the two can never disagree about
what is where; an entry may be in both (a reload keeps the host copy, so evicting the
page again costs no copy).

Two parts, as with the KV cache:
- `HostPages`, on every rank: this rank's host blocks, one KV page each (its shard under
  tensor parallelism), and the copies between them and the device pages.
- `HostTier`, rank 0's alone: which key is in which block, one LRU over pages and
  embeddings in one byte budget (a full tier evicts its oldest entry, never refuses), and
  the counters. Rank 0 copies as it decides, during planning: a spill before the step's
  forward overwrites the page, a reload before the forward reads it. The same page copies,
  in the same order, go to the other ranks with the step (`take_copies`), which apply them
  before their forward: their pages have changed no more than rank 0's had.

On CUDA the blocks are pinned and the copies are asynchronous on the step's stream, ordered
with the forwards around them; a reload's failure surfaces here only on the CPU (where
the copy is a memcpy). On the CPU an embedding is already in host memory: its spill keeps
the tensor, its reload hands it back, with no copy.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from iris_serve.scheduler.kv_cache import KVCache, KVLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageCopy:
    """One KV page's bytes between the device and a host block: page → block when
    `to_host` (a spill), block → page otherwise (a reload)."""

    to_host: bool
    page: int
    block: int


class HostPages:
    """This rank's host blocks, `[num_blocks, layers, 2, kv_heads, page_size, head_dim]`:
    one block holds one device page's K and V for every layer."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.page_size = layout.page_size
        self.blocks = torch.empty(
            num_blocks,
            layout.num_layers,
            2,
            layout.num_kv_heads,
            layout.page_size,
            layout.head_dim,
            dtype=layout.dtype,
            pin_memory=device.type == "cuda",
        )

    def apply(self, kv: KVCache, copies: Iterable[PageCopy]) -> None:
        """Runs `copies` in order (a reload may read a block that an earlier spill wrote)."""
        for copy in copies:
            page = self._page(kv, copy.page)
            if copy.to_host:
                self.blocks[copy.block].copy_(page, non_blocking=True)
            else:
                page.copy_(self.blocks[copy.block], non_blocking=True)

    def _page(self, kv: KVCache, page: int) -> torch.Tensor:
        size = self.page_size
        return kv.slots[:, :, :, page * size : (page + 1) * size]


@dataclass
class _Page:
    block: int
    token_bytes: bytes  # checked on reload, as the device cache checks a hit


@dataclass
class _Embedding:
    tensor: torch.Tensor  # in host memory

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class HostTier:
    """Rank 0's host tier over `pages` (see the module docstring). `record_copies`: keep
    the page copies for the other tensor-parallel ranks (`take_copies`)."""

    def __init__(
        self,
        capacity_bytes: int,
        kv: KVCache,
        pages: HostPages,
        device: torch.device,
        record_copies: bool = False,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.kv = kv
        self.pages = pages
        self.device = device
        self.page_bytes = kv.layout.bytes_per_page
        self._entries: OrderedDict[Hashable, _Page | _Embedding] = OrderedDict()  # LRU first
        self._free_blocks = list(range(pages.num_blocks - 1, -1, -1))
        self._record = record_copies
        self._copies: list[PageCopy] = []
        self.usage_bytes = 0
        # counters (exported as metrics)
        self.pages_spilled = 0
        self.pages_reloaded = 0
        self.embeddings_spilled = 0
        self.embeddings_reloaded = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.copy_seconds = 0.0
        self.failed_reloads = 0

    @property
    def num_pages(self) -> int:
        return self.pages.num_blocks - len(self._free_blocks)

    @property
    def num_embeddings(self) -> int:
        return sum(isinstance(entry, _Embedding) for entry in self._entries.values())

    def stats(self) -> dict[str, Any]:
        """The tier's gauges and counters, by `EngineSnapshot`'s names."""
        return {
            "host_tier_capacity_bytes": self.capacity_bytes,
            "host_tier_usage_bytes": self.usage_bytes,
            "host_tier_pages": self.num_pages,
            "host_tier_embeddings": self.num_embeddings,
            "host_tier_bytes_to_host": self.bytes_to_host,
            "host_tier_bytes_to_device": self.bytes_to_device,
            "host_tier_copy_seconds": self.copy_seconds,
            "host_tier_page_copies": self.pages_spilled + self.pages_reloaded,
            "host_tier_failed_reloads": self.failed_reloads,
        }

    # -- KV pages -------------------------------------------------------------------------

    def has_page(self, key: bytes, token_bytes: bytes) -> bool:
        """Whether the tier holds the page `key` (with these tokens); a hit is touched, so
        a match's pages are the last to go before their reload."""
        entry = self._entries.get(("page", key))
        if not isinstance(entry, _Page) or entry.token_bytes != token_bytes:
            return False
        self._entries.move_to_end(("page", key))
        return True

    def spill_page(self, page: int, key: bytes, token_bytes: bytes) -> None:
        """The prefix cache evicts device page `page` (content `key`): its KV goes to a
        block, before anything overwrites the page. A page the tier holds already is only
        touched; one that does not fit is dropped (the tier never refuses an eviction)."""
        name = ("page", key)
        if name in self._entries:
            self._entries.move_to_end(name)
            return
        if not self._make_room(self.page_bytes):
            return
        block = self._free_blocks.pop()
        self._copy(PageCopy(True, page, block))
        self._entries[name] = _Page(block, token_bytes)
        self.usage_bytes += self.page_bytes
        self.pages_spilled += 1
        self.bytes_to_host += self.page_bytes

    def reload_page(self, key: bytes, token_bytes: bytes, page: int) -> bool:
        """Copies the tier's page `key` into device page `page`; False when it is gone or
        the copy raised (the caller recomputes instead; the entry is dropped)."""
        name = ("page", key)
        entry = self._entries.get(name)
        if not isinstance(entry, _Page) or entry.token_bytes != token_bytes:
            return False
        try:
            self._copy(PageCopy(False, page, entry.block))
        except Exception:
            logger.exception("reloading a KV page from host memory failed; recomputing it")
            self.failed_reloads += 1
            self._drop(name)
            return False
        self._entries.move_to_end(name)
        self.pages_reloaded += 1
        self.bytes_to_device += self.page_bytes
        return True

    def take_copies(self) -> list[PageCopy]:
        """The page copies made since the last call, in order, for the other ranks."""
        copies, self._copies = self._copies, []
        return copies

    # -- image embeddings -----------------------------------------------------------------

    def spill_embedding(self, key: Hashable, embedding: torch.Tensor) -> None:
        """The embedding cache evicts `key`'s embedding `[tokens, width]`: it moves to host
        memory (on the CPU, the tensor itself). One larger than the tier is dropped."""
        name = ("embedding", key)
        if name in self._entries:
            self._entries.move_to_end(name)
            return
        nbytes = embedding.numel() * embedding.element_size()
        if not self._make_room(nbytes):
            return
        started = time.perf_counter()
        if embedding.device.type != "cpu":
            host = torch.empty(embedding.shape, dtype=embedding.dtype, pin_memory=True)
            embedding = host.copy_(embedding)  # synchronous: the device tensor goes next
        self.copy_seconds += time.perf_counter() - started
        self._entries[name] = _Embedding(embedding)
        self.usage_bytes += nbytes
        self.embeddings_spilled += 1
        self.bytes_to_host += nbytes

    def reload_embedding(self, key: Hashable, num_tokens: int) -> torch.Tensor | None:
        """`key`'s embedding on the device, if the tier holds one of `num_tokens` rows (the
        entry stays, for the next eviction)."""
        name = ("embedding", key)
        entry = self._entries.get(name)
        if not isinstance(entry, _Embedding) or entry.tensor.shape[0] != num_tokens:
            return None
        started = time.perf_counter()
        embedding = entry.tensor.to(self.device)
        self.copy_seconds += time.perf_counter() - started
        self._entries.move_to_end(name)
        self.embeddings_reloaded += 1
        self.bytes_to_device += entry.nbytes
        return embedding

    # -- internals ------------------------------------------------------------------------

    def _copy(self, copy: PageCopy) -> None:
        started = time.perf_counter()
        self.pages.apply(self.kv, (copy,))
        self.copy_seconds += time.perf_counter() - started
        if self._record:
            self._copies.append(copy)

    def _make_room(self, nbytes: int) -> bool:
        """Evicts least recently used entries until `nbytes` more fit; False if they never
        can (larger than the tier). The blocks are as many pages as the budget holds, so
        while the bytes fit a page, a block is free."""
        if nbytes > self.capacity_bytes:
            return False
        while self.usage_bytes + nbytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def _drop(self, name: Hashable) -> None:
        entry = self._entries.pop(name)
        if isinstance(entry, _Page):
            self._free_blocks.append(entry.block)
            self.usage_bytes -= self.page_bytes
        else:
            self.usage_bytes -= entry.nbytes


def host_blocks(capacity_bytes: int, layout: KVLayout) -> int:
    """Host blocks a tier of `capacity_bytes` needs: as many pages as fit in it."""
    return capacity_bytes // layout.bytes_per_page
