"""One request's KV state: its pages, how many of its tokens they hold, its prefix keys.

The `BatchPlanner`, the `PrefixCache` and, for the ids it names pages by, the
`KvEventLog` are the only writers, through the methods below; the model runner and the attention code only read `pages`. A page's references
are the `PagePool`'s; the table lists the pages this request holds one on.

`num_computed_tokens` counts the tokens whose KV is in the pages *once the planned step
has run*: the planner advances it when it plans a chunk, and the step runs before the
next `schedule`, so between steps it is exact. A step that raises is taken back
(`rewind`) before its requests are released, so the prefix cache never registers a page
whose KV that step was to write. The planner sets progress because it also resets it:
a prefix-cache hit starts it at the cached tokens, a preemption drops it to zero.

The table lives as long as its request, across preemptions, so per-sequence state that
only grows with it (the prefix key chain, the runs of consecutive pages) is kept here
rather than rebuilt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PageRun = tuple[int, int]  # (first page, number of consecutive pages)


class PageTable:
    def __init__(self) -> None:
        self._pages: list[int] = []
        self._runs: list[PageRun] = []
        self._num_computed_tokens = 0
        self._keys: list[bytes] = []
        self._num_registered_pages = 0
        self._event_ids: list[int] = []
        self._num_announced_pages = 0
        self._epoch = 0

    @property
    def epoch(self) -> int:
        """Changes whenever `pages` is replaced rather than extended (`admit`, `release`):
        another process that mirrors the table resends it whole (tensor parallelism)."""
        return self._epoch

    @property
    def pages(self) -> Sequence[int]:
        """The pages holding the request's tokens in order: page `i` holds tokens
        `i * page_size ..`; the last ones may be reserved for the step being planned."""
        return self._pages

    @property
    def runs(self) -> Sequence[PageRun]:
        """`pages` grouped into maximal runs of consecutive ids, kept as pages are added
        (attention reads each run in place; `free_pages.py` keeps them few)."""
        return self._runs

    @property
    def last_page(self) -> int | None:
        return self._pages[-1] if self._pages else None

    @property
    def num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    @property
    def keys(self) -> Sequence[bytes]:
        """The prefix-cache key chain of the request's first full pages. Tokens only ever
        append, so a key never changes and the chain survives preemption."""
        return self._keys

    @property
    def num_registered_pages(self) -> int:
        """How many leading pages are registered in the prefix cache (or found there)."""
        return self._num_registered_pages

    @property
    def event_ids(self) -> Sequence[int]:
        """The ids KV events name the first full pages by (`kv_events.py`), a chain like
        `keys` that survives preemption."""
        return self._event_ids

    @property
    def num_announced_pages(self) -> int:
        """How many leading registered pages the KV events have announced since the table
        last held pages."""
        return self._num_announced_pages

    # -- the planner --------------------------------------------------------------------

    def admit(self, cached: list[int], num_cached_tokens: int, new: list[int]) -> None:
        """Starts an empty table from a prefix-cache hit: the `cached` full pages hold
        `num_cached_tokens` computed tokens and are registered already; `new` follow."""
        assert not self._pages, "a table is admitted only while it holds no pages"
        self._pages = cached + new
        self._runs = page_runs(self._pages)
        self._epoch += 1
        self._num_computed_tokens = num_cached_tokens
        self._num_registered_pages = len(cached)
        self._num_announced_pages = 0

    def extend(self, pages: list[int]) -> None:
        self._pages.extend(pages)
        _append_runs(self._runs, pages)

    def advance(self, num_tokens: int) -> None:
        """Counts `num_tokens` more as computed: the planner has put them in the step."""
        self._num_computed_tokens += num_tokens

    def rewind(self, num_computed_tokens: int) -> None:
        """Takes back a planned step that did not run (it raised): only the first
        `num_computed_tokens` tokens hold their KV. Registered pages lie below them (they
        were registered from earlier progress), so registration stays as it is."""
        assert num_computed_tokens <= self._num_computed_tokens, "rewind only goes back"
        self._num_computed_tokens = num_computed_tokens

    def release(self) -> list[int]:
        """Empties the table (nothing computed, nothing registered) and returns the pages
        it held, for the caller to drop its references on. The key chain stays."""
        pages, self._pages = self._pages, []
        self._runs = []
        self._epoch += 1
        self._num_computed_tokens = 0
        self._num_registered_pages = 0
        self._num_announced_pages = 0
        return pages

    # -- the prefix cache ---------------------------------------------------------------

    def add_key(self, key: bytes) -> None:
        """Appends the key of the next full page to the chain."""
        self._keys.append(key)

    def mark_registered(self, num_pages: int) -> None:
        """Records that the first `num_pages` pages are now registered."""
        assert num_pages >= self._num_registered_pages, "registration only grows"
        self._num_registered_pages = num_pages

    # -- the KV events ------------------------------------------------------------------

    def add_event_id(self, block_id: int) -> None:
        self._event_ids.append(block_id)

    def mark_announced(self, num_pages: int) -> None:
        assert num_pages <= self._num_registered_pages, "only registered pages are announced"
        self._num_announced_pages = num_pages


def page_runs(pages: Iterable[int]) -> list[PageRun]:
    """`pages` grouped into maximal runs of consecutive ids, in order."""
    runs: list[PageRun] = []
    _append_runs(runs, pages)
    return runs


def _append_runs(runs: list[PageRun], pages: Iterable[int]) -> None:
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
