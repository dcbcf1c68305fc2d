"""The image-aware prefix cache on fake requests (no model): keys, refcounts, eviction."""

from __future__ import annotations

import random

from iris_serve.ipc.messages import ImageRef, Sampling
from iris_serve.scheduler.kv.kv_cache import PagePool
from iris_serve.scheduler.kv.prefix_cache import PrefixCache, image_overlaps, page_key, token_bytes
from iris_serve.scheduler.step.batch_planner import BatchPlanner
from iris_serve.scheduler.step.request import Request

PAGE = 4
IMAGE = 99  # placeholder token id
KEY_A, KEY_B = b"A" * 16, b"B" * 16


def image(key: bytes, offset: int, length: int) -> ImageRef:
    return ImageRef(key, offset, length, (1, 2, 2 * length))


def request(name: str, tokens: list[int], images: list[ImageRef] | None = None) -> Request:
    return Request(name, list(tokens), Sampling(max_tokens=100), images or [])


def planner(num_pages: int, budget: int = 100, seqs: int = 8) -> BatchPlanner:
    pool = PagePool(num_pages)
    return BatchPlanner(pool, PAGE, budget, seqs, PrefixCache(pool, PAGE))


def run_step(planner: BatchPlanner) -> dict[str, tuple[int, int]]:
    """Schedules one step and pretends the model ran it, sampling token 7 where due."""
    plan = planner.schedule()
    for chunk in plan.chunks:
        if chunk.end == chunk.request.num_tokens:
            chunk.request.output_token_ids.append(7)
    return {c.request.request_id: (c.start, c.num_tokens) for c in plan.chunks}


def computed_and_finished(planner: BatchPlanner, r: Request) -> Request:
    """Runs `r` alone through its prefill, then finishes it (its full pages stay cached)."""
    planner.add(r)
    while r.page_table.num_computed_tokens < r.prompt_len:
        run_step(planner)
    planner.release(r)
    return r


# --- keys --------------------------------------------------------------------------------


def test_page_key_is_deterministic_and_every_part_changes_it():
    tokens = token_bytes([1, 2, IMAGE, IMAGE])
    base = page_key(b"", tokens, [(KEY_A, 0, 2)])
    assert base == page_key(b"", token_bytes([1, 2, IMAGE, IMAGE]), [(KEY_A, 0, 2)])
    assert len(base) == 16
    variants = [
        page_key(b"p" * 16, tokens, [(KEY_A, 0, 2)]),  # another parent
        page_key(b"", token_bytes([1, 3, IMAGE, IMAGE]), [(KEY_A, 0, 2)]),  # another token
        page_key(b"", tokens, [(KEY_B, 0, 2)]),  # another image
        page_key(b"", tokens, [(KEY_A, 1, 3)]),  # another part of the same image
        page_key(b"", tokens, []),  # no image
        page_key(tokens, b"", [(KEY_A, 0, 2)]),  # the same bytes, cut elsewhere
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_image_overlap_is_relative_to_the_image_and_limited_to_the_page():
    img = image(KEY_A, offset=2, length=7)  # tokens 2..8: pages 0, 1 and 2
    assert image_overlaps([img], 0, 4) == [(KEY_A, 0, 2)]
    assert image_overlaps([img], 4, 8) == [(KEY_A, 2, 6)]
    assert image_overlaps([img], 8, 12) == [(KEY_A, 6, 7)]
    assert image_overlaps([img], 12, 16) == []


def test_keys_chain_so_an_image_changes_its_pages_and_every_later_one():
    tokens = [1, 2, 3, 4, 5, IMAGE, IMAGE, IMAGE, IMAGE, 6, 7, 8, 9, 10, 11, 12]
    cache = PrefixCache(PagePool(8), PAGE)
    a = cache.page_keys(request("a", tokens, [image(KEY_A, 5, 4)]), 4)
    b = cache.page_keys(request("b", tokens, [image(KEY_B, 5, 4)]), 4)
    assert a[0] == b[0]  # tokens 0..3 hold no image
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))
    again = cache.page_keys(request("a2", tokens, [image(KEY_A, 5, 4)]), 4)
    assert again == a


# --- matching ----------------------------------------------------------------------------


def test_same_tokens_with_another_image_share_only_the_pages_before_it():
    tokens = [1, 2, 3, 4, 5, *[IMAGE] * 6, 6, 7, 8, 9, 10]  # image on pages 1 and 2
    p = planner(16)
    computed_and_finished(p, request("first", tokens, [image(KEY_A, 5, 6)]))
    assert p.pool.num_cached == 4

    other = request("other-image", tokens, [image(KEY_B, 5, 6)])
    same = request("same-image", tokens, [image(KEY_A, 5, 6)])
    assert len(p.prefix_cache.match(other).pages) == 1
    assert len(p.prefix_cache.match(same).pages) == 3  # all but the page of the last token

    p.add(other)
    assert run_step(p) == {"other-image": (4, 12)}
    assert other.num_cached_tokens == 4
    # The image pages of the two requests are different pages.
    first_image_pages = set(p.prefix_cache.match(same).pages[1:3])
    assert first_image_pages.isdisjoint(other.page_table.pages)


def test_only_full_computed_pages_are_registered_decode_pages_included():
    p = planner(16)
    r = request("r", list(range(10)))
    p.add(r)
    run_step(p)  # 10 prompt tokens computed: pages 0 and 1 full, page 2 half
    run_step(p)  # registration of the last step's pages happens at the next schedule
    assert p.pool.num_cached == 2
    run_step(p)  # computes token 11: page 2 (tokens 8..11) is full
    run_step(p)
    assert p.pool.num_cached == 3
    tokens = r.token_ids(0, 12)  # prompt plus two sampled tokens
    p.release(r)
    assert len(p.prefix_cache.match(request("next-turn", [*tokens, 50])).pages) == 3


def test_the_last_token_is_never_served_from_the_cache():
    p = planner(16)
    computed_and_finished(p, request("warm", list(range(8))))
    exact = request("exact", list(range(8)))
    longer = request("longer", list(range(9)))
    p.add(exact)
    p.add(longer)
    # 8 cached tokens: `exact` recomputes its whole last page to get logits.
    assert run_step(p) == {"exact": (4, 4), "longer": (8, 1)}
    assert exact.num_cached_tokens == 4 and longer.num_cached_tokens == 8
    assert p.prefix_cache.hit_tokens == 12
    assert p.prefix_cache.query_tokens == 8 + 8 + 9  # every prompt token looked up counts


def test_disabled_cache_matches_and_registers_nothing():
    pool = PagePool(16)
    p = BatchPlanner(pool, PAGE, 100, 8)
    computed_and_finished(p, request("a", list(range(9))))
    r = request("b", list(range(9)))
    p.add(r)
    assert run_step(p) == {"b": (0, 9)}
    assert pool.num_cached == 0 and r.num_cached_tokens == 0


# --- refcounts, sharing, eviction ----------------------------------------------------------


def test_shared_pages_are_counted_and_outlive_one_holder():
    p = planner(8)
    pool = p.pool
    computed_and_finished(p, request("warm", list(range(9))))
    b, c = request("b", list(range(9))), request("c", list(range(9)))
    p.add(b)
    p.add(c)
    assert run_step(p) == {"b": (8, 1), "c": (8, 1)}
    shared = b.page_table.pages[:2]
    assert c.page_table.pages[:2] == shared and [pool.refcount(x) for x in shared] == [2, 2]
    assert pool.num_free == 8 - 4  # two shared pages + one private page each
    p.release(b)
    assert [pool.refcount(x) for x in shared] == [1, 1] and pool.num_free == 5
    p.release(c)
    assert pool.num_free == pool.num_pages and pool.num_evictable == pool.num_cached


def test_allocation_takes_free_pages_first_then_evicts_least_recently_released():
    pool = PagePool(6)
    held = pool.allocate(4)
    for page in held:
        pool.cache(page, bytes([page]) * 16, token_bytes([page]))
    pool.free(held[:2])  # released tail-first: held[1] is older than held[0]
    pool.free(held[2:])
    assert pool.num_free == 6 and pool.num_evictable == 4

    assert sorted(pool.allocate(2)) == [4, 5]  # the never-cached pages go first
    assert pool.allocate(1) == [held[1]]
    assert pool.lookup(bytes([held[1]]) * 16, token_bytes([held[1]])) is None  # key dropped
    pool.share([held[0]])  # a hit takes it out of the eviction order...
    pool.free([held[0]])  # ...and its release makes it the most recent
    assert pool.allocate(2) == [held[3], held[2]]
    assert pool.allocate(1) == [held[0]]
    assert pool.num_free == 0 and pool.num_cached == 0 and pool.num_evictions == 4


def test_a_hit_checks_the_stored_tokens_not_only_the_key():
    pool = PagePool(2)
    [page] = pool.allocate(1)
    assert pool.cache(page, KEY_A, token_bytes([1, 2, 3, 4]))
    assert pool.lookup(KEY_A, token_bytes([1, 2, 3, 4])) == page
    assert pool.lookup(KEY_A, token_bytes([1, 2, 3, 5])) is None  # a (made-up) collision
    [other] = pool.allocate(1)
    assert not pool.cache(other, KEY_A, token_bytes([1, 2, 3, 4]))  # first owner stays


def test_preempting_a_request_frees_no_page_another_request_holds():
    p = planner(5)
    pool = p.pool
    prefix = [10, 11, 12, 13, 14, 15, 16, 17]
    computed_and_finished(p, request("warm", prefix))
    a, b = request("a", [*prefix, 1]), request("b", [*prefix, 2, 3])
    p.add(a)
    p.add(b)
    assert run_step(p) == {"a": (8, 1), "b": (8, 2)}
    shared = a.page_table.pages[:2]
    assert b.page_table.pages[:2] == shared
    for _ in range(3):  # b crosses into its fourth page and takes the last free one
        run_step(p)
    assert len(b.page_table.pages) == 4 and pool.num_free == 0
    plan = p.schedule()  # a needs a fourth page: b, the newest, is preempted
    assert plan.preempted == [b] and b.page_table.pages == []
    assert [pool.refcount(x) for x in shared] == [1, 1] and a.page_table.pages[:2] == shared
    assert len(a.page_table.pages) == 4 and pool.num_free == 1  # b's full third page, now evictable
    for chunk in plan.chunks:
        chunk.request.output_token_ids.append(7)

    p.release(a)
    # b comes back and finds its prompt and the page it computed before preemption.
    assert run_step(p) == {"b": (12, 2)}
    assert b.num_cached_tokens == 8  # what usage reports: the first admission's hit
    assert p.prefix_cache.hit_tokens == 8 + 8
    assert p.prefix_cache.query_tokens == 8 + 9 + 10  # b's second admission is not a query
    p.release(b)
    assert pool.num_free == pool.num_pages


def test_200_random_requests_with_constant_evictions_leak_nothing():
    """A fake model writes each token's "KV" (a fingerprint of the prefix so far) into its
    slot; every chunk checks the KV it reads, cached or not, is its own prefix's."""
    rng = random.Random(0)
    p = planner(12, budget=8, seqs=4)
    pool = p.pool
    families = [[rng.randrange(50) for _ in range(16)] for _ in range(4)]
    kv: dict[int, int] = {}

    def fingerprints(r: Request) -> list[int]:
        keys = [None] * r.num_tokens
        for img in r.images:
            keys[img.offset : img.end] = [img.key] * img.length
        out, fp = [], 0
        for i, token in enumerate(r.token_ids(0, r.num_tokens)):
            fp = hash((fp, token, keys[i]))
            out.append(fp)
        return out

    def new_request(i: int) -> Request:
        tokens = rng.choice(families)[: rng.randrange(17)]
        tokens += [rng.randrange(50) for _ in range(rng.randrange(1, 11))]
        images = []
        if len(tokens) >= 10 and rng.random() < 0.6:
            tokens[3:9] = [IMAGE] * 6
            images = [image(rng.choice([KEY_A, KEY_B]), 3, 6)]
        r = request(f"r{i}", tokens, images)
        r.sampling = Sampling(max_tokens=rng.randrange(1, 7))
        return r

    def check_refcounts() -> None:
        holders = [0] * pool.num_pages
        for r in p.running:
            for page in r.page_table.pages:
                holders[page] += 1
        assert holders == [pool.refcount(x) for x in range(pool.num_pages)]
        assert pool.num_free == pool.num_pages - sum(1 for h in holders if h)

    pending = [new_request(i) for i in range(200)]
    live: list[Request] = []
    finished = 0
    while pending or p.has_work():
        for _ in range(rng.randrange(3)):
            if pending:
                live.append(pending.pop(0))
                p.add(live[-1])
        if live and rng.random() < 0.03:  # an abort, running or waiting
            victim = live.pop(rng.randrange(len(live)))
            p.release(victim)
        plan = p.schedule()
        for chunk in plan.chunks:
            r, expected = chunk.request, fingerprints(chunk.request)
            for i in range(chunk.end):
                page = r.page_table.pages[i // PAGE]
                slot = page * PAGE + i % PAGE
                if i < chunk.start:
                    assert kv[slot] == expected[i], f"{r.request_id} reads wrong KV at {i}"
                else:
                    assert pool.refcount(page) == 1 and not pool.is_cached(page)
                    kv[slot] = expected[i]
            if chunk.completes_sequence:
                r.output_token_ids.append(rng.randrange(50))
                if len(r.output_token_ids) >= r.sampling.max_tokens:
                    p.release(r)
                    live.remove(r)
                    finished += 1
        check_refcounts()

    assert finished > 150 and p.num_preemptions > 0
    assert pool.num_evictions > 200 and p.prefix_cache.hit_tokens > 100
    assert pool.num_free == pool.num_pages and pool.num_evictable == pool.num_cached
    assert all(pool.refcount(x) == 0 for x in range(pool.num_pages))
