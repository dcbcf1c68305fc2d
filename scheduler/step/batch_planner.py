"""Continuous batching: which tokens of which requests run in the next step
(`docs/design.md`, "The engine's step", plan).

Every request is "tokens computed so far" against "tokens it has" (prompt plus outputs);
a step gives each scheduled request a chunk of the difference: one token for a decode,
up to the remaining budget for a prefill. A preempted request is recomputed later from
its prompt and the tokens it produced, so nothing it returned changes. A request being
admitted (first time or after preemption) starts from its longest cached prefix.

The prefill a step carries is capped by the engine's `PrefillPacing` (pacing.py), asked
once per step (`caps`) and told what was planned (`planned`); without one, nothing caps
it but the token budget. A chunk runs only as far as `ready_until` allows (the encoder
manager's, `thread` placement): a request whose next tokens are an image still encoding
sits the step out, holding what it has; one waiting to be admitted lets those behind it
in.

The plan also carries the device work its planning decided (`StepPlan.linear`,
`slot_ops`, `host_copies`), which the model runner applies on every rank alike.

Progress advances here, as a chunk is planned, not when the step's results are
accounted, so that admission, preemption and planning change a request's `PageTable` in
one place (see page_table.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..kv.kv_cache import PagePool
from ..kv.prefix_cache import PrefixCache, PrefixMatch
from .pacing import UNCAPPED
from .request import Request, RequestResources, RequestStatus

if TYPE_CHECKING:
    from ..hybrid.linear_state import SequenceStates
    from ..hybrid.state_slots import SlotOp, StateSlots
    from ..kv.host_tier import HostCopy, HostTier
    from .pacing import PrefillPacing


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token index computed in this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes_sequence(self) -> bool:
        """True when the step computes the request's last known token, so it samples."""
        return self.end == self.request.num_tokens


@dataclass
class StepPlan:
    """What a step runs, and the device work its planning decided, which every rank applies
    before the step's forward reads a page or a slot (`BatchPlanner._take_device_work`)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_decodes: int = 0  # chunks of one token of requests past their prompt
    # a hybrid model's: each chunk's linear-attention state slot and captures, in order
    linear: list[SequenceStates] | None = None
    # a hybrid model's: slot clears and copies (admissions), applied in order
    slot_ops: list[SlotOp] = field(default_factory=list)
    # the host tier's copies, made on rank 0 as planning decided them; the other
    # tensor-parallel ranks make them before their forward (and before `slot_ops`)
    host_copies: list[HostCopy] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks) - self.num_decodes


# How far a request's prefill may run from a token on, now (its images' readiness).
ReadyUntil = Callable[[Request, int], int]


class _ReloadFailed:
    """`_take_prefix`'s answer when a host-tier reload failed: nothing was taken."""


def _anywhere(request: Request, start: int) -> int:
    return request.num_tokens


class BatchPlanner(RequestResources):
    """Owns the waiting queue, the running set and every request's page table (its KV
    pages: `release` returns them; a preemption returns them as it happens).

    `state_slots` (a hybrid model's) hears of each admission and names each chunk's
    state slot; it and `host_tier` record the device work planning decides, which the
    planner hands over in the plan. A step that plans nothing, or whose forward never
    began (`defer_device_work`), leaves that work to the next plan."""

    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefix_cache: PrefixCache | None = None,
        ready_until: ReadyUntil = _anywhere,
        pacing: PrefillPacing | None = None,
        state_slots: StateSlots | None = None,
        host_tier: HostTier | None = None,
    ) -> None:
        self.pool = pool
        self.ready_until = ready_until
        self.state_slots = state_slots
        self.host_tier = host_tier
        self.pacing = pacing
        self.prefix_cache = prefix_cache
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # device work of a plan whose forward never began, for the next plan
        self._deferred_ops: list[SlotOp] = []
        self._deferred_copies: list[HostCopy] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        if self.prefix_cache is not None:
            for request in self.running:  # pages the last step filled
                self.prefix_cache.register(request)

        caps = UNCAPPED if self.pacing is None else self.pacing.caps()
        cap = caps.alone
        if any(_is_decoding(r) for r in self.running):
            cap = caps.with_decodes
        prefill_budget = budget if cap is None else cap
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            computed = request.page_table.num_computed_tokens
            num_tokens = min(_num_uncomputed(request), budget)
            decoding = _is_decoding(request)
            if not decoding:
                num_tokens = min(num_tokens, prefill_budget)
            num_tokens = min(num_tokens, self.ready_until(request, computed) - computed)
            if num_tokens <= 0:  # its next tokens are an image still being encoded
                index += 1
                continue
            fits = self._reserve_pages(request, num_tokens)
            if not fits and not self._preempt_until_fits(request, num_tokens, plan):
                continue  # `request` itself was preempted; the list shrank under `index`
            _plan_chunk(plan, request, num_tokens)
            budget -= num_tokens
            if decoding:
                plan.num_decodes += 1
            else:
                prefill_budget -= num_tokens
            index += 1

        for request in list(self.waiting) if not plan.preempted else []:
            room = min(budget, prefill_budget)
            if room <= 0 or len(self.running) >= self.max_num_seqs:
                break
            first_chunk = self._admit(request, room)
            if first_chunk is None:  # no pages: it and those behind it wait (FIFO)
                break
            if first_chunk == 0:  # its first tokens are an image still being encoded
                continue
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            _plan_chunk(plan, request, first_chunk)
            budget -= first_chunk
            prefill_budget -= first_chunk
        if plan.chunks:  # a step that runs carries the device work decided so far
            self._take_device_work(plan)
        if self.pacing is not None:
            self.pacing.planned(plan)
        return plan

    def defer_device_work(self, plan: StepPlan) -> None:
        """The plan's step failed before its forward began (encoding raised): no rank
        applied its slot ops or repeated its host copies, so they go with the next plan
        (rank 0 made the copies already; the other ranks' host blocks must follow)."""
        self._deferred_ops = plan.slot_ops + self._deferred_ops
        self._deferred_copies = plan.host_copies + self._deferred_copies
        plan.slot_ops, plan.host_copies = [], []

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of a waiting request that its admission would find in the prefix cache
        now (nothing is taken)."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.match(request).num_pages * self.page_size

    def release(self, request: Request) -> None:
        """Drop a request wherever it is and return its pages; safe to call twice."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free_pages(request)
        request.status = RequestStatus.FINISHED

    def rewind(self, request: Request, num_computed_tokens: int) -> None:
        """Sets back the progress of a request whose step raised to what the steps before
        computed (the failed one advanced it when planned), so releasing it registers
        none of the pages whose KV that step was to write."""
        request.page_table.rewind(num_computed_tokens)

    def _admit(self, request: Request, budget: int) -> int | None:
        """Gives a waiting request (it holds no pages) its cached prefix and the pages
        for its first chunk, and returns the chunk's size; with nothing taken, 0 when its
        first uncached tokens are an image not ready yet, None when the pages do not fit.
        A prefix partly in the host tier is reloaded into pages of its own; should a
        reload fail, the request takes the device part alone and computes the rest."""
        match = PrefixMatch() if self.prefix_cache is None else self.prefix_cache.match(request)
        taken = self._take_prefix(request, match, budget)
        if isinstance(taken, _ReloadFailed):
            taken = self._take_prefix(request, match.without_host(), budget)
        assert not isinstance(taken, _ReloadFailed), "nothing to reload: it cannot fail"
        return taken

    def _take_prefix(
        self, request: Request, match: PrefixMatch, budget: int
    ) -> int | _ReloadFailed | None:
        """`_admit` of one match: the chunk's size, 0, None, or `_ReloadFailed` (nothing
        taken)."""
        cached = match.pages
        num_cached_tokens = match.num_pages * self.page_size
        num_tokens = min(request.num_tokens - num_cached_tokens, budget)
        ready = self.ready_until(request, num_cached_tokens) - num_cached_tokens
        num_tokens = max(0, min(num_tokens, ready))
        if num_tokens == 0:
            return 0
        missing = -(-(num_cached_tokens + num_tokens) // self.page_size) - len(cached)
        revived = sum(1 for page in cached if self.pool.refcount(page) == 0)
        if missing > self.pool.num_free - revived:
            return None
        self.pool.share(cached)  # before allocating, so no allocation evicts them
        after = cached[-1] if cached else None
        new = self.pool.allocate(missing, after)
        reloaded = new[: len(match.host_keys)]
        if reloaded:
            assert self.prefix_cache is not None
            if not self.prefix_cache.reload(request, match, reloaded):
                self.pool.free(new)
                self.pool.free(cached)
                return _ReloadFailed()
        request.page_table.admit(cached + reloaded, num_cached_tokens, new[len(reloaded) :])
        if self.state_slots is not None:  # its working slot, from a snapshot or cleared
            self.state_slots.admit(request, num_cached_tokens)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached_tokens
            request.num_host_cached_tokens = len(reloaded) * self.page_size
            request.first_step_at = time.monotonic()
            request.queue_seconds = request.first_step_at - request.added_at
            if self.prefix_cache is not None:
                self.prefix_cache.count_first_admission(
                    num_cached_tokens, request.num_tokens, request.num_host_cached_tokens
                )
        return num_tokens

    def _take_device_work(self, plan: StepPlan) -> None:
        """Puts in the plan what its planning decided for the device: each chunk's state
        slot and captures (a capture may spill an older snapshot to the host tier, so
        these come first), the slot clears and copies of the admissions, and the host
        tier's copies (taking them starts a step for the tier)."""
        slots = self.state_slots
        if slots is not None:
            plan.linear = slots.sequences(plan.chunks)
            plan.slot_ops = self._deferred_ops + slots.take_ops()
            self._deferred_ops = []
        if self.host_tier is not None:
            plan.host_copies = self._deferred_copies + self.host_tier.take_copies()
            self._deferred_copies = []

    def _reserve_pages(self, request: Request, num_tokens: int) -> bool:
        table = request.page_table
        total_pages = -(-(table.num_computed_tokens + num_tokens) // self.page_size)
        missing = total_pages - len(table.pages)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            return False
        table.extend(self.pool.allocate(missing, after=table.last_page))
        return True

    def _preempt_until_fits(self, request: Request, num_tokens: int, plan: StepPlan) -> bool:
        """Preempt newest-first until `request` fits; False if `request` itself went."""
        while True:
            victim = self.running.pop()
            self._free_pages(victim)  # its progress too: it is recomputed from the start
            victim.status = RequestStatus.WAITING
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
            if self._reserve_pages(request, num_tokens):
                return True

    def _free_pages(self, request: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.register(request)  # what it computed outlives it
        self.pool.free(request.page_table.release())


def _is_decoding(request: Request) -> bool:
    """Past its prompt: a step gives it one token (prompt and outputs all computed but
    the last output; after a preemption it is prefilling again until then)."""
    return bool(request.output_token_ids) and _num_uncomputed(request) == 1


def _num_uncomputed(request: Request) -> int:
    return request.num_tokens - request.page_table.num_computed_tokens


def _plan_chunk(plan: StepPlan, request: Request, num_tokens: int) -> None:
    """Puts the request's next `num_tokens` tokens (their pages reserved) in the step."""
    table = request.page_table
    plan.chunks.append(ScheduledChunk(request, table.num_computed_tokens, num_tokens))
    table.advance(num_tokens)
