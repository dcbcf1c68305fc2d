"""The paged KV cache: one preallocated tensor on the device, bookkept in Python ints.

A page holds `page_size` consecutive tokens of one sequence for every layer. A token's
*slot* is `page * page_size + offset`; the attention code writes and gathers K/V by slot.
`PagePool` owns the free list; requests own the page ids they were given and hand them
back when they finish, are aborted or preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

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
    """Free list of page ids. O(1) allocate and free; never hands out a page twice."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page; raise its memory budget")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_pages

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"asked for {count} pages, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)


class KVCache:
    """K and V for every layer: `[num_layers, 2, num_pages * page_size, kv_heads, head_dim]`."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.pool = PagePool(num_pages)
        self.slots = torch.zeros(
            layout.num_layers,
            2,
            num_pages * layout.page_size,
            layout.num_kv_heads,
            layout.head_dim,
            dtype=layout.dtype,
            device=device,
        )

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.page_size)

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.slots[layer, 0].index_copy_(0, slot_mapping, k)
        self.slots[layer, 1].index_copy_(0, slot_mapping, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape); returns `slots.shape + (kv_heads, head_dim)`."""
        return self.slots[layer, 0][slots], self.slots[layer, 1][slots]


def slots_for(pages: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Slots of tokens `start..end` of a sequence whose pages are `pages`."""
    positions = torch.arange(start, end)
    page_ids = torch.tensor(pages, dtype=torch.long)[positions // page_size]
    return page_ids * page_size + positions % page_size
