"""The host tier: where the prefix cache's evicted KV pages, the embedding cache's
evicted image embeddings and a hybrid model's evicted linear-state snapshots go, so that
an agent coming back after others pushed its history out reloads it instead of
re-prefilling and re-encoding (`--kv-offload-gib`; `docs/design.md`, "The host tier").

The device caches stay the one authority on what is resident: the tier hears of an entry
only as the device cache evicts it (`spill_*`) and hands one back only when a device
lookup missed (`reload_*`). Nothing mirrors an LRU, so the two can never disagree about
what is where; an entry may be in both (a reload keeps the host copy, so evicting the
page again costs no copy).

Two parts, as with the KV cache:
- `HostMemory`, on every rank: this rank's host blocks, one KV page each (its shard under
  tensor parallelism), its copies of linear-state snapshots, and the copies between them
  and the device (`HostCopy`).
- `HostTier`, rank 0's alone: which key is where, one LRU over pages, snapshots and
  embeddings in one byte budget (a full tier evicts its oldest entry, never refuses; an
  entry a match found since the last step is not evicted before the step that reloads
  it), and the counters. Rank 0 copies as it decides, during planning: a spill before the
  step's forward overwrites the page or slot, a reload before the forward reads it. The
  same copies, in the same order, go to the other ranks in the step plan (the planner
  takes them, `take_copies`), which make them before their forward (and before its slot
  clears and copies): their pages and slots have changed no more than rank 0's had.

On CUDA the blocks are pinned and the copies are asynchronous on the step's stream, ordered
with the forwards around them; a reload's failure surfaces here only on the CPU (where
the copy is a memcpy). On the CPU an embedding is already in host memory: its spill keeps
the tensor, its reload hands it back, with no copy.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from itertools import count
from typing import Literal

import torch

from ..hybrid.linear_state import LinearStates
from .kv_cache import KVCache, KVLayout

logger = logging.getLogger(__name__)


CopyKind = Literal["page_out", "page_in", "state_out", "state_in", "state_drop"]


@dataclass(frozen=True)
class HostCopy:
    """One copy every rank makes on its shard: KV page `device` to host block `host`
    ("page_out", a spill) or back ("page_in", a reload); linear-state slot `device` to the
    host snapshot `host` ("state_out") or back ("state_in"), or that snapshot freed
    ("state_drop")."""

    kind: CopyKind
    device: int
    host: int


class HostMemory:
    """This rank's host side of the tier: `blocks` `[num_blocks, layers, 2, kv_heads,
    page_size, head_dim]`, one device page's K and V for every layer each (pinned on
    CUDA), and its copies of a hybrid model's snapshots by host id."""

    def __init__(
        self,
        kv: KVCache,
        num_blocks: int,
        linear_states: LinearStates | None = None,
    ) -> None:
        layout = kv.layout
        self.kv = kv
        self.linear_states = linear_states
        self.num_blocks = num_blocks
        self.pinned = kv.slots.device.type == "cuda"
        # zeros, not empty: the pages are committed now, so no spill pays a page fault per
        # 4 KiB and the process's memory does not creep up as the tier fills
        self.blocks = torch.zeros(
            num_blocks,
            layout.num_layers,
            2,
            layout.num_kv_heads,
            layout.page_size,
            layout.head_dim,
            dtype=layout.dtype,
            pin_memory=self.pinned,
        )
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(self, copies: Iterable[HostCopy]) -> None:
        """Makes `copies` in order (a reload may read what an earlier spill wrote)."""
        for copy in copies:
            if copy.kind == "page_out":
                self.blocks[copy.host].copy_(self._page(copy.device), non_blocking=True)
            elif copy.kind == "page_in":
                self._page(copy.device).copy_(self.blocks[copy.host], non_blocking=True)
            elif copy.kind == "state_out":
                pool = self._pool()
                self.states[copy.host] = (
                    self._host_copy(pool.conv[:, copy.device]),
                    self._host_copy(pool.recurrent[:, copy.device]),
                )
            elif copy.kind == "state_in":
                pool = self._pool()
                conv, recurrent = self.states[copy.host]
                pool.conv[:, copy.device].copy_(conv, non_blocking=True)
                pool.recurrent[:, copy.device].copy_(recurrent, non_blocking=True)
            else:
                self.states.pop(copy.host, None)

    def _page(self, page: int) -> torch.Tensor:
        size = self.kv.page_size
        return self.kv.slots[:, :, :, page * size : (page + 1) * size]

    def _pool(self) -> LinearStates:
        assert self.linear_states is not None, "only a hybrid model has state snapshots"
        return self.linear_states

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pinned)
        return host.copy_(tensor, non_blocking=True)


@dataclass
class _Page:
    block: int
    token_bytes: bytes  # checked on reload, as the device cache checks a hit


@dataclass
class _State:
    host: int  # its id in every rank's `HostMemory.states`


@dataclass
class _Embedding:
    tensor: torch.Tensor  # in host memory

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class HostTier:
    """Rank 0's host tier over its `memory` (see the module docstring). `record_copies`:
    keep the copies for the other tensor-parallel ranks (`take_copies`)."""

    def __init__(
        self,
        capacity_bytes: int,
        memory: HostMemory,
        device: torch.device,
        record_copies: bool = False,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.memory = memory
        self.device = device
        self.page_bytes = memory.kv.layout.bytes_per_page
        states = memory.linear_states
        self.state_bytes = 0 if states is None else states.layout.bytes_per_slot
        self._entries: OrderedDict[Hashable, _Page | _State | _Embedding] = OrderedDict()
        self._fresh: set[Hashable] = set()  # found by a match since the last step
        self._free_blocks = list(range(memory.num_blocks - 1, -1, -1))
        self._state_ids = count()
        self.num_states = 0
        self.num_embeddings = 0
        self._record = record_copies
        self._copies: list[HostCopy] = []
        self.usage_bytes = 0
        # counters (exported as metrics)
        self.pages_spilled = 0
        self.pages_reloaded = 0
        self.states_spilled = 0
        self.states_reloaded = 0
        self.embeddings_spilled = 0
        self.embeddings_reloaded = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.copy_seconds = 0.0
        self.failed_reloads = 0
        self.on_page_drop: Callable[[bytes], None] | None = None  # a page's key (wiring.py)

    @property
    def num_pages(self) -> int:
        return self.memory.num_blocks - len(self._free_blocks)

    def take_copies(self) -> list[HostCopy]:
        """The copies made since the last call, in order, for the other ranks (the planner
        takes them into the step plan); a step starts, so the entries matches found may
        be evicted again."""
        copies, self._copies = self._copies, []
        self._fresh.clear()
        return copies

    # -- KV pages -------------------------------------------------------------------------

    def has_page(self, key: bytes, token_bytes: bytes) -> bool:
        """Whether the tier holds the page `key` (with these tokens); a hit is kept until
        the next step, for the reload."""
        entry = self._entries.get(("page", key))
        if not isinstance(entry, _Page) or entry.token_bytes != token_bytes:
            return False
        self._touch(("page", key))
        return True

    def spill_page(self, page: int, key: bytes, token_bytes: bytes) -> bool:
        """The prefix cache evicts device page `page` (content `key`): its KV goes to a
        block, before anything overwrites the page. A page the tier holds already is only
        touched; one that does not fit is dropped (the tier never refuses an eviction).
        Whether the tier holds the page now."""
        name = ("page", key)
        if name in self._entries:
            self._entries.move_to_end(name)
            return True
        if not self._make_room(self.page_bytes):
            return False
        block = self._free_blocks.pop()
        self._copy(HostCopy("page_out", page, block))
        self._entries[name] = _Page(block, token_bytes)
        self.usage_bytes += self.page_bytes
        self.pages_spilled += 1
        self.bytes_to_host += self.page_bytes
        return True

    def reload_page(self, key: bytes, token_bytes: bytes, page: int) -> bool:
        """Copies the tier's page `key` into device page `page`; False when it is gone or
        the copy raised (the caller recomputes instead; the entry is dropped)."""
        name = ("page", key)
        entry = self._entries.get(name)
        if not isinstance(entry, _Page) or entry.token_bytes != token_bytes:
            return False
        try:
            self._copy(HostCopy("page_in", page, entry.block))
        except Exception:
            logger.exception("reloading a KV page from host memory failed; recomputing it")
            self.failed_reloads += 1
            self._drop(name)
            return False
        self._entries.move_to_end(name)
        self.pages_reloaded += 1
        self.bytes_to_device += self.page_bytes
        return True

    # -- a hybrid model's linear-state snapshots ------------------------------------------

    def has_state(self, key: bytes) -> bool:
        """Whether the tier holds the snapshot keyed `key` (kept until the next step)."""
        if ("state", key) not in self._entries:
            return False
        self._touch(("state", key))
        return True

    def spill_state(self, key: bytes, slot: int) -> None:
        """The snapshot store evicts slot `slot`'s snapshot `key`: a copy goes to host
        memory before the slot is written again."""
        name = ("state", key)
        if name in self._entries:
            self._entries.move_to_end(name)
            return
        if not self._make_room(self.state_bytes):
            return
        host = next(self._state_ids)
        self._copy(HostCopy("state_out", slot, host))
        self._entries[name] = _State(host)
        self.num_states += 1
        self.usage_bytes += self.state_bytes
        self.states_spilled += 1
        self.bytes_to_host += self.state_bytes

    def reload_state(self, key: bytes, slot: int) -> bool:
        """Copies the snapshot `key` into slot `slot` (a request's working slot); False
        when the tier does not hold it."""
        name = ("state", key)
        entry = self._entries.get(name)
        if not isinstance(entry, _State):
            return False
        self._copy(HostCopy("state_in", slot, entry.host))
        self._entries.move_to_end(name)
        self.states_reloaded += 1
        self.bytes_to_device += self.state_bytes
        return True

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
        self.num_embeddings += 1
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

    def _copy(self, copy: HostCopy) -> None:
        started = time.perf_counter()
        self.memory.apply((copy,))
        self.copy_seconds += time.perf_counter() - started
        if self._record:
            self._copies.append(copy)

    def _touch(self, name: Hashable) -> None:
        self._entries.move_to_end(name)
        self._fresh.add(name)

    def _make_room(self, nbytes: int) -> bool:
        """Evicts least recently used entries (not those a match found since the last
        step) until `nbytes` more fit; False if they cannot. The blocks are as many pages
        as the budget holds, so while the bytes fit a page, a block is free."""
        excess = self.usage_bytes + nbytes - self.capacity_bytes
        if nbytes > self.capacity_bytes:
            return False
        victims = []
        for name, entry in self._entries.items():  # oldest first; stops once enough
            if excess <= 0:
                break
            if name not in self._fresh:
                victims.append(name)
                excess -= self._nbytes(entry)
        if excess > 0:
            return False
        for name in victims:
            self._drop(name)
        return True

    def _nbytes(self, entry: _Page | _State | _Embedding) -> int:
        if isinstance(entry, _Page):
            return self.page_bytes
        return self.state_bytes if isinstance(entry, _State) else entry.nbytes

    def _drop(self, name: Hashable) -> None:
        entry = self._entries.pop(name)
        self._fresh.discard(name)
        self.usage_bytes -= self._nbytes(entry)
        if isinstance(entry, _Page):
            self._free_blocks.append(entry.block)
            if self.on_page_drop is not None:
                assert isinstance(name, tuple)  # ("page", key)
                self.on_page_drop(name[1])
        elif isinstance(entry, _State):
            self._copy(HostCopy("state_drop", -1, entry.host))
            self.num_states -= 1
        else:
            self.num_embeddings -= 1


def host_blocks(capacity_bytes: int, layout: KVLayout) -> int:
    """Host blocks a tier of `capacity_bytes` needs: as many pages as fit in it."""
    return capacity_bytes // layout.bytes_per_page
