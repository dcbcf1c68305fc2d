"""Who holds which linear-attention state slot: each running request's working slot and
the prefix cache's snapshots (`docs/design.md`, "Hybrid models: state beside the KV").

A hybrid model (Qwen3.5) keeps a fixed-size state per sequence in every linear-attention
layer (`models/linear_state.py`). The pool has `num_working` working slots, one per request
that may run at once, then `num_snapshots` snapshot slots. `StateSlots` is pure
bookkeeping: it never touches a tensor. What the device must do (clear a slot, copy one
into another) it records as `SlotOp`s, which the batch planner hands over in the step plan
(`take_ops`, with each chunk's slot and captures, `sequences`); the model runner applies
them at the start of the step's forward, on every tensor-parallel rank alike, before any
layer reads a slot.

A prefix-cache hit on a hybrid model means something only if the linear layers' state at
the hit can be restored, so a snapshot is keyed by the prefix-cache key of the full page
that ends where it was taken: the state after exactly `(i + 1) * page_size` tokens is keyed
by page `i`'s key, which names the whole prefix (tokens and images). `PrefixCache.match`
stops at the deepest matched page that has one (`has_snapshot`); admitting the request
copies that snapshot into its working slot (the snapshot stays, for the next hit).

Snapshots are taken where a forward passes a page boundary that is worth resuming from:
- the last page boundary before each image (the system prompt and text every request
  shares, with another image) and up to its end (the same image, another question),
- the last page boundary of the prompt (the same prompt again),
- the request's latest page boundary, overwritten in place as it goes: when it ends or
  is preempted, that is where the next turn of its conversation (or its own recompute)
  resumes.
A step captures them mid-chunk (`SequenceStates.captures`); they go to the store once the
forward that writes them has run (`step_ran`), the latest boundary's when its request
ends. The store is LRU-bounded in slots; snapshots a request still writes are never
evicted. With a host tier (host_tier.py) an evicted snapshot is copied to host memory
first, and a hit on a snapshot there restores it from there into the working slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import EngineConfig
from ..kv.prefix_cache import PrefixCache
from ..step.batch_planner import ScheduledChunk
from ..step.request import Request, RequestResources
from .linear_state import LinearStates, SequenceStates

if TYPE_CHECKING:
    from ..kv.host_tier import HostTier

# A request's prefix-cache keys: the first `num_pages` full pages' (or more)
PageKeys = Callable[[Request, int], Sequence[bytes]]


@dataclass(frozen=True)
class SlotOp:
    """Slot `target` becomes the zero state (`source` None) or a copy of slot `source`."""

    target: int
    source: int | None = None


@dataclass
class _Capture:
    position: int  # tokens the state has seen
    slot: int
    key: bytes  # prefix-cache key of the page ending at `position`


@dataclass
class _Held:
    """What one admitted request holds: its working slot and the snapshots it writes."""

    working: int
    rolling: _Capture | None = None  # its latest page boundary, rewritten as it goes
    # images' bounds and prompt's end captured by the step running now (stored once it ran)
    pinned: list[_Capture] = field(default_factory=list)


class StateSlots(RequestResources):
    """Owns the slots of one `LinearStates` pool. `page_keys` is the prefix cache's;
    without a prefix cache (`page_keys` None) no snapshot is ever taken. `host`: where
    evicted snapshots go (the host tier), if anywhere."""

    def __init__(
        self,
        num_working: int,
        num_snapshots: int,
        page_size: int,
        page_keys: PageKeys | None,
        host: HostTier | None = None,
    ) -> None:
        self.page_size = page_size
        self.host = host
        self.page_keys = page_keys
        self.num_snapshots = num_snapshots if page_keys is not None else 0
        self._free_working = list(range(num_working - 1, -1, -1))
        self._free_snapshots = list(
            range(num_working + self.num_snapshots - 1, num_working - 1, -1)
        )
        self._stored: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, oldest use first
        self._held: dict[str, _Held] = {}
        self._ops: list[SlotOp] = []
        self.snapshot_hits = 0  # admissions that restored a snapshot
        self.snapshot_queries = 0  # first admissions (the hit rate's denominator)

    @classmethod
    def for_pool(
        cls,
        config: EngineConfig,
        pool: LinearStates,
        prefix_cache: PrefixCache | None,
        host: HostTier | None = None,
    ) -> StateSlots:
        """The owner of a `DeviceState` pool's slots (working slots, then snapshots, then
        the scratch slot), keyed by `prefix_cache`'s page keys (whose hits the engine's
        wiring makes end at a snapshot, `has_snapshot`)."""
        return cls(
            config.max_num_seqs,
            pool.num_slots - config.max_num_seqs - 1,
            config.page_size,
            None if prefix_cache is None else prefix_cache.page_keys,
            host,
        )

    @property
    def num_stored(self) -> int:
        return len(self._stored)

    @property
    def num_held(self) -> int:
        """Working slots held by requests (0 once none runs)."""
        return len(self._held)

    def has_snapshot(self, key: bytes) -> bool:
        return key in self._stored or (self.host is not None and self.host.has_state(key))

    def admit(self, request: Request, num_cached_tokens: int) -> None:
        """Gives a request being admitted its working slot, holding the state after its
        `num_cached_tokens` cached tokens: a copy of the snapshot the prefix cache matched
        at that page, or the zero state."""
        assert request.request_id not in self._held, "a request is admitted once at a time"
        working = self._free_working.pop()
        self._held[request.request_id] = _Held(working)
        first_admission = request.num_preemptions == 0
        if first_admission:
            self.snapshot_queries += 1
        if num_cached_tokens == 0:
            self._ops.append(SlotOp(working))
            return
        assert self.page_keys is not None, "a prefix hit needs the prefix cache"
        key = self.page_keys(request, num_cached_tokens // self.page_size)[
            num_cached_tokens // self.page_size - 1
        ]
        snapshot = self._stored.get(key)  # `PrefixCache.match` stopped at one
        if snapshot is not None:
            self._stored.move_to_end(key)
            self._ops.append(SlotOp(working, snapshot))
        else:  # in host memory, kept there since the match (copied now, before the step)
            restored = self.host is not None and self.host.reload_state(key, working)
            assert restored, f"the snapshot at {num_cached_tokens} tokens went missing"
        if first_admission:
            self.snapshot_hits += 1

    def sequences(self, chunks: Sequence[ScheduledChunk]) -> list[SequenceStates]:
        """The step's working slot and captures of each chunk, in order."""
        return [self._sequence(chunk) for chunk in chunks]

    def step_ran(self) -> None:
        """The forward of the step `sequences` last described has run: the snapshots it
        wrote at images and prompt ends go to the store (the latest boundary's stays with
        its request, which rewrites it)."""
        for held in self._held.values():
            for capture in held.pinned:
                self._store(capture)
            held.pinned = []

    def take_ops(self) -> list[SlotOp]:
        """The slot clears and copies recorded since the last call, in order (the planner
        takes them into the step plan)."""
        ops, self._ops = self._ops, []
        return ops

    def rewind(self, request: Request, num_computed_tokens: int) -> None:
        """The step that was to take the request past `num_computed_tokens` raised: the
        snapshots it was to write are dropped."""
        held = self._held.get(request.request_id)
        if held is None:
            return
        for capture in held.pinned:
            if capture.position > num_computed_tokens:
                self._free_snapshots.append(capture.slot)
        held.pinned = [c for c in held.pinned if c.position <= num_computed_tokens]
        if held.rolling is not None and held.rolling.position > num_computed_tokens:
            self._free_snapshots.append(held.rolling.slot)
            held.rolling = None

    def preempt(self, request: Request) -> None:
        """Its snapshots go to the store (its recompute resumes from its latest one);
        its working slot is free."""
        self.release(request)

    def release(self, request: Request) -> None:
        held = self._held.pop(request.request_id, None)
        if held is None:
            return
        self._free_working.append(held.working)
        captures = held.pinned + ([held.rolling] if held.rolling is not None else [])
        for capture in captures:
            self._store(capture)

    # -- internals ----------------------------------------------------------------------

    def _sequence(self, chunk: ScheduledChunk) -> SequenceStates:
        request = chunk.request
        held = self._held[request.request_id]
        if self.num_snapshots == 0:
            return SequenceStates(held.working, chunk.num_tokens)
        size = self.page_size
        first, last = chunk.start // size + 1, chunk.end // size  # boundaries in (start, end]
        if first > last:
            return SequenceStates(held.working, chunk.num_tokens)
        keys = self.page_keys(request, last) if self.page_keys is not None else []
        pinned = {_floor(i.offset, size) for i in request.images}
        pinned |= {_floor(i.end, size) for i in request.images}
        pinned.add(_floor(request.prompt_len - 1, size))
        captures = []
        for boundary in sorted(b for b in pinned if first * size <= b <= last * size and b > 0):
            key = keys[boundary // size - 1]
            if key in self._stored:
                continue
            slot = self._snapshot_slot()
            if slot is None:
                break
            capture = _Capture(boundary, slot, key)
            held.pinned.append(capture)
            captures.append((boundary - chunk.start, slot))
        boundary = last * size
        if not captures or captures[-1][0] != boundary - chunk.start:
            rolling = held.rolling
            if rolling is None:
                slot = self._snapshot_slot()
                rolling = None if slot is None else _Capture(boundary, slot, keys[last - 1])
            else:
                rolling.position, rolling.key = boundary, keys[last - 1]
            held.rolling = rolling
            if rolling is not None:
                captures.append((boundary - chunk.start, rolling.slot))
        return SequenceStates(held.working, chunk.num_tokens, tuple(captures))

    def _snapshot_slot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used stored one if need be."""
        if self._free_snapshots:
            return self._free_snapshots.pop()
        if self._stored:
            key, slot = self._stored.popitem(last=False)
            if self.host is not None:
                self.host.spill_state(key, slot)
            return slot
        return None

    def _store(self, capture: _Capture) -> None:
        """The snapshot becomes the store's (or is dropped: one is there under its key)."""
        if capture.key in self._stored:
            self._stored.move_to_end(capture.key)
            self._free_snapshots.append(capture.slot)
            return
        self._stored[capture.key] = capture.slot


def _floor(tokens: int, page_size: int) -> int:
    return tokens // page_size * page_size
