"""`StateSlots`: which linear-attention state slot is whose, and where snapshots are taken,
kept and restored (the bookkeeping; tests/test_qwen3_5_engine.py checks the states)."""

from __future__ import annotations

from iris_serve.ipc.messages import ImageRef, Sampling
from iris_serve.scheduler.hybrid.state_slots import SlotOp, StateSlots
from iris_serve.scheduler.kv.kv_cache import PagePool
from iris_serve.scheduler.kv.prefix_cache import PrefixCache
from iris_serve.scheduler.step.batch_planner import ScheduledChunk
from iris_serve.scheduler.step.request import Request

PAGE = 4
WORKING = 2


def make_slots(num_snapshots: int = 4) -> StateSlots:
    cache = PrefixCache(PagePool(64), PAGE)
    return StateSlots(WORKING, num_snapshots, PAGE, cache.page_keys)


def make_request(name: str, num_tokens: int, images: list[ImageRef] | None = None) -> Request:
    return Request(name, list(range(1, num_tokens + 1)), Sampling(), images=images or [])


def image(offset: int, length: int) -> ImageRef:
    return ImageRef(key=b"k" * 16, offset=offset, length=length, grid_thw=(1, 2, 2 * length))


def distinct(name: str, num_tokens: int) -> Request:
    """A request whose first token (so every page key) differs from the others'."""
    request = make_request(name, num_tokens)
    request.prompt_token_ids[0] = 1000 + sum(map(ord, name))
    return request


def step(slots: StateSlots, request: Request, start: int, end: int):
    """Plans and runs one chunk: what the model is told for it."""
    [sequence] = slots.sequences([ScheduledChunk(request, start, end - start)])
    slots.step_ran()
    return sequence


def test_a_fresh_admission_clears_its_own_working_slot_and_release_returns_it() -> None:
    slots = make_slots()
    first, second = make_request("a", 10), make_request("b", 10)
    slots.admit(first, 0)
    slots.admit(second, 0)
    ops = slots.take_ops()
    assert [op.source for op in ops] == [None, None]
    assert sorted(op.target for op in ops) == [0, 1]  # the working slots
    slots.release(first)
    third = make_request("c", 10)
    slots.admit(third, 0)
    assert slots.take_ops() == [SlotOp(ops[0].target)]  # the slot `first` gave back


def test_prefill_captures_the_prompt_end_and_the_latest_page_boundary() -> None:
    slots = make_slots()
    request = make_request("a", 15)  # prompt end floors to 12 (its last token is 14)
    slots.admit(request, 0)
    sequence = step(slots, request, 0, 10)  # boundaries 4 and 8: the latest one, 8
    assert sequence.num_tokens == 10 and [k for k, _ in sequence.captures] == [8]
    sequence = step(slots, request, 10, 15)  # boundary 12: the prompt's end
    assert [k for k, _ in sequence.captures] == [2]


def test_an_image_is_bracketed_mid_chunk_and_offered_once_the_step_ran() -> None:
    slots = make_slots()
    request = make_request("a", 30, [image(offset=6, length=5)])  # tokens 6..11
    slots.admit(request, 0)
    keys = slots.page_keys(request, 7)
    [sequence] = slots.sequences([ScheduledChunk(request, 0, 20)])
    assert [k for k, _ in sequence.captures] == [4, 8, 20]  # before, in it, the latest
    assert not slots.has_snapshot(keys[0]) and not slots.has_snapshot(keys[1])  # not run yet
    slots.step_ran()
    assert slots.has_snapshot(keys[0]) and slots.has_snapshot(keys[1])
    step(slots, request, 20, 24)
    assert not slots.has_snapshot(keys[4])  # the rolling one stays with its request
    slots.release(request)
    assert slots.has_snapshot(keys[5])  # ...until it ends: where it stopped, 24


def test_a_hit_restores_a_copy_of_the_snapshot_and_counts_it() -> None:
    slots = make_slots()
    first = make_request("a", 9)
    slots.admit(first, 0)
    [(_, snapshot)] = step(slots, first, 0, 9).captures  # prompt end: 8
    slots.release(first)
    slots.take_ops()
    second = make_request("b", 12)  # the same first 8 tokens
    slots.admit(second, 8)
    [op] = slots.take_ops()
    assert op.source == snapshot and op.target < WORKING
    assert (slots.snapshot_hits, slots.snapshot_queries) == (1, 2)
    assert slots.has_snapshot(slots.page_keys(second, 2)[1])  # a restore copies


def test_a_failed_step_drops_the_snapshots_it_was_to_write() -> None:
    slots = make_slots()
    request = make_request("a", 30, [image(offset=0, length=5)])
    slots.admit(request, 0)
    keys = slots.page_keys(request, 7)
    slots.sequences([ScheduledChunk(request, 0, 12)])  # captures 4 (image end), 12 (latest)
    slots.rewind(request, 0)  # its forward raised
    slots.release(request)
    assert not slots.has_snapshot(keys[0]) and not slots.has_snapshot(keys[2])
    assert slots.num_stored == 0
    # every snapshot slot is free again: four captures fit
    for name in "bcde":
        other = distinct(name, 9)
        slots.admit(other, 0)
        assert step(slots, other, 0, 8).captures
        slots.release(other)
    assert slots.num_stored == 4


def test_a_hit_makes_a_snapshot_recent_and_the_least_recently_used_one_makes_room() -> None:
    slots = make_slots(num_snapshots=2)
    old, recent = distinct("old", 9), distinct("recent", 9)
    for request in (old, recent):
        slots.admit(request, 0)
        step(slots, request, 0, 9)  # prompt end: 8
        slots.release(request)
    old_key, recent_key = (slots.page_keys(r, 2)[1] for r in (old, recent))
    again = distinct("old", 12)  # `old`'s tokens: its hit makes `old` the recent one
    slots.admit(again, 8)
    slots.release(again)
    newcomer = distinct("new", 9)
    slots.admit(newcomer, 0)
    assert step(slots, newcomer, 0, 9).captures
    assert slots.has_snapshot(old_key) and not slots.has_snapshot(recent_key)


def test_snapshots_their_requests_still_write_are_never_evicted() -> None:
    cache = PrefixCache(PagePool(64), PAGE)
    slots = StateSlots(3, 2, PAGE, cache.page_keys)
    a, b, c = distinct("a", 20), distinct("b", 20), distinct("c", 20)
    for request in (a, b, c):
        slots.admit(request, 0)
    assert step(slots, a, 0, 5).captures and step(slots, b, 0, 5).captures
    assert step(slots, c, 0, 5).captures == ()  # both snapshot slots are a's and b's
    assert step(slots, a, 5, 9).captures  # a's latest boundary moves on in its own slot
    slots.release(a)  # a's snapshot goes to the store: now it may make room
    assert step(slots, c, 5, 9).captures
    assert slots.num_stored == 0


def test_without_a_prefix_cache_nothing_is_captured() -> None:
    slots = StateSlots(WORKING, 4, PAGE, page_keys=None)
    request = make_request("a", 30)
    slots.admit(request, 0)
    assert step(slots, request, 0, 30).captures == ()
