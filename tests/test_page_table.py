"""A request's page table on its own: what admission, growth and release leave in it."""

from iris_serve.scheduler.kv.page_table import PageTable


def test_admission_starts_from_the_cached_prefix_and_release_empties_all_but_the_keys():
    table = PageTable()
    table.add_key(b"k0")
    table.admit([3, 5], 8, [9])  # two cached pages of 4 tokens, one fresh page
    assert table.pages == [3, 5, 9] and table.num_computed_tokens == 8
    assert table.num_registered_pages == 2
    table.advance(3)
    table.extend([1])
    table.mark_registered(3)
    assert table.pages == [3, 5, 9, 1] and table.num_computed_tokens == 11

    assert table.release() == [3, 5, 9, 1]
    assert table.pages == [] and table.num_computed_tokens == 0
    assert table.num_registered_pages == 0
    assert table.keys == [b"k0"]  # tokens only append: the chain outlives preemption
