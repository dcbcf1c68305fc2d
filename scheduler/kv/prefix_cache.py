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
turn of a conversation contains the previous answer). With a host tier (host_tier.py) the
chain goes on in host memory where the device's ends, and `reload` copies those pages
back into pages the request was given.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from ...ipc.messages import ImageRef
from ..step.request import Request
from .kv_cache import PagePool

if TYPE_CHECKING:
    from .host_tier import HostTier
    from .kv_events import KvEventLog

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


@dataclass(frozen=True)
class PrefixMatch:
    """A request's cached prefix: the device `pages` holding its first tokens, then the
    keys of the pages after them that the host tier holds (`host_keys`, reloaded at
    admission). `fallback`: how many of `pages` to take should a reload fail (all of them;
    a hybrid model's, those up to its deepest snapshot on the device side)."""

    pages: list[int] = field(default_factory=list)
    host_keys: list[bytes] = field(default_factory=list)
    fallback: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.pages) + len(self.host_keys)

    def without_host(self) -> PrefixMatch:
        return PrefixMatch(self.pages[: self.fallback], [], self.fallback)


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int, host: HostTier | None = None) -> None:
        self.pool = pool
        self.page_size = page_size
        self.host = host  # where evicted pages went (None: nowhere; wiring.py sends them)
        self.events: KvEventLog | None = None  # KV events for a router (wiring.py)
        # a hybrid model's: whether a page's key has a state snapshot (state_slots.py)
        self._restorable: Callable[[bytes], bool] | None = None
        self.hit_tokens = 0  # tokens found cached at requests' first admission
        self.host_hit_tokens = 0  # of those, reloaded from the host tier
        self.query_tokens = 0  # tokens looked up then (the hit rate's denominator)

    def count_first_admission(
        self, hit_tokens: int, query_tokens: int, host_hit_tokens: int = 0
    ) -> None:
        """A request's first admission found `hit_tokens` of its `query_tokens` cached,
        `host_hit_tokens` of them in the host tier."""
        self.hit_tokens += hit_tokens
        self.host_hit_tokens += host_hit_tokens
        self.query_tokens += query_tokens

    def require_snapshots(self, restorable: Callable[[bytes], bool]) -> None:
        """A hybrid model's cache: a match ends at the deepest matched page whose key
        `restorable` says has a snapshot of the linear layers' state, or is empty."""
        self._restorable = restorable

    def match(self, request: Request) -> PrefixMatch:
        """The longest cached prefix of the request's tokens, on the device then in the
        host tier, stopping before its last token (and, with `require_snapshots`, at a
        snapshot). Takes nothing: the caller shares the pages (`pool.share`) and reloads
        the host ones (`reload`)."""
        max_pages = (request.num_tokens - 1) // self.page_size
        keys = self.page_keys(request, max_pages)
        pages = []
        for index in range(max_pages):
            page = self.pool.lookup(keys[index], self._page_tokens(request, index))
            if page is None:
                break
            pages.append(page)
        host_keys = []
        if self.host is not None:
            for index in range(len(pages), max_pages):
                if not self.host.has_page(keys[index], self._page_tokens(request, index)):
                    break
                host_keys.append(keys[index])
        if self._restorable is None:
            return PrefixMatch(pages, host_keys, len(pages))
        fallback = self._restorable_depth(keys, len(pages))
        depth = self._restorable_depth(keys, len(pages) + len(host_keys))
        if depth <= len(pages):
            return PrefixMatch(pages[:depth], [], depth)
        return PrefixMatch(pages, host_keys[: depth - len(pages)], fallback)

    def reload(self, request: Request, match: PrefixMatch, pages: Sequence[int]) -> bool:
        """Copies the match's host pages into `pages` (held by the request, one each) and
        registers them under their keys. False when a reload failed: nothing is
        registered, and the request computes those tokens instead."""
        assert self.host is not None and len(pages) == len(match.host_keys)
        first = len(match.pages)
        tokens = [self._page_tokens(request, first + i) for i in range(len(pages))]
        for key, page, page_tokens in zip(match.host_keys, pages, tokens, strict=True):
            if not self.host.reload_page(key, page_tokens, page):
                return False
        for key, page, page_tokens in zip(match.host_keys, pages, tokens, strict=True):
            self.pool.cache(page, key, page_tokens)
        return True

    def register(self, request: Request) -> None:
        """Caches the request's pages that its computed tokens have filled since the last
        call. A page whose content is already cached elsewhere stays private. With KV
        events, the pages registered or found cached are announced."""
        table = request.page_table
        full = min(table.num_computed_tokens // self.page_size, len(table.pages))
        first = table.num_registered_pages
        if full > first:
            keys = self.page_keys(request, full)
            for index in range(first, full):
                self.pool.cache(table.pages[index], keys[index], self._page_tokens(request, index))
            table.mark_registered(full)
        if self.events is not None:
            self.events.announce(request)

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

    def _restorable_depth(self, keys: Sequence[bytes], num_pages: int) -> int:
        """The most of the first `num_pages` pages a hybrid model can resume after."""
        assert self._restorable is not None
        while num_pages and not self._restorable(keys[num_pages - 1]):
            num_pages -= 1
        return num_pages

    def _page_tokens(self, request: Request, index: int) -> bytes:
        return token_bytes(request.token_ids(index * self.page_size, (index + 1) * self.page_size))


def _feed(hasher: xxhash.xxh3_128, part: bytes) -> None:
    hasher.update(len(part).to_bytes(8, "little"))
    hasher.update(part)
