"""Reference parity (docs/design.md) with the prefix cache: reused KV pages change no token.

Greedy fp32 against transformers `generate`, on both architectures: a multi-turn
conversation (each turn is the previous prompt, its answer and a new image), two prompts
that differ only in their image, a small pool that evicts all the time, and a cache hit
that ends inside an image. Each case runs with the host tier off and on (`--kv-offload-gib`):
pages evicted to host memory and reloaded change no token either.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Prompt, Sampling
from iris_serve.scheduler.step.engine import Engine
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt as chat
from tests.reference import cpu_engine as engine
from tests.reference import hf_generate, make_image

torch.set_num_threads(2)
MAX_NEW = 8
GREEDY = Sampling(temperature=0.0, max_tokens=MAX_NEW)


@pytest.fixture(params=[0, 8 << 20], ids=["device-only", "host-tier"])
def tier(request) -> dict[str, int]:
    """The engine's `kv_offload_bytes`: off, then 8 MiB of host tier."""
    return {"kv_offload_bytes": request.param}


def next_turn(
    builder: PromptBuilder, previous: PromptInput, answer: list[int], text: str, image
) -> PromptInput:
    """The previous prompt, its answer token for token, and a new user turn with an image
    (built on ids, so the previous turn's KV is an exact prefix of this one)."""
    # A random model may answer with any special token; only vision tokens would change
    # where the images lie (vision start, end and pad are the three ids below the image pad).
    vision = range(builder.image_token_id - 3, builder.image_token_id + 1)
    assert not any(t in vision for t in answer), f"answer holds vision tokens: {answer}"
    user = builder.build(
        "<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        f"{text}<|im_end|>\n<|im_start|>assistant\n",
        [image],
    )
    shift = len(previous.token_ids) + len(answer)
    images = previous.images + [
        msgspec.structs.replace(i, offset=i.offset + shift) for i in user.images
    ]
    return PromptInput(
        Prompt(previous.token_ids + answer + user.token_ids, images),
        previous.pixels + user.pixels,
    )


def run(iris: Engine, request_id: str, prompt: PromptInput) -> tuple[list[int], int]:
    """Runs one request to completion; returns its tokens and its `num_cached_tokens`."""
    iris.add_request(request_id, prompt, GREEDY)
    tokens, cached = [], -1
    for out in iris.run_until_idle():
        tokens += out.new_token_ids
        cached = out.cached_tokens
    return tokens, cached


def floor_pages(num_tokens: int, page_size: int) -> int:
    return num_tokens // page_size * page_size


def test_a_four_turn_conversation_reuses_every_previous_turn(
    each_arch_dir, each_arch_builder, tier
):
    page = 16
    iris, plain = (
        engine(each_arch_dir, page_size=page, **tier),
        engine(each_arch_dir, enable_prefix_caching=False),
    )
    prompt = chat(each_arch_builder, "Describe this picture.", [make_image(112, 84, seed=20)])
    previous: tuple[PromptInput, list[int]] | None = None
    total_prompt = 0
    for turn in range(4):
        if previous is not None:
            image = make_image(84 + 28 * turn, 112, seed=20 + turn)
            prompt = next_turn(each_arch_builder, *previous, f"And turn {turn}?", image)
        encoded = iris.stats().images_encoded
        tokens, cached = run(iris, f"turn-{turn}", prompt)
        assert tokens == hf_generate(each_arch_dir, prompt, MAX_NEW), f"turn {turn}"
        assert run(plain, f"turn-{turn}", prompt) == (tokens, 0)
        if previous is not None:
            # The previous prompt and all but the last answer token (never computed) are KV.
            last_kv = len(previous[0].token_ids) + len(previous[1]) - 1
            assert cached >= floor_pages(len(previous[0].token_ids), page)
            assert cached == floor_pages(last_kv, page)
            # Every earlier image lies inside the hit, so no chunk needs it again.
            assert all(image.end <= cached for image in previous[0].images)
            assert iris.stats().images_encoded - encoded == 1  # only the new image
        total_prompt += len(prompt.token_ids)
        previous = (prompt, tokens)
    pool = iris.kv_cache.pool
    assert pool.num_free == pool.num_pages and pool.num_cached > 0
    # Figures for the report: prompt tokens served from the cache over the four turns.
    print(
        f"\n{each_arch_dir}: {iris.stats().prefix_cache_hit_tokens}/{total_prompt} prompt tokens cached"
    )
    assert iris.stats().prefix_cache_hit_tokens > total_prompt // 3
    # /metrics' hit-rate denominator: every prompt looked up once; none without the cache
    assert iris.stats().prefix_cache_query_tokens == total_prompt
    assert plain.stats().prefix_cache_query_tokens == 0


def test_prompts_that_differ_only_in_the_image_share_no_image_page(
    each_arch_dir, each_arch_builder, tier
):
    page = 8
    iris = engine(each_arch_dir, page_size=page, **tier)
    a = chat(each_arch_builder, "What is this?", [make_image(112, 112, seed=31)])
    b = chat(each_arch_builder, "What is this?", [make_image(112, 112, seed=32)])
    assert a.token_ids == b.token_ids and a.images[0].key != b.images[0].key
    image = a.images[0]
    image_pages = range(image.offset // page, -(-image.end // page))

    iris.add_request("a", a, GREEDY)
    iris.step()  # the whole prompt in one chunk
    a_pages = iris.requests["a"].page_table.pages[: len(a.token_ids) // page]
    outputs = {"a": list(iris.requests["a"].output_token_ids)}
    iris.add_request("b", b, GREEDY)
    request_b = iris.requests["b"]
    for out in iris.run_until_idle():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.request_id == "b" and len(outputs["b"]) == 1:
            shared = [
                i
                for i, p in enumerate(request_b.page_table.pages)
                if i < len(a_pages) and p == a_pages[i]
            ]
            assert shared == list(range(image.offset // page))  # text before the image only
            a_image_pages = {a_pages[i] for i in image_pages if i < len(a_pages)}
            assert a_image_pages and not a_image_pages & set(request_b.page_table.pages)
    assert request_b.num_cached_tokens == floor_pages(image.offset, page)
    assert outputs["a"] == hf_generate(each_arch_dir, a, MAX_NEW)
    assert outputs["b"] == hf_generate(each_arch_dir, b, MAX_NEW)


def test_a_small_pool_that_evicts_all_the_time_changes_no_token(
    each_arch_dir, each_arch_builder, tier
):
    shared_image = make_image(112, 84, seed=40)
    prompts = [
        chat(each_arch_builder, f"Question {i}: " + "what and why? " * (1 + i % 3), [shared_image])
        for i in range(4)
    ]
    longest = max(len(p.token_ids) for p in prompts) + MAX_NEW
    page = 8
    iris = engine(each_arch_dir, page_size=page, num_kv_pages=-(-longest // page) + 1, **tier)
    first = iris.generate(prompts, GREEDY)
    again = iris.generate(prompts[::-1], GREEDY)[::-1]  # evicts and hits in another order
    pool = iris.kv_cache.pool
    assert iris.stats().num_preemptions > 0 and pool.num_evictions > 0
    assert iris.stats().prefix_cache_hit_tokens > 0
    if tier["kv_offload_bytes"]:  # what the device evicted came back from host memory
        assert iris.stats().prefix_cache_host_hit_tokens > 0
    assert again == first
    for prompt, tokens in zip(prompts, first, strict=True):
        assert tokens == hf_generate(each_arch_dir, prompt, MAX_NEW)
    assert pool.num_free == pool.num_pages


def test_a_hit_that_ends_inside_an_image_splices_the_rest_of_the_image(
    each_arch_dir, each_arch_builder, tier
):
    page = 4
    prompt = chat(each_arch_builder, "Look closely.", [make_image(112, 112, seed=50)])
    image = prompt.images[0]
    middle = image.offset + image.length // 2
    # inline, so that one step computes tokens 0..middle, half of the image (beside the
    # steps: tests/test_encoder_beside.py)
    iris = engine(
        each_arch_dir,
        page_size=page,
        max_num_batched_tokens=middle,
        mm_encoder_placement="inline",
        **tier,
    )
    iris.add_request("cut", prompt, GREEDY)
    iris.step()
    iris.abort("cut")  # its full pages stay cached
    tokens, cached = run(iris, "resumed", prompt)
    # The resumed request's first chunk starts inside the image: it needs the image's
    # embedding (encoded or from the embedding cache) and splices only its second half.
    assert image.offset < cached < image.end and cached == floor_pages(middle, page)
    assert tokens == hf_generate(each_arch_dir, prompt, MAX_NEW)
