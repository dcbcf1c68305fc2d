"""The host tier (`--kv-offload-gib`): KV pages and image embeddings the device caches
evict go to host memory and come back, token for token.

The bookkeeping on a small KV cache (bytes round-trip, one LRU over pages and embeddings
in one budget, a tensor-parallel rank that repeats rank 0's copies gets the same bytes),
then engines against transformers: an agent that returns after others pushed its
history out, a prefix half on the device and half in host memory, an image whose
embedding comes back from host memory, a reload that fails (recomputed, that request
alone), and a hybrid model (Qwen3.5) resuming from host pages. Parity with the tier on
and off in every prefix-cache case: test_prefix_cache_engine.py; under tensor parallelism:
test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.kv.host_tier import HostMemory, HostTier
from iris_serve.scheduler.kv.kv_cache import KVCache, KVLayout
from iris_serve.scheduler.models.registry import load_config
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt as chat
from tests.reference import cpu_engine as engine
from tests.reference import hf_generate, make_image
from tests.test_prefix_cache_engine import next_turn

torch.set_num_threads(2)
MAX_NEW = 6
GREEDY = Sampling(temperature=0.0, max_tokens=MAX_NEW)
TIER = 8 << 20
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)
CPU = torch.device("cpu")


def filled_cache(num_pages: int) -> KVCache:
    kv = KVCache(LAYOUT, num_pages, CPU)
    kv.slots.copy_(torch.randn_like(kv.slots))
    return kv


def page_of(kv: KVCache, page: int) -> torch.Tensor:
    return kv.slots[:, :, :, page * 4 : (page + 1) * 4].clone()


def tier_of(kv: KVCache, num_pages: int, **kwargs) -> HostTier:
    memory = HostMemory(kv, num_pages)
    return HostTier(num_pages * LAYOUT.bytes_per_page, memory, CPU, **kwargs)


def test_a_spilled_page_reloads_its_exact_bytes_and_only_for_its_tokens():
    kv = filled_cache(4)
    tier = tier_of(kv, 2)
    original = page_of(kv, 1)
    tier.spill_page(1, b"key", b"tokens")
    kv.slots.zero_()  # the page's new owner writes over it
    assert not tier.reload_page(b"key", b"other tokens", 3)  # a collision is never served
    assert tier.reload_page(b"key", b"tokens", 3)
    assert torch.equal(page_of(kv, 3), original)
    assert tier.reload_page(b"key", b"tokens", 2)  # a reload keeps the host copy
    tier.spill_page(2, b"key", b"tokens")  # evicted again: held already, nothing copied
    assert tier.bytes_to_host == LAYOUT.bytes_per_page
    assert tier.bytes_to_device == 2 * LAYOUT.bytes_per_page


def test_a_full_tier_evicts_its_least_recently_used_entry_pages_and_embeddings_alike():
    kv = filled_cache(4)
    tier = tier_of(kv, 2)  # two pages' bytes
    embedding = torch.randn(LAYOUT.bytes_per_page // 4, 1)  # one page's bytes
    tier.spill_page(0, b"a", b"")
    tier.spill_embedding("image", embedding)
    assert tier.has_page(b"a", b"")  # touched: "image" is now the oldest
    tier.spill_page(1, b"b", b"")  # full: evicts the embedding, never refuses
    assert tier.reload_embedding("image", embedding.shape[0]) is None
    assert tier.has_page(b"a", b"") and tier.has_page(b"b", b"")
    assert tier.usage_bytes == tier.capacity_bytes and tier.num_pages == 2
    tier.spill_embedding("too large", torch.zeros(3 * LAYOUT.bytes_per_page // 4))
    assert tier.num_pages == 2  # an entry larger than the tier is dropped, not kept


def test_an_embedding_reloads_on_the_device_with_its_token_count_checked():
    tier = tier_of(filled_cache(1), 4)
    embedding = torch.randn(5, 8)
    tier.spill_embedding("image", embedding)
    assert tier.reload_embedding("image", 4) is None  # another token count: not this entry
    assert torch.equal(tier.reload_embedding("image", 5), embedding)
    assert tier.num_embeddings == 1


def test_another_rank_repeating_rank_0s_copies_holds_the_same_bytes():
    kv, mirror = filled_cache(3), KVCache(LAYOUT, 3, CPU)
    mirror.slots.copy_(kv.slots)
    tier = tier_of(kv, 2, record_copies=True)
    follower = HostMemory(mirror, 2)
    # one step's planning: two pages evicted, one of them reloaded at once elsewhere
    tier.spill_page(0, b"a", b"")
    tier.spill_page(1, b"b", b"")
    assert tier.reload_page(b"a", b"", 2)
    copies = tier.take_copies()
    assert [c.kind for c in copies] == ["page_out", "page_out", "page_in"]
    assert tier.take_copies() == []
    follower.apply(copies)  # before the step's forward, which writes pages 0 and 1
    assert torch.equal(mirror.slots, kv.slots)
    assert torch.equal(follower.blocks, tier.memory.blocks)


def test_a_snapshot_round_trips_through_host_memory_and_is_freed_on_every_rank():
    from iris_serve.scheduler.hybrid.linear_state import LinearStateLayout, LinearStates

    layout = LinearStateLayout(2, 8, 4, 2, 4, 4, torch.float32)
    pools = [LinearStates(layout, 3, CPU) for _ in range(2)]  # rank 0's and another's
    pools[0].conv.normal_(), pools[0].recurrent.normal_()
    pools[1].conv.copy_(pools[0].conv), pools[1].recurrent.copy_(pools[0].recurrent)
    kv = filled_cache(1)
    memory, follower = HostMemory(kv, 0, pools[0]), HostMemory(kv, 0, pools[1])
    tier = HostTier(layout.bytes_per_slot, memory, CPU, record_copies=True)  # one snapshot
    conv, recurrent = pools[0].conv[:, 1].clone(), pools[0].recurrent[:, 1].clone()

    tier.spill_state(b"snap", 1)  # the store evicts slot 1 for a new capture
    follower.apply(tier.take_copies())  # each step: the other ranks, before the forward
    for pool in pools:
        pool.clear(1)  # the forward writes slot 1 again
    assert tier.has_state(b"snap") and tier.reload_state(b"snap", 2)  # a request's slot
    follower.apply(tier.take_copies())
    for pool in pools:
        assert torch.equal(pool.conv[:, 2], conv) and torch.equal(pool.recurrent[:, 2], recurrent)
    tier.spill_state(b"other", 0)  # full: the older snapshot goes, on every rank
    follower.apply(tier.take_copies())
    assert not tier.has_state(b"snap") and tier.has_state(b"other")
    assert len(memory.states) == len(follower.states) == 1


# -- engines against transformers --------------------------------------------------------


def run(iris, request_id: str, prompt) -> tuple[list[int], int, int]:
    """Tokens, cached tokens and host-reloaded tokens of one request run alone."""
    iris.add_request(request_id, prompt, GREEDY)
    tokens, cached, host = [], -1, -1
    for out in iris.run_until_idle():
        tokens += out.new_token_ids
        cached, host = out.cached_tokens, out.host_cached_tokens
    return tokens, cached, host


def evict_cached_pages(iris, count: int) -> None:
    """Another request takes every free page and `count` cached ones, then lets them go:
    the pool evicts its least recently released pages, a chain's tail first."""
    pool = iris.kv_cache.pool
    pages = pool.allocate(pool.num_free - pool.num_evictable + count)
    pool.free(pages)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen2_5_vl"))


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


def test_an_agent_whose_history_was_evicted_reloads_it_and_answers_the_same(model_dir, builder):
    page = 8
    agents = [
        chat(builder, f"Agent {i}: what changed on screen?", [make_image(84, 84, seed=60 + i)])
        for i in range(3)
    ]
    pages_per_turn = -(-(max(len(p.token_ids) for p in agents) + MAX_NEW) // page)
    iris = engine(
        model_dir,
        page_size=page,
        num_kv_pages=pages_per_turn + 4,  # about one agent's history
        kv_offload_bytes=TIER,
        mm_embedding_cache_bytes=0,  # an embedding lives on the device only while used
    )
    answers = [run(iris, f"turn-0-{i}", agent)[0] for i, agent in enumerate(agents)]
    assert iris.kv_cache.pool.num_evictions > 0
    returning = next_turn(builder, agents[0], answers[0], "And now?", make_image(84, 56, seed=70))
    encoded = iris.stats().images_encoded
    tokens, cached, host = run(iris, "turn-1-0", returning)
    assert tokens == hf_generate(model_dir, returning, MAX_NEW)
    last_kv = len(agents[0].token_ids) + len(answers[0]) - 1
    assert cached == last_kv // page * page  # its whole previous turn, as if never evicted
    assert 0 < host <= cached
    assert iris.stats().images_encoded - encoded == 1  # only the new screenshot
    stats = iris.stats()
    assert stats.prefix_cache_host_hit_tokens == host
    assert stats.host_tier_bytes_to_device >= host // page * iris.kv_cache.layout.bytes_per_page
    assert iris.kv_cache.pool.num_free == iris.kv_cache.pool.num_pages


def test_a_prefix_half_on_the_device_half_in_host_memory(model_dir, builder):
    page = 4
    prompt = chat(builder, "Count the boats, then the birds.", [make_image(112, 84, seed=80)])
    iris = engine(model_dir, page_size=page, kv_offload_bytes=TIER)
    first, _, _ = run(iris, "first", prompt)
    cached_pages = iris.kv_cache.pool.num_cached
    evict_cached_pages(iris, cached_pages // 2)  # the tail half goes to host memory
    tokens, cached, host = run(iris, "again", prompt)
    assert tokens == first == hf_generate(model_dir, prompt, MAX_NEW)
    assert cached == (len(prompt.token_ids) - 1) // page * page
    assert 0 < host < cached  # the head from the device, the tail from host memory
    assert cached - host == (cached_pages - cached_pages // 2) * page  # what stayed


def test_an_image_whose_embedding_was_evicted_comes_back_without_the_vision_tower(
    model_dir, builder
):
    image = make_image(112, 112, seed=90)
    iris = engine(model_dir, kv_offload_bytes=TIER, mm_embedding_cache_bytes=0)
    run(iris, "first", chat(builder, "What is this?", [image]))
    assert len(iris.embedding_cache) == 0  # nobody uses it: gone from the device
    other = builder.build(  # other text before the image: no prefix-cache hit reaches it
        "<|im_start|>user\nA new question. <|vision_start|><|image_pad|><|vision_end|>"
        "Which colours?<|im_end|>\n<|im_start|>assistant\n",
        [image],
    )
    encoded = iris.stats().images_encoded
    tokens, _, _ = run(iris, "second", other)
    assert iris.stats().images_encoded == encoded  # reloaded, not encoded
    assert iris.stats().mm_embedding_cache_host_hits == 1
    assert tokens == hf_generate(model_dir, other, MAX_NEW)


def test_a_failed_reload_recomputes_that_request_alone(model_dir, builder, monkeypatch):
    page = 4
    prompt = chat(builder, "Where is the lighthouse?", [make_image(84, 112, seed=95)])
    iris = engine(model_dir, page_size=page, kv_offload_bytes=TIER)
    first, _, _ = run(iris, "first", prompt)
    evict_cached_pages(iris, iris.kv_cache.pool.num_cached // 2)
    apply = HostMemory.apply

    def failing_reloads(self, copies):
        copies = list(copies)
        if any(copy.kind == "page_in" for copy in copies):
            raise RuntimeError("injected: the host copy failed")
        apply(self, copies)

    monkeypatch.setattr(HostMemory, "apply", failing_reloads)
    tokens, cached, host = run(iris, "failing", prompt)
    assert tokens == first  # recomputed what it could not reload
    assert host == 0 and 0 < cached < (len(prompt.token_ids) - 1) // page * page
    assert iris.stats().host_tier_failed_reloads == 1
    monkeypatch.setattr(HostMemory, "apply", apply)
    assert run(iris, "after", prompt)[0] == first  # nothing wrong was registered
    pool = iris.kv_cache.pool
    assert pool.num_free == pool.num_pages


def test_a_hybrid_model_resumes_from_host_pages_and_a_snapshot_in_host_memory(tiny_checkpoint):
    """Two snapshot slots: the other prompts' snapshots push the first prompt's out of the
    device, and its pages too; it comes back from host memory, state and KV."""
    model_dir = str(tiny_checkpoint("qwen3_5"))
    builder = PromptBuilder(model_dir)
    prompts = [
        chat(builder, f"Read sign {i} in this photo.", [make_image(96, 64, seed=100 + i)])
        for i in range(3)
    ]
    iris = engine(model_dir, page_size=8, kv_offload_bytes=TIER, linear_state_snapshots=2)
    first = [run(iris, f"first-{i}", prompt)[0] for i, prompt in enumerate(prompts)]
    evict_cached_pages(iris, iris.kv_cache.pool.num_cached)
    tier = iris.host_tier
    assert tier is not None and tier.num_states > 0
    restored = tier.states_reloaded  # the later prompts' shared text may have come back too
    tokens, cached, host = run(iris, "again", prompts[0])
    assert tokens == first[0] == hf_generate(model_dir, prompts[0], MAX_NEW)
    assert cached == host > 0
    assert tier.states_reloaded == restored + 1


def test_a_hybrid_model_resumes_from_host_pages_and_its_snapshot(tiny_checkpoint):
    model_dir = str(tiny_checkpoint("qwen3_5"))
    builder = PromptBuilder(model_dir)
    page = 8
    prompt = chat(builder, "Read the sign in this photo.", [make_image(96, 64, seed=99)])
    iris = engine(model_dir, page_size=page, kv_offload_bytes=TIER)
    first, _, _ = run(iris, "first", prompt)
    evict_cached_pages(iris, iris.kv_cache.pool.num_cached)  # every page; snapshots stay
    tokens, cached, host = run(iris, "again", prompt)
    assert tokens == first == hf_generate(model_dir, prompt, MAX_NEW)
    assert cached == host > 0  # all from host memory, resumed at a snapshot


def test_agents_cycling_through_a_full_tier_leak_nothing(model_dir, builder):
    """Four agents take three turns each over a pool and a tier of about one history
    each: pages, embeddings and blocks come and go, and at the end nothing is held
    but what the caches keep, within their budgets."""
    page = 8
    agents = [chat(builder, f"Agent {i}?", [make_image(56, 56, seed=300 + i)]) for i in range(4)]
    turn_pages = -(-(len(agents[0].token_ids) + 3 * (MAX_NEW + 40)) // page)
    layout_bytes = KVLayout.of(load_config(model_dir), page, torch.float32).bytes_per_page
    iris = engine(
        model_dir,
        page_size=page,
        num_kv_pages=turn_pages + 2,
        kv_offload_bytes=turn_pages * layout_bytes,
        mm_embedding_cache_bytes=0,
    )
    histories, answers = list(agents), [None] * len(agents)
    for turn in range(3):
        for i, history in enumerate(histories):
            if turn:
                history = next_turn(
                    builder,
                    history,
                    answers[i],
                    f"Turn {turn}?",
                    make_image(56, 42, seed=400 + 10 * i + turn),
                )
                histories[i] = history
            answers[i] = run(iris, f"{turn}-{i}", history)[0]
    tier, pool = iris.host_tier, iris.kv_cache.pool
    assert tier is not None and tier.pages_spilled > 0 and tier.pages_reloaded > 0
    assert tier.pages_spilled > tier.memory.num_blocks  # the tier was full, and evicted
    assert tier.embeddings_spilled > 0 and tier.usage_bytes <= tier.capacity_bytes
    assert tier.num_pages + len(tier._free_blocks) == tier.memory.num_blocks
    assert pool.num_free == pool.num_pages and iris.embedding_cache.num_held == 0
    assert iris.stats().pinned_images == 0 and not iris.requests


def test_an_entry_a_match_found_stays_until_the_step_that_reloads_it():
    kv = filled_cache(4)
    tier = tier_of(kv, 2)
    tier.spill_page(0, b"a", b"")
    tier.spill_page(1, b"b", b"")
    assert tier.has_page(b"a", b"") and tier.has_page(b"b", b"")  # both matched this step
    tier.spill_page(2, b"c", b"")  # full of entries a reload needs: "c" is not kept
    assert tier.has_page(b"a", b"") and tier.has_page(b"b", b"") and tier.num_pages == 2
    tier.take_copies()  # the step ran: "a" (the older) may go now
    tier.spill_page(2, b"c", b"")
    assert not tier.has_page(b"a", b"") and tier.has_page(b"c", b"")
