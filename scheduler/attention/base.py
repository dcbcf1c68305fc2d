"""What every attention backend is handed, and what it hands the model.

A step is a list of `SequenceChunk`s, one per scheduled sequence, flat in the order of
the step's tokens. `AttentionBackend.prepare` turns it into the step's
`AttentionContext` (`models/attention_api.py`): once per step it builds whatever
metadata its kernels need, then every layer's `attend` writes that layer's new K/V into
the pages and attends over each sequence's history plus its new tokens, causally.

The KV cache is one tensor `[layers, 2, kv_heads, slots, head_dim]` (`kv_cache.py`):
slot `page * page_size + offset`, so a page's tokens are consecutive rows of each head,
and consecutive pages are one contiguous stretch. Each chunk carries its pages both as a
list and as *runs* (maximal stretches of consecutive page ids) that the page table keeps
as it grows, so no backend needs to walk a sequence's whole history on the host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kv.kv_cache import KVCache
from ..kv.page_table import PageRun, page_runs
from ..models.attention_api import AttentionContext


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a step: `num_new` tokens after `num_cached` cached ones. `pages`
    hold its tokens in order; `runs` are the same pages in stretches of consecutive ids."""

    pages: Sequence[int]
    runs: Sequence[PageRun]
    num_cached: int
    num_new: int

    @classmethod
    def of(cls, pages: Sequence[int], num_cached: int, num_new: int) -> SequenceChunk:
        """A chunk whose runs are computed from `pages` (tests; the engine keeps them)."""
        return cls(pages, page_runs(pages), num_cached, num_new)

    @property
    def context_len(self) -> int:
        return self.num_cached + self.num_new

    @property
    def is_decode(self) -> bool:
        return self.num_new == 1 and self.num_cached > 0


def new_token_slots(chunk: SequenceChunk, page_size: int) -> list[int]:
    """The slots of the chunk's new tokens: O(new tokens), whatever the history."""
    slots = []
    for position in range(chunk.num_cached, chunk.context_len):
        page = chunk.pages[position // page_size]
        slots.append(page * page_size + position % page_size)
    return slots


class StaticDecode(ABC):
    """A backend's decode metadata in buffers that never move, for CUDA graphs: a graph
    captured for `size` sequences reads `context(size)`, and each replay only rewrites
    the buffers' first `size` rows (`fill`). Rows past the step's sequences are padding:
    they write no KV and attend to one key, so any page is safe to read."""

    @abstractmethod
    def context(self, size: int) -> AttentionContext:
        """The context a graph for `size` decoding sequences captures; built once."""

    @abstractmethod
    def fill(self, chunks: Sequence[SequenceChunk], size: int) -> None:
        """Writes a decode step's metadata (`chunks`: at most `size` decodes; none while
        capturing) into the buffers, padded to `size`, asynchronously."""


class AttentionBackend(ABC):
    """A way to run paged attention on a device; one instance per engine."""

    name: ClassVar[str]

    def __init__(self, kv_cache: KVCache, device: torch.device) -> None:
        self.kv_cache = kv_cache
        self.device = device

    @abstractmethod
    def prepare(self, chunks: Sequence[SequenceChunk]) -> AttentionContext:
        """The step's attention: metadata built once here, reused by every layer."""

    def static_decode(self, max_seqs: int, max_pages: int) -> StaticDecode | None:
        """Fixed buffers for decode steps of up to `max_seqs` sequences of at most
        `max_pages` pages each, or None where the backend plans each step on the host and
        so cannot be replayed from a graph (`sdpa`)."""
        return None
