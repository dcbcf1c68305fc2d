"""The free KV pages, handed out so that a sequence's pages stay consecutive.

Attention reads a sequence's K/V in place, one strided view per run of consecutive pages
(`scheduler/attention/sdpa.py`); every extra run is another kernel call or a copy. So:

- a growing sequence takes the pages right after its last one while they are free;
- a new sequence (or one that cannot grow in place) starts inside the largest free
  gap: at its start when the gap begins the pool, otherwise in its middle, so the
  sequence before the gap keeps room to grow into.

Free pages are a bytearray (1 = free), so finding gaps is a C-speed scan, paid once
per placement, never per step.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_FREE = 1
_GAP = re.compile(rb"\x01+")


class FreePages:
    def __init__(self, num_pages: int) -> None:
        self._is_free = bytearray([_FREE]) * num_pages
        self._count = num_pages

    def __len__(self) -> int:
        return self._count

    def __contains__(self, page: int) -> bool:
        return self._is_free[page] == _FREE

    def put(self, page: int) -> None:
        assert self._is_free[page] != _FREE, f"page {page} is free already"
        self._is_free[page] = _FREE
        self._count += 1

    def take(self, count: int, after: int | None = None) -> list[int]:
        """`count` free pages (at most as many as are free): the ones following `after`
        first, then the rest placed in the largest gaps."""
        count = min(count, self._count)
        pages: list[int] = []
        if after is not None:
            page = after + 1
            while len(pages) < count and page < len(self._is_free) and page in self:
                pages.append(page)
                page += 1
            self._mark_taken(pages)
        while len(pages) < count:
            start, length = self._place(count - len(pages))
            placed = range(start, start + length)
            self._mark_taken(placed)
            pages.extend(placed)
        return pages

    def _mark_taken(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._is_free[page] = 0
        self._count -= len(pages)

    def _place(self, wanted: int) -> tuple[int, int]:
        """Where the next `wanted` pages go: (first page, how many fit there)."""
        gap = max(_GAP.finditer(self._is_free), key=lambda m: m.end() - m.start())
        start, size = gap.start(), gap.end() - gap.start()
        if size <= wanted:
            return start, size
        if start > 0:
            start += (size - wanted) // 2
        return start, wanted
