"""The image-aware prefix cache: full KV pages found again by their content.

A full page's key is a hash chain (`docs/design.md`, "Image-aware prefix cache"):

    key(page i) = xxh3_128(key(page i-1) ‖ its token ids as int32 ‖ for every image whose
                           tokens overlap the page: the image's 128-bit key and the
                           overlap's start and end relative to the image)

with every variable-length part length-prefixed, so two different inputs never feed the
hasher the same stream. Because a key covers the whole prefix, tokens and image grids
included, the KV a page holds (M-RoPE positions too) is a function of its key, and
reusing it is exact.

`PrefixCache` is the policy on top of `PagePool`, which stores key -> page and evicts:
at admission `match` finds the longest chain of cached pages over a request's tokens
(never its last token: one token must be computed to get logits); as a request computes
tokens `register` adds its newly full pages, prompt and decode pages alike (the next
turn of a conversation contains the previous answer).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import xxhash

from iris_serve.ipc.messages import ImageRef
from iris_serve.scheduler.kv_cache import PagePool
from iris_serve.scheduler.request import Request

assert array("i").itemsize == 4, "token ids are hashed as int32"


def page_key(parent: bytes, token_ids: bytes, images: list[tuple[bytes, int, int]]) -> bytes:
    """Key of a full page: its parent page's key (b"" for the first page), its token ids
    (int32 bytes) and `(image key, start, end)` of each image overlapping it."""
    hasher = xxhash.xxh3_128()
    _feed(hasher, parent)
    _feed(hasher, token_ids)
    hasher.update(len(images).to_bytes(8, "little"))
    for key, start, end in images:
        _feed(hasher, key)
        hasher.update(start.to_bytes(8, "little"))
        hasher.update(end.to_bytes(8, "little"))
    return hasher.digest()


def token_bytes(token_ids: list[int]) -> bytes:
    return array("i", token_ids).tobytes()


def image_overlaps(images: list[ImageRef], start: int, end: int) -> list[tuple[bytes, int, int]]:
    """`(key, start, end)` of the part of each image inside tokens `start..end`, relative
    to the image's first token."""
    return [
        (image.key, max(start, image.offset) - image.offset, min(end, image.end) - image.offset)
        for image in images
        if image.overlaps(start, end)
    ]


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        # a hybrid model's: whether a page's key has a state snapshot (state_slots.py)
        self._restorable: Callable[[bytes], bool] | None = None
        self.hit_tokens = 0  # tokens found cached at requests' first admission
        self.query_tokens = 0  # tokens looked up then (the hit rate's denominator)

    def count_first_admission(self, hit_tokens: int, query_tokens: int) -> None:
        """A request's first admission found `hit_tokens` of its `query_tokens` cached."""
        self.hit_tokens += hit_tokens
        self.query_tokens += query_tokens

    def require_snapshots(self, restorable: Callable[[bytes], bool]) -> None:
        """A hybrid model's cache: a match ends at the deepest matched page whose key
        `restorable` says has a snapshot of the linear layers' state, or is empty."""
        self._restorable = restorable

    def match(self, request: Request) -> list[int]:
        """Cached pages holding the longest prefix of the request's tokens, stopping
        before its last token (and, with `require_snapshots`, at a snapshot). Read-only:
        the caller takes references with `pool.share`."""
        max_pages = (request.num_tokens - 1) // self.page_size
        keys = self.page_keys(request, max_pages)
        pages = []
        for index in range(max_pages):
            page = self.pool.lookup(keys[index], self._page_tokens(request, index))
            if page is None:
                break
            pages.append(page)
        if self._restorable is not None:
            while pages and not self._restorable(keys[len(pages) - 1]):
                pages.pop()
        return pages

    def register(self, request: Request) -> None:
        """Caches the request's pages that its computed tokens have filled since the last
        call. A page whose content is already cached elsewhere stays private."""
        table = request.page_table
        full = min(table.num_computed_tokens // self.page_size, len(table.pages))
        first = table.num_registered_pages
        if full <= first:
            return
        keys = self.page_keys(request, full)
        for index in range(first, full):
            self.pool.cache(table.pages[index], keys[index], self._page_tokens(request, index))
        table.mark_registered(full)

    def page_keys(self, request: Request, num_pages: int) -> Sequence[bytes]:
        """The keys of the request's first `num_pages` full pages (or more), extending
        the chain its page table keeps (tokens only ever append, so a key never changes)."""
        table = request.page_table
        keys = table.keys
        size = self.page_size
        while len(keys) < num_pages:
            index = len(keys)
            start, end = index * size, (index + 1) * size
            parent = keys[-1] if keys else b""
            images = (
                image_overlaps(request.images, start, end) if start < request.prompt_len else []
            )
            table.add_key(page_key(parent, self._page_tokens(request, index), images))
        return keys

    def _page_tokens(self, request: Request, index: int) -> bytes:
        return token_bytes(request.token_ids(index * self.page_size, (index + 1) * self.page_size))


def _feed(hasher: xxhash.xxh3_128, part: bytes) -> None:
    hasher.update(len(part).to_bytes(8, "little"))
    hasher.update(part)
