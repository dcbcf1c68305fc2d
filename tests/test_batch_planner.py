"""Continuous batching and preemption, on fake requests (no model); the device work a
plan carries (a hybrid model's slot clears and copies, the host tier's copies)."""

import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.hybrid.state_slots import SlotOp, StateSlots
from iris_serve.scheduler.kv.host_tier import HostMemory, HostTier
from iris_serve.scheduler.kv.kv_cache import KVCache, KVLayout, PagePool
from iris_serve.scheduler.kv.prefix_cache import PrefixCache
from iris_serve.scheduler.step.batch_planner import BatchPlanner
from iris_serve.scheduler.step.core_sharing import CoreSharing
from iris_serve.scheduler.step.latency_budget import LatencyBudget
from iris_serve.scheduler.step.pacing import PrefillPacing
from iris_serve.scheduler.step.request import Request, RequestStatus

PAGE = 4


def request(name: str, prompt_len: int) -> Request:
    return Request(name, list(range(prompt_len)), Sampling(max_tokens=100))


def run_step(planner: BatchPlanner) -> dict[str, int]:
    """Schedules one step and pretends the model ran it, sampling token 7 where due."""
    plan = planner.schedule()
    for chunk in plan.chunks:
        if chunk.end == chunk.request.num_tokens:
            chunk.request.output_token_ids.append(7)
    return {c.request.request_id: c.num_tokens for c in plan.chunks}


def test_long_prompts_are_chunked_and_decodes_share_the_step():
    planner = BatchPlanner(PagePool(100), PAGE, max_num_batched_tokens=10, max_num_seqs=8)
    planner.add(request("short", 3))
    assert run_step(planner) == {"short": 3}
    planner.add(request("long", 25))
    assert run_step(planner) == {"short": 1, "long": 9}
    assert run_step(planner) == {"short": 1, "long": 9}
    assert run_step(planner) == {"short": 1, "long": 7}
    assert run_step(planner) == {"short": 1, "long": 1}


def test_max_num_seqs_bounds_the_running_set():
    planner = BatchPlanner(PagePool(100), PAGE, max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        planner.add(request(f"r{i}", 2))
    assert set(run_step(planner)) == {"r0", "r1"}
    planner.release(planner.running[0])
    assert set(run_step(planner)) == {"r1", "r2"}


def test_pages_follow_tokens_and_return_on_finish():
    pool = PagePool(10)
    planner = BatchPlanner(pool, PAGE, max_num_batched_tokens=100, max_num_seqs=8)
    r = request("r", 5)
    planner.add(r)
    run_step(planner)
    assert len(r.page_table.pages) == 2  # 5 tokens in pages of 4
    run_step(planner)  # computes token 6 of 6
    run_step(planner)  # token 7
    run_step(planner)  # token 8: still two pages
    assert len(r.page_table.pages) == 2
    run_step(planner)  # token 9 needs a third page
    assert len(r.page_table.pages) == 3 and pool.num_free == 7
    planner.release(r)
    assert pool.num_free == 10 and r.status is RequestStatus.FINISHED


def test_newest_request_is_preempted_when_pages_run_out_and_resumes_later():
    pool = PagePool(4)  # 16 tokens in all
    planner = BatchPlanner(pool, PAGE, max_num_batched_tokens=100, max_num_seqs=8)
    old, new = request("old", 8), request("new", 7)
    planner.add(old)
    planner.add(new)
    assert run_step(planner) == {"old": 8, "new": 7}  # 2 + 2 pages, none free
    # old (9 tokens) needs a third page: new is preempted, its pages freed.
    assert run_step(planner) == {"old": 1}
    assert new.status is RequestStatus.WAITING and new.page_table.num_computed_tokens == 0
    assert new.page_table.pages == [] and new.num_preemptions == 1
    assert new.output_token_ids == [7]  # what it produced is kept and recomputed later
    planner.release(old)
    # new is recomputed from prompt plus its output so far, then decodes.
    assert run_step(planner) == {"new": 8}
    assert run_step(planner) == {"new": 1}
    assert pool.num_free == pool.num_pages - len(new.page_table.pages)


def test_a_request_that_cannot_grow_preempts_itself_rather_than_older_ones():
    pool = PagePool(2)
    planner = BatchPlanner(pool, PAGE, max_num_batched_tokens=100, max_num_seqs=8)
    a, b = request("a", 4), request("b", 4)
    planner.add(a)
    planner.add(b)
    assert run_step(planner) == {"a": 4, "b": 4}
    # Both need a second page; a takes b's, b (the newest) goes back to waiting.
    assert run_step(planner) == {"a": 1}
    assert [r.request_id for r in planner.waiting] == ["b"]
    assert pool.num_free == 0 and len(a.page_table.pages) == 2


def test_abort_of_a_waiting_request_frees_nothing_twice():
    pool = PagePool(4)
    planner = BatchPlanner(pool, PAGE, max_num_batched_tokens=100, max_num_seqs=8)
    r = request("r", 3)
    planner.add(r)
    planner.release(r)
    planner.release(r)
    assert pool.num_free == 4 and not planner.has_work()


def test_a_prefill_waits_at_an_image_not_ready_and_the_others_go_on():
    """`ready_until` (the image encoder's, beside the steps): "img" may prefill up to token
    6 until its image is ready; it sits steps out holding its pages, and "late", queued
    behind a request whose first tokens are not ready, is admitted past it."""
    ready = {"img": 6, "blocked": 0}

    def ready_until(r: Request, start: int) -> int:
        return ready.get(r.request_id, r.num_tokens)

    pool = PagePool(100)
    planner = BatchPlanner(pool, PAGE, 100, max_num_seqs=8, ready_until=ready_until)
    planner.add(request("text", 3))
    planner.add(request("img", 20))
    assert run_step(planner) == {"text": 3, "img": 6}
    planner.add(request("blocked", 10))
    planner.add(request("late", 5))
    held = len(planner.running[1].page_table.pages)
    assert run_step(planner) == {"text": 1, "late": 5}
    assert run_step(planner) == {"text": 1, "late": 1}
    assert planner.running[1].page_table.num_computed_tokens == 6
    assert len(planner.running[1].page_table.pages) == held
    assert [r.request_id for r in planner.waiting] == ["blocked"]
    ready["img"] = ready["blocked"] = 10**6  # the images are ready
    assert run_step(planner) == {"text": 1, "late": 1, "img": 14, "blocked": 10}


class NoEncoder:
    """An encoder manager with no encoder thread, as prefill pacing reads it."""

    encoding = False
    images_encoded = 0


def test_a_step_with_decodes_carries_at_most_the_prefill_cap():
    """A cap on the prefill of a step with decodes (the prefill pacing's: its latency
    budget's smallest cap, nothing measured): while "short" decodes, "long" and "next"
    prefill 4 tokens a step between them; once nothing decodes, a prefill takes the whole
    budget."""
    cpu = torch.device("cpu")
    pacing = PrefillPacing(LatencyBudget(2.0, min_tokens=4), CoreSharing(None, cpu), NoEncoder())
    planner = BatchPlanner(PagePool(100), PAGE, 10, max_num_seqs=8, pacing=pacing)
    planner.add(request("short", 2))
    assert run_step(planner) == {"short": 2}  # nothing decodes yet: no cap
    planner.add(request("long", 7))
    planner.add(request("next", 30))
    assert run_step(planner) == {"short": 1, "long": 4}
    assert run_step(planner) == {"short": 1, "long": 3, "next": 1}
    planner.release(planner.running[0])  # "short" leaves; "long" decodes now
    assert run_step(planner) == {"long": 1, "next": 4}
    planner.release(planner.running[0])
    assert run_step(planner) == {"next": 10}  # a prefill alone: the whole budget


def hybrid_planner(num_pages: int) -> tuple[BatchPlanner, HostTier]:
    """A planner over a prefix cache with a host tier and two working state slots, wired
    as the engine wires them (step/wiring.py)."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_size=PAGE, dtype=torch.float32)
    kv = KVCache(layout, num_pages, torch.device("cpu"))
    tier = HostTier(
        8 * layout.bytes_per_page, HostMemory(kv, 8), torch.device("cpu"), record_copies=True
    )
    cache = PrefixCache(kv.pool, PAGE, tier)
    kv.pool.on_evict = tier.spill_page
    slots = StateSlots(2, 0, PAGE, cache.page_keys)
    cache.require_snapshots(slots.has_snapshot)
    return BatchPlanner(kv.pool, PAGE, 100, 2, cache, state_slots=slots, host_tier=tier), tier


def test_the_plan_carries_the_slot_ops_and_host_copies_its_planning_decided():
    """Admitting "a" clears its working slot; admitting "b" once "a" is gone clears
    another and takes the pages "a" left cached, whose eviction copies them to the host
    tier first."""
    planner, tier = hybrid_planner(num_pages=3)
    planner.add(request("a", 9))
    plan = planner.schedule()
    assert plan.slot_ops == [SlotOp(0)] and plan.host_copies == []
    assert plan.linear is not None and [s.num_tokens for s in plan.linear] == [9]
    planner.release(planner.running[0])  # its two full pages stay cached
    other = request("b", 12)
    other.prompt_token_ids[0] = 100  # nothing in common with "a"
    planner.add(other)
    plan = planner.schedule()
    assert plan.slot_ops == [SlotOp(1)] and [s.slot for s in plan.linear or []] == [1]
    assert [c.kind for c in plan.host_copies] == ["page_out", "page_out"]
    assert tier.take_copies() == []  # handed over, once


def test_device_work_waits_for_a_plan_that_runs_and_a_step_that_never_ran_hands_it_on():
    planner, tier = hybrid_planner(num_pages=8)
    tier.spill_page(7, b"key", b"")  # between steps (a spilled embedding can do this too)
    assert planner.schedule().host_copies == []  # nothing to run: it waits
    planner.add(request("a", 5))
    plan = planner.schedule()
    assert plan.slot_ops == [SlotOp(0)] and [c.kind for c in plan.host_copies] == ["page_out"]
    planner.defer_device_work(plan)  # its encoding raised: no rank applied any of it
    planner.release(planner.running[0])
    planner.add(request("b", 5))
    plan = planner.schedule()
    assert plan.slot_ops == [SlotOp(0), SlotOp(1)]  # a's clear first, then b's
    assert [c.kind for c in plan.host_copies] == ["page_out"]
