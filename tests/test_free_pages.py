"""Page placement keeps each sequence's pages in few runs of consecutive ids, which is
what lets attention read them in place (scheduler/attention/sdpa.py)."""

from iris_serve.scheduler.kv.free_pages import FreePages
from iris_serve.scheduler.kv.kv_cache import PagePool
from iris_serve.scheduler.kv.page_table import page_runs


def test_sequences_growing_in_turns_each_stay_one_run():
    free = FreePages(64)
    sequences = [free.take(2) for _ in range(4)]
    for _ in range(6):  # decode growth, one page at a time, interleaved
        for pages in sequences:
            pages.extend(free.take(1, after=pages[-1]))
    assert [len(page_runs(p)) for p in sequences] == [1, 1, 1, 1]
    assert len(free) == 64 - 4 * 8


def test_a_new_sequence_lands_mid_gap_leaving_room_before_it():
    free = FreePages(100)
    first = free.take(10)
    assert first == list(range(10))  # an empty pool: from the start
    second = free.take(10)
    assert second[0] == 10 + (90 - 10) // 2  # the gap after `first` is split
    assert free.take(5, after=first[-1]) == list(range(10, 15))


def test_pages_come_from_several_gaps_when_no_gap_is_large_enough():
    free = FreePages(10)
    taken = free.take(10)
    for page in (1, 2, 6, 7, 8):
        free.put(page)
    pages = free.take(5)
    assert sorted(pages) == [1, 2, 6, 7, 8]
    assert page_runs(pages) == [(6, 3), (1, 2)]  # the largest gap first
    assert len(free) == 0 and len(taken) == 10


def test_growth_in_place_stops_at_a_taken_page():
    free = FreePages(8)
    free.take(8)
    for page in (2, 5, 6):
        free.put(page)
    assert free.take(1, after=1) == [2]
    assert free.take(2, after=3) == [5, 6]  # page 4 is taken: placed elsewhere


def test_the_pool_hands_out_consecutive_pages_to_a_growing_sequence():
    pool = PagePool(16)
    pages = pool.allocate(2)
    other = pool.allocate(2)
    for _ in range(3):
        pages += pool.allocate(1, after=pages[-1])
        other += pool.allocate(1, after=other[-1])
    assert len(page_runs(pages)) == 1 and len(page_runs(other)) == 1
