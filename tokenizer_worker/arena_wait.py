"""The requests waiting for room in a full arena: backpressure instead of a 503.

A request whose images find the arena full of pinned entries waits here, holding nothing:
its own pins are dropped at once (their entries stay cached), so two waiting requests can
never each hold part of the room the other needs. When pins come back, the oldest waiting
request is tried again from the start (its images so far are cache hits, unless
evicted), then the next while they fit; one that still finds no room keeps its place and
its deadline, and those behind it wait too, so a large request is not starved by smaller
ones. New requests are tried at once. At its deadline a request gets a 503; an abort
drops it without an answer.
"""

from __future__ import annotations

from collections import OrderedDict

from ..ipc.messages import TokenizeRequest


class NoRoom(Exception):
    """The arena is full of pinned entries; the request, its pins dropped, needs at least
    `needed` bytes of it (its images so far and the one that found no room)."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class WaitingRequests:
    """Oldest first, each with its deadline (`time.monotonic()` seconds)."""

    def __init__(self) -> None:
        self._queue: OrderedDict[str, tuple[TokenizeRequest, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, request: TokenizeRequest, deadline: float) -> None:
        self._queue[request.request_id] = (request, deadline)

    def first(self) -> TokenizeRequest | None:
        return next(iter(self._queue.values()))[0] if self._queue else None

    def remove(self, request_id: str) -> TokenizeRequest | None:
        waiting = self._queue.pop(request_id, None)
        return None if waiting is None else waiting[0]

    def expired(self, now: float) -> list[TokenizeRequest]:
        """Removes and returns the requests whose deadline is `now` or earlier."""
        late = [rid for rid, (_, deadline) in self._queue.items() if deadline <= now]
        return [self._queue.pop(rid)[0] for rid in late]

    def next_deadline(self) -> float | None:
        return min((deadline for _, deadline in self._queue.values()), default=None)
