"""Continuous batching: which tokens of which requests run in the next step.

Every request is "tokens computed so far" against "tokens it has" (prompt plus outputs);
a step gives each scheduled request a chunk of the difference. A decode is a chunk of
one token, a prefill chunk is up to the remaining step budget, so decodes and prefill
chunks share a step and long prompts are split (chunked prefill).

Running requests go first, oldest first; waiting requests join while budget, sequence
slots and pages last. When a running request needs a page and none is free, the newest
running request is preempted: its pages go back to the pool and it is recomputed later
from its prompt and the tokens it already produced, so nothing it returned changes.

With a prefix cache, a request being admitted (first time or after preemption) starts
from the longest chain of cached full pages over its tokens, shared by reference; the
pages a request fills are registered as it computes them and when it leaves.

A request's pages and progress are its `PageTable`; the planner changes them (and the
prefix cache its registration) through the table's methods. Progress advances here, as
a chunk is planned, not when the step's results are accounted: admission and preemption
set it here too, so all of it happens in one place (see page_table.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from iris_serve.scheduler.kv_cache import PagePool
from iris_serve.scheduler.prefix_cache import PrefixCache
from iris_serve.scheduler.request import Request, RequestStatus


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
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class BatchPlanner:
    """Owns the waiting queue, the running set and every request's page table."""

    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

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

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = min(_num_uncomputed(request), budget)
            fits = self._reserve_pages(request, num_tokens)
            if not fits and not self._preempt_until_fits(request, num_tokens, plan):
                continue  # `request` itself was preempted; the list shrank under `index`
            _plan_chunk(plan, request, num_tokens)
            budget -= num_tokens
            index += 1

        while (
            not plan.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            if not self._admit(request, budget):
                break
            num_tokens = min(_num_uncomputed(request), budget)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            _plan_chunk(plan, request, num_tokens)
            budget -= num_tokens
        return plan

    def finish(self, request: Request) -> None:
        """Drop a request wherever it is and return its pages; safe to call twice."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED

    def fail(self, request: Request, num_computed_tokens: int) -> None:
        """Drops a request whose step raised: its progress goes back to what the steps
        before computed (the failed one advanced it when planned), so releasing it
        registers none of the pages whose KV that step was to write."""
        request.page_table.rewind(num_computed_tokens)
        self.finish(request)

    def _admit(self, request: Request, budget: int) -> bool:
        """Gives a waiting request (it holds no pages) its cached prefix and the pages
        for its first chunk; False, with nothing taken, when the pages do not fit."""
        cached = self.prefix_cache.match(request) if self.prefix_cache is not None else []
        num_cached_tokens = len(cached) * self.page_size
        num_tokens = min(request.num_tokens - num_cached_tokens, budget)
        missing = -(-(num_cached_tokens + num_tokens) // self.page_size) - len(cached)
        revived = sum(1 for page in cached if self.pool.refcount(page) == 0)
        if missing > self.pool.num_free - revived:
            return False
        self.pool.share(cached)  # before allocating, so no allocation evicts them
        after = cached[-1] if cached else None
        request.page_table.admit(cached, num_cached_tokens, self.pool.allocate(missing, after))
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached_tokens
            request.queue_seconds = time.monotonic() - request.added_at
            if self.prefix_cache is not None:
                self.prefix_cache.hit_tokens += num_cached_tokens
                self.prefix_cache.query_tokens += request.num_tokens
        return True

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
            self._release(victim)  # its progress too: it is recomputed from the start
            victim.status = RequestStatus.WAITING
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
            if self._reserve_pages(request, num_tokens):
                return True

    def _release(self, request: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.register(request)  # what it computed outlives it
        self.pool.free(request.page_table.release())


def _num_uncomputed(request: Request) -> int:
    return request.num_tokens - request.page_table.num_computed_tokens


def _plan_chunk(plan: StepPlan, request: Request, num_tokens: int) -> None:
    """Puts the request's next `num_tokens` tokens (their pages reserved) in the step."""
    table = request.page_table
    plan.chunks.append(ScheduledChunk(request, table.num_computed_tokens, num_tokens))
    table.advance(num_tokens)
