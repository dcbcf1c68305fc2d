"""Qwen3.5's linear-attention state through the engine: prefix hits restore a snapshot of
it, fall back to a shallower one, survive its eviction, and let an agent's growing
history prefill only its new tokens. Greedy fp32 against transformers `generate`; the
cases every architecture runs (chunk budgets, joining, preemption, multi-turn images)
are in tests/test_engine_parity.py and tests/test_prefix_cache_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Prompt
from iris_serve.scheduler.step.engine import Engine
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt as chat
from tests.reference import cpu_engine, hf_generate, make_image
from tests.test_prefix_cache_engine import GREEDY, MAX_NEW, run

torch.set_num_threads(2)
PAGE = 8


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def hybrid_dir(request) -> str:
    return str(request.getfixturevalue(f"{request.param}_tiny"))


@pytest.fixture(scope="module")
def hybrid_builder(hybrid_dir: str) -> PromptBuilder:
    return PromptBuilder(hybrid_dir)


def floor_pages(num_tokens: int) -> int:
    return num_tokens // PAGE * PAGE


def assert_idle(iris: Engine) -> None:
    """Nothing held: every page back (cached or free) and every working slot free."""
    pool = iris.kv_cache.pool
    assert pool.num_free == pool.num_pages
    slots = iris.state_slots
    assert slots is not None and len(slots._free_working) == iris.config.max_num_seqs
    assert iris.stats().linear_state_slots_held == 0  # what /metrics shows


def test_the_same_prompt_again_resumes_from_its_prompt_end_snapshot(hybrid_dir, hybrid_builder):
    iris = cpu_engine(hybrid_dir, page_size=PAGE)
    prompt = chat(hybrid_builder, "What is in this picture?", [make_image(64, 48, seed=1)])
    first, cached = run(iris, "first", prompt)
    assert cached == 0
    again, cached = run(iris, "again", prompt)
    assert cached == floor_pages(len(prompt.token_ids) - 1)
    assert first == again == hf_generate(hybrid_dir, prompt, MAX_NEW)
    stats = iris.stats()
    assert (stats.linear_state_snapshot_queries, stats.linear_state_snapshot_hits) == (2, 1)
    assert_idle(iris)


def test_a_page_match_past_every_snapshot_resumes_at_the_deepest_one(hybrid_dir, hybrid_builder):
    """The second prompt shares the first one's pages beyond its image, but the first took
    no snapshot between its image and its prompt's end: the hit falls back to the image."""
    iris = cpu_engine(hybrid_dir, page_size=PAGE)
    image = make_image(64, 64, seed=2)
    long_text = " ".join(f"Point {i} about the picture." for i in range(12))
    first = chat(
        hybrid_builder,
        long_text + " Summarise every point in one short sentence each, in the given order.",
        [image],
    )
    second = chat(hybrid_builder, long_text + " Now list every point again.", [image])
    pairs = zip(first.token_ids, second.token_ids, strict=False)
    shared = next(i for i, (a, b) in enumerate(pairs) if a != b)
    image_end = first.images[0].end
    assert floor_pages(shared) > floor_pages(image_end) + PAGE  # pages match further...
    assert floor_pages(len(first.token_ids) - 1) > floor_pages(shared)  # ...than snapshots
    run(iris, "first", first)
    tokens, cached = run(iris, "second", second)
    assert cached == floor_pages(image_end)
    assert tokens == hf_generate(hybrid_dir, second, MAX_NEW)
    assert_idle(iris)


def test_an_evicted_snapshot_costs_a_recompute_not_a_wrong_token(hybrid_dir, hybrid_builder):
    iris = cpu_engine(hybrid_dir, page_size=PAGE, linear_state_snapshots=1)
    a = chat(hybrid_builder, "Tell me about rivers.")
    b = chat(hybrid_builder, "Tell me about mountains and valleys.")
    first, _ = run(iris, "a", a)
    run(iris, "b", b)  # its snapshots take the only slot
    assert iris.stats().linear_state_snapshots == 1
    again, cached = run(iris, "a-again", a)
    assert iris.kv_cache.pool.num_cached > 0  # its pages may be cached: its state is not
    assert cached == 0 and again == first == hf_generate(hybrid_dir, a, MAX_NEW)
    assert_idle(iris)
    iris.add_request("running", b, GREEDY)
    iris.step()
    assert iris.stats().linear_state_slots_held == 1  # while it runs
    list(iris.run_until_idle())
    assert_idle(iris)


def test_a_growing_agent_history_prefills_only_its_new_tokens(hybrid_dir, hybrid_builder):
    """Each turn is the previous prompt and answer, verbatim, then a tool result: the
    previous request's latest snapshot is where the next one resumes."""
    iris = cpu_engine(hybrid_dir, page_size=PAGE)
    prompt = chat(hybrid_builder, "Plan a trip, calling tools.", [make_image(48, 48, seed=3)])
    computed = 0  # tokens of the previous turn whose state its last step wrote
    for turn in range(4):
        tokens, cached = run(iris, f"turn-{turn}", prompt)
        if turn:
            assert cached == floor_pages(computed)
            new_tokens = len(prompt.token_ids) - computed
            assert len(prompt.token_ids) - cached < new_tokens + PAGE  # what was prefilled
        last = prompt
        computed = len(prompt.token_ids) + len(tokens) - 1  # the last token is never run
        result = hybrid_builder.tokenizer.encode(
            f"<|im_end|>\n<|im_start|>user\n<tool_response>result {turn}</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n"
        )
        prompt = PromptInput(
            Prompt(prompt.token_ids + tokens + result, prompt.images), prompt.pixels
        )
    assert tokens == hf_generate(hybrid_dir, last, MAX_NEW)
    assert_idle(iris)


def test_a_failed_step_leaks_no_slot_and_leaves_no_snapshot(
    hybrid_dir, hybrid_builder, monkeypatch
):
    iris = cpu_engine(hybrid_dir, page_size=PAGE)
    prompt = chat(hybrid_builder, "Describe this.", [make_image(64, 48, seed=4)])

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(iris.runner, "forward", broken)
    iris.add_request("broken", prompt, GREEDY)
    list(iris.run_until_idle())
    [failure] = iris.pop_failed()
    assert failure.request_id == "broken"
    assert iris.stats().linear_state_snapshots == 0  # the step that was to write them raised
    assert_idle(iris)
    monkeypatch.undo()
    tokens, cached = run(iris, "after", prompt)
    assert cached == 0 and tokens == hf_generate(hybrid_dir, prompt, MAX_NEW)


def test_the_start_up_log_says_what_the_state_takes(hybrid_dir: str, caplog) -> None:
    with caplog.at_level("INFO"):
        iris = cpu_engine(Path(hybrid_dir), max_num_seqs=4, linear_state_snapshots=3)
    config = iris.model.config
    assert "linear-attention state: 8 slots" in caplog.text
    covered = f"covers the {config.num_kv_layers} full-attention layers of {config.num_layers}"
    assert covered in caplog.text


def test_snapshots_take_at_most_half_the_cache_by_default_and_too_many_are_refused(hybrid_dir):
    from iris_serve.scheduler import hybrid_footprint

    footprint = hybrid_footprint(hybrid_dir, torch.float32)
    assert footprint is not None
    slot = footprint.state_bytes_per_slot
    budget = 2 * 14 * slot + 4 * PAGE * footprint.kv_bytes_per_token
    iris = cpu_engine(hybrid_dir, max_num_seqs=4, kv_cache_memory=budget, page_size=PAGE)
    assert iris.state_slots is not None
    assert iris.state_slots.num_snapshots == 14 - 5  # beside 4 working slots and the scratch
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        cpu_engine(hybrid_dir, max_num_seqs=4, kv_cache_memory=budget, linear_state_snapshots=99)
