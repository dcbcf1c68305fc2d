"""Reference parity (docs/design.md): greedy fp32 tokens equal transformers `generate` on
the same checkpoint.

Every scenario runs Iris's engine and the reference on identical token ids and pixel
values; what differs is only how Iris computes: paged KV, chunked prefill, batching,
lazy image encoding, preemption.
"""

from __future__ import annotations

import pytest
import torch

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.attention import sdpa
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import assert_parity as assert_parity_with
from tests.reference import chat_prompt as chat
from tests.reference import cpu_engine as engine
from tests.reference import generate_joining_one_per_step, make_image, numbered_prompts

torch.set_num_threads(2)
MAX_NEW = 24
GREEDY = Sampling(temperature=0.0, max_tokens=MAX_NEW)


def assert_parity(model_dir: str, prompts: list[PromptInput], outputs: list[list[int]]) -> None:
    assert_parity_with(model_dir, prompts, outputs, MAX_NEW)


def test_text_one_image_and_three_mixed_images(each_arch_dir, each_arch_builder):
    prompts = [
        chat(each_arch_builder, "Write a short poem about the sea."),
        chat(each_arch_builder, "What is in this picture?", [make_image(64, 48, seed=1)]),
        chat(
            each_arch_builder,
            "Compare these three images.",
            [
                make_image(333, 517, "RGB", seed=2),
                make_image(120, 90, "L", seed=3),
                make_image(200, 140, "RGBA", seed=4),
            ],
        ),
        chat(each_arch_builder, "A palette image:", [make_image(57, 81, "P", seed=5)]),
    ]
    assert_parity(each_arch_dir, prompts, engine(each_arch_dir).generate(prompts, GREEDY))


@pytest.mark.parametrize(
    ("budget", "split_from"),
    [(16, None), (64, None), pytest.param(64, 32, id="64-split-attention"), (100_000, None)],
)
def test_long_prompt_at_any_chunk_budget(
    each_arch_dir, each_arch_builder, budget, split_from, monkeypatch
):
    """`split_from`: chunks after history of that many tokens or more attend to their own
    tokens and to their history apart (sdpa.SPLIT_MIN_NEW_TOKENS, lowered to reach it)."""
    if split_from is not None:
        monkeypatch.setattr(sdpa, "SPLIT_MIN_NEW_TOKENS", split_from)
    text = " ".join(f"Sentence {i} mentions apples, rivers and {i * 7} stones." for i in range(25))
    prompt = chat(
        each_arch_builder, text, [make_image(150, 100, seed=6), make_image(90, 120, seed=7)]
    )
    iris = engine(each_arch_dir, max_num_batched_tokens=budget)
    [output] = iris.generate([prompt], GREEDY)
    assert_parity(each_arch_dir, [prompt], [output])


def test_requests_joining_a_running_batch_at_different_steps(each_arch_dir, each_arch_builder):
    prompts = numbered_prompts(each_arch_builder, 8, words_per_step=9, image_every=3, seed=10)
    iris = engine(each_arch_dir, max_num_batched_tokens=48)
    assert_parity(each_arch_dir, prompts, generate_joining_one_per_step(iris, prompts, GREEDY))


def test_preemption_under_a_small_kv_pool_changes_no_token(each_arch_dir, each_arch_builder):
    prompts = [
        chat(
            each_arch_builder,
            f"Story number {i}: " + "once upon a time " * (3 + i),
            [make_image(80, 60, seed=i)],
        )
        for i in range(4)
    ]
    longest = max(len(p.token_ids) for p in prompts) + MAX_NEW
    iris = engine(each_arch_dir, page_size=8, num_kv_pages=-(-longest // 8) + 2)
    outputs = iris.generate(prompts, GREEDY)
    assert iris.stats().num_preemptions > 0, "the pool was meant to force preemption"
    assert_parity(each_arch_dir, prompts, outputs)
    assert iris.kv_cache.pool.num_free == iris.kv_cache.pool.num_pages


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_hub_layout_sharded_bf16_checkpoint_loads_and_matches(tiny_checkpoint, arch):
    sharded = str(tiny_checkpoint(arch, dtype="bfloat16", max_shard_size="200KB"))
    builder = PromptBuilder(sharded)
    prompts = [chat(builder, "Hello there!"), chat(builder, "Look:", [make_image(70, 70, seed=3)])]
    assert_parity(sharded, prompts, engine(sharded).generate(prompts, GREEDY))
