"""The paged KV cache: one preallocated tensor on the device, bookkept in Python ints.

A page holds `page_size` consecutive tokens of one sequence for every layer. A token's
*slot* is `page * page_size + offset`; the attention code writes and gathers K/V by slot.
`PagePool` owns the page ids: reference counts, the free list and the full pages kept
as a prefix cache (their content keys, LRU eviction). Requests hold references on the
pages they were given or found cached and drop them when they finish, are aborted or
preempted; a page another request still holds is never freed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import huge_pages
from .free_pages import FreePages

if TYPE_CHECKING:
    from ..models.config import VLModelConfig


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model_config: VLModelConfig, page_size: int, dtype: torch.dtype) -> KVLayout:
        """The layout of a model's KV cache: its full-attention layers (all of them but in a
        hybrid model), this rank's KV heads under tensor parallelism."""
        return cls(
            num_layers=model_config.num_kv_layers,
            num_kv_heads=model_config.attention_heads.num_kv_heads,
            head_dim=model_config.head_dim,
            page_size=page_size,
            dtype=dtype,
        )

    @property
    def bytes_per_page(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return (
            2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * element_size
        )

    def pages_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_page


class OutOfPages(RuntimeError):
    """Raised when a caller asks for more pages than are free; the scheduler checks first."""


class PagePool:
    """Page ids with reference counts; full pages may outlive their requests as a cache.

    A page is *held* (`refcount > 0`; a cached page by several requests at once, a shared
    prefix), *evictable* (unreferenced but cached under a content key, in
    least-recently-released order) or *free*. `allocate` takes free pages first, placed so
    a sequence's pages stay consecutive (`free_pages.py`), then evicts the least recently
    used evictable page. `num_free` counts both, so `num_free == num_pages` still means "no
    request holds a page"."""

    def __init__(self, num_pages: int) -> None:
        """`on_evict(page, key, token_bytes)`, when set (by the engine's wiring,
        step/wiring.py), hears of each cached page as it is evicted, before its new owner
        writes it (the host tier spills it)."""
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page; raise its memory budget")
        self.num_pages = num_pages
        self._free = FreePages(num_pages)
        self._refcounts = [0] * num_pages
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._page_of_key: dict[bytes, int] = {}
        self._content: dict[int, tuple[bytes, bytes]] = {}  # page -> (key, token bytes)
        self.num_evictions = 0
        self.on_evict: Callable[[int, bytes, bytes], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free plus evictable cached pages."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages registered under a content key, held or not."""
        return len(self._page_of_key)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_pages

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def is_cached(self, page: int) -> bool:
        return page in self._content

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """`count` pages, each with one reference: free pages first (those right after page
        `after` when free, so a sequence grows in place), then LRU evictions."""
        if count > self.num_free:
            raise OutOfPages(f"asked for {count} pages, {self.num_free} free")
        pages = self._free.take(count, after)
        for page in pages:
            self._refcounts[page] = 1
        while len(pages) < count:
            page, _ = self._evictable.popitem(last=False)
            key, tokens = self._content.pop(page)
            del self._page_of_key[key]
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(page, key, tokens)
            self._refcounts[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: list[int]) -> None:
        """Take one more reference on each of `pages` (cached pages found by a lookup)."""
        for page in pages:
            if self._refcounts[page] == 0:
                if page not in self._evictable:
                    raise ValueError(f"page {page} is neither held nor cached")
                del self._evictable[page]
            self._refcounts[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference on each of `pages`; a page nobody holds becomes free or,
        if cached, evictable. Released tail-first, so a chain's tail is evicted first."""
        for page in reversed(pages):
            if self._refcounts[page] <= 0:
                raise ValueError(f"page {page} freed more often than it was allocated")
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                if page in self._content:
                    self._evictable[page] = None
                else:
                    self._free.put(page)

    def cache(self, page: int, key: bytes, token_bytes: bytes) -> bool:
        """Register a held, full page's content under `key`. False (and nothing changes)
        when another page already holds that content or `page` is already registered."""
        if self._refcounts[page] <= 0:
            raise ValueError(f"page {page} is not held; only a held page can be cached")
        if key in self._page_of_key or page in self._content:
            return False
        self._page_of_key[key] = page
        self._content[page] = (key, token_bytes)
        return True

    def lookup(self, key: bytes, token_bytes: bytes) -> int | None:
        """The cached page with content `key`, if its stored tokens are `token_bytes` too
        (a 128-bit collision would have to agree on the tokens to be served)."""
        page = self._page_of_key.get(key)
        if page is None or self._content[page][1] != token_bytes:
            return None
        return page


class KVCache:
    """K and V for every layer: `[num_layers, 2, kv_heads, num_pages * page_size, head_dim]`,
    head-major, so a run of consecutive pages is one strided view per layer."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.pool = PagePool(num_pages)
        self.slots = huge_pages.zeros(
            layout.num_layers,
            2,
            layout.num_kv_heads,
            num_pages * layout.page_size,
            layout.head_dim,
            dtype=layout.dtype,
            device=device,
        )

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Stores `k`/`v` `[tokens, kv_heads, head_dim]` at `slot_mapping` `[tokens]`."""
        self.slots[layer, 0].index_copy_(1, slot_mapping, k.transpose(0, 1))
        self.slots[layer, 1].index_copy_(1, slot_mapping, v.transpose(0, 1))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each `[kv_heads, slots, head_dim]` (views)."""
        return self.slots[layer, 0], self.slots[layer, 1]
