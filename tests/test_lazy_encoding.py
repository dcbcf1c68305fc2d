"""docs/design.md's "One cache entry per image" and "Lazy and chunk-aware" at the engine:
per-image embedding cache, lazy chunk-aware encoding.

What the vision tower ran is recorded by `engine()` below (the cache keys of each call,
read off the model's `encode_images` and the embedding cache's `put`) and the counters;
every answer is checked against transformers `generate`. The prefix cache, when the tree
has one, is switched off wherever it would hide the embedding cache's work (its hits skip
images altogether). The cache states (warm, shared, evicting, every baseline switch) run
on Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE; the scheduling mechanics on Qwen2.5-VL only,
whose image token counts the expected call lists are written for.
"""

from __future__ import annotations

import weakref

import msgspec
import pytest
import torch
from PIL import Image

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import ImageRef, Prompt, Sampling, ShmPointer
from iris_serve.scheduler.encoder.pixels import PixelStore
from iris_serve.scheduler.process import SchedulerLoop
from iris_serve.scheduler.step.engine import Engine
from iris_serve.tokenizer_worker.images.key import image_key
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import assert_parity as assert_parity_with
from tests.reference import cpu_engine, make_image

torch.set_num_threads(2)
MAX_NEW = 12
GREEDY = Sampling(temperature=0.0, max_tokens=MAX_NEW)
NO_PREFIX = {"enable_prefix_caching": False}
PREFIX_SETTINGS = [False, True]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def cache_arch_dir(request) -> str:
    """The cache-state tests run on every architecture whose entries differ: Qwen3-VL's carry
    DeepStack levels, and the MoE's decoder routes experts."""
    return str(request.getfixturevalue(f"{request.param}_tiny"))


@pytest.fixture(scope="module")
def cache_arch_builder(cache_arch_dir) -> PromptBuilder:
    return PromptBuilder(cache_arch_dir)


_VISION_CALLS: weakref.WeakKeyDictionary[Engine, list[list]] = weakref.WeakKeyDictionary()


def engine(model_dir: str, **overrides) -> Engine:
    """A CPU engine that records the cache keys of each vision-tower call: a call opens a
    new list, and every entry filled from its output (`put`, in batch order) joins it.
    The vision tower runs inside the steps (`mm_encoder_placement="inline"`), whose mechanics these
    tests follow step by step; tests/test_encoder_beside.py covers the encoder thread."""
    overrides.setdefault("mm_encoder_placement", "inline")
    iris = cpu_engine(model_dir, **overrides)
    calls: list[list] = []
    encode_images, put = iris.model.encode_images, iris.embedding_cache.put

    def recording_encode_images(*args, **kwargs):
        calls.append([])
        return encode_images(*args, **kwargs)

    def recording_put(key, embedding) -> None:
        calls[-1].append(key)
        put(key, embedding)

    iris.model.encode_images = recording_encode_images
    iris.embedding_cache.put = recording_put
    _VISION_CALLS[iris] = calls
    return iris


def vision_calls(iris: Engine) -> list[list]:
    return _VISION_CALLS[iris]


def prompt(builder: PromptBuilder, *parts: str | Image.Image) -> PromptInput:
    """One user turn: text and images in the order given."""
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
    ]
    images = [p for p in parts if not isinstance(p, str)]
    return builder.build(builder.render_chat([{"role": "user", "content": content}]), images)


def assert_parity(
    model_dir: str, prompts: list[PromptInput], outputs: list[list[int]], max_new: int = MAX_NEW
) -> None:
    assert_parity_with(model_dir, prompts, outputs, max_new)


def encoded(iris: Engine) -> list:
    return [key for call in vision_calls(iris) for key in call]


FILLER = " ".join(f"word{i}" for i in range(40))
A, B, C = (make_image(150, 100, seed=s) for s in (1, 2, 3))  # 20 tokens each


def test_a_chunk_encodes_only_the_images_it_overlaps(model_dir, builder):
    p = prompt(builder, "First:", A, FILLER, B, FILLER, C, "Compare them.")
    iris = engine(model_dir, max_num_batched_tokens=16, **NO_PREFIX)
    iris.add_request("r", p, GREEDY)
    request = iris.requests["r"]
    tokens: list[int] = []
    steps_that_encoded = 0
    while iris.has_unfinished_requests():
        start, logged = request.page_table.num_computed_tokens, len(encoded(iris))
        tokens += [t for out in iris.step() for t in out.new_token_ids]
        end = request.page_table.num_computed_tokens
        new = encoded(iris)[logged:]
        first_overlap = [
            image.key for image in p.images if image.overlaps(start, end) and image.offset >= start
        ]
        straddling = [image.key for image in p.images if image.offset < start < image.end]
        assert new == first_overlap and not set(straddling) & set(new), (start, end)
        steps_that_encoded += bool(new)
    assert steps_that_encoded == 3 and encoded(iris) == [image.key for image in p.images]
    assert iris.stats().images_encoded == 3 and iris.stats().mm_embedding_cache_misses == 3
    assert_parity(model_dir, [p], [tokens])


@pytest.mark.parametrize(("budget", "calls"), [(24, [[0, 1], [2], [3]]), (5, [[0], [1], [2], [3]])])
def test_vision_calls_respect_the_encoder_budget(model_dir, builder, budget, calls):
    images = [A, make_image(64, 48, seed=4), make_image(80, 60, seed=5), B]  # 20, 4, 6, 20
    p = prompt(builder, *images, "All four?")
    assert [image.length for image in p.images] == [20, 4, 6, 20]
    iris = engine(model_dir, max_num_encoder_tokens=budget)
    [out] = iris.generate([p], GREEDY)
    keys = [image.key for image in p.images]
    assert vision_calls(iris) == [[keys[i] for i in call] for call in calls]
    seconds = iris.drain_encoder_seconds()
    assert len(seconds) == len(calls) and all(s > 0 for s in seconds)
    assert iris.drain_encoder_seconds() == []
    assert_parity(model_dir, [p], [out])


@pytest.mark.parametrize("prefix_caching", PREFIX_SETTINGS)
def test_eight_concurrent_requests_with_one_new_image_encode_it_once(
    cache_arch_dir, cache_arch_builder, prefix_caching
):
    prompts = [prompt(cache_arch_builder, C, f"Question {i}: what is shown?") for i in range(8)]
    overrides = {"enable_prefix_caching": prefix_caching}
    iris = engine(cache_arch_dir, **overrides)
    outputs = iris.generate(prompts, GREEDY)
    assert vision_calls(iris) == [[prompts[0].images[0].key]]
    assert iris.stats().images_encoded == 1
    assert (iris.stats().mm_embedding_cache_misses, iris.stats().mm_embedding_cache_hits) == (1, 7)
    # one entry: the image's rows, main embedding and every DeepStack level, fp32
    config = iris.model.config
    width = config.hidden_size * (1 + config.deepstack_levels)
    assert iris.stats().mm_embedding_cache_usage_bytes == prompts[0].images[0].length * width * 4
    assert_parity(cache_arch_dir, prompts[:2], outputs[:2])


def conversation(builder: PromptBuilder, rounds: int) -> PromptInput:
    messages = []
    for k in range(rounds):
        image = {"type": "image"}
        messages.append({"role": "user", "content": [image, {"type": "text", "text": f"And {k}?"}]})
        if k < rounds - 1:
            messages.append({"role": "assistant", "content": f"Picture {k} shows colours."})
    images = [make_image(64 + 8 * k, 48, seed=20 + k) for k in range(rounds)]
    return builder.build(builder.render_chat(messages), images)


@pytest.mark.parametrize("prefix_caching", PREFIX_SETTINGS)
@pytest.mark.parametrize("granularity", ["image", "request"])
def test_a_conversation_adding_one_image_per_round(
    cache_arch_dir, cache_arch_builder, granularity, prefix_caching
):
    overrides = {"enable_prefix_caching": prefix_caching}
    iris = engine(cache_arch_dir, mm_cache_granularity=granularity, **overrides)
    short = Sampling(temperature=0.0, max_tokens=2)
    for rounds in range(1, 9):
        before = iris.stats().images_encoded
        p = conversation(cache_arch_builder, rounds)
        [out] = iris.generate([p], GREEDY if rounds == 8 else short)
        new = iris.stats().images_encoded - before
        assert new == (1 if granularity == "image" else rounds), f"round {rounds}"
    assert_parity(cache_arch_dir, [p], [out])


def test_a_cache_too_small_for_one_image_evicts_after_every_request(
    cache_arch_dir, cache_arch_builder
):
    iris = engine(cache_arch_dir, mm_embedding_cache_bytes=1, **NO_PREFIX)
    together = [prompt(cache_arch_builder, A, "One?"), prompt(cache_arch_builder, A, B, "Two?")]
    later = [prompt(cache_arch_builder, B, A, "Again?")]
    outputs = iris.generate(together, GREEDY)
    assert iris.stats().images_encoded == 2  # held while both run: shared although over capacity
    assert len(iris.embedding_cache) == 0 and iris.stats().mm_embedding_cache_usage_bytes == 0
    outputs += iris.generate(later, GREEDY)
    assert iris.stats().images_encoded == 4 and len(iris.embedding_cache) == 0
    assert_parity(cache_arch_dir, together + later, outputs)


@pytest.mark.parametrize(
    "switch", [{"enable_mm_embedding_cache": False}, {"chunked_mm_encoding": False}]
)
def test_the_baseline_switches_change_the_work_not_the_answers(
    cache_arch_dir, cache_arch_builder, switch
):
    prompts = [
        prompt(cache_arch_builder, A, FILLER, B, "Both?"),
        prompt(cache_arch_builder, A, "Just one."),
    ]
    a, b = prompts[0].images[0].key, prompts[0].images[1].key
    iris = engine(cache_arch_dir, max_num_batched_tokens=16, **switch, **NO_PREFIX)
    outputs = iris.generate(prompts, GREEDY)
    if "chunked_mm_encoding" in switch:  # the first chunk of the first request does both
        assert vision_calls(iris) == [[a, b]]
    else:  # per-request entries: the second request encodes A again, nothing is kept
        assert iris.stats().images_encoded == 3 and len(iris.embedding_cache) == 0
        assert sorted(key for _, key in encoded(iris)) == sorted([a, b, a])
    assert_parity(cache_arch_dir, prompts, outputs)


def sized_prompt(builder: PromptBuilder, image: Image.Image, max_pixels: int) -> PromptInput:
    """`PromptBuilder.build` with a request's max_pixels (as the tokenizer worker does)."""
    size = builder.image_size(max_pixels=max_pixels)
    content = [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    ids = builder.encode(builder.render_chat([{"role": "user", "content": content}]))
    pixels, grid = builder.resize_image(image, size)
    length = builder.num_image_tokens(grid)
    token_ids, [offset] = builder.expand(ids, [length])
    key = image_key(image.tobytes(), builder.image_settings(size))
    return PromptInput(
        Prompt(token_ids, [ImageRef(key, offset, length, grid)]), (torch.tensor(pixels),)
    )


def test_one_image_at_two_max_pixels_settings_is_two_entries(model_dir, builder):
    small, large = sized_prompt(builder, A, 28 * 28 * 4), sized_prompt(builder, A, 28 * 28 * 80)
    (few,), (many,) = small.images, large.images
    assert few.key != many.key and few.grid_thw != many.grid_thw and few.length < many.length
    iris = engine(model_dir, **NO_PREFIX)
    outputs = iris.generate([small, large], GREEDY)
    assert len(iris.embedding_cache) == 2 and iris.stats().images_encoded == 2
    assert iris.generate([large, small], GREEDY) == outputs[::-1]
    assert iris.stats().images_encoded == 2 and iris.stats().mm_embedding_cache_hits == 2
    assert_parity(model_dir, [small, large], outputs)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "thread"])
def test_preemption_recomputes_without_encoding_or_pixels(model_dir, builder, inline):
    prompts = [
        prompt(
            builder,
            make_image(80, 60, seed=30 + i),
            f"Story number {i}: " + "once upon a time " * (3 + i),
        )
        for i in range(4)
    ]
    longer = Sampling(temperature=0.0, max_tokens=24)
    longest = max(len(p.token_ids) for p in prompts) + longer.max_tokens
    pages = -(-longest // 8) + 2
    iris = engine(
        model_dir,
        page_size=8,
        num_kv_pages=pages,
        mm_encoder_placement="inline" if inline else "thread",
        **NO_PREFIX,
    )
    outputs = iris.generate(prompts, longer)
    assert iris.stats().num_preemptions > 0, "the pool was meant to force preemption"
    # each image went through the vision tower once; a recompute read no pixels (they
    # were dropped at the first use, so reading them would have failed)
    assert sorted(encoded(iris)) == sorted(p.images[0].key for p in prompts)
    assert_parity(model_dir, prompts, outputs, longer.max_tokens)
    assert iris.embedding_cache.num_held == 0


def test_pixels_are_reported_done_once_each_and_nothing_stays_pinned(model_dir, builder):
    prompts = {
        "twice": prompt(builder, A, FILLER, A, "Same picture twice?"),  # one entry, 2 pins
        "shared": prompt(builder, B, FILLER, A, "And these?"),
        "late": prompt(builder, FILLER, C, "Last one."),
    }
    iris = engine(model_dir, max_num_batched_tokens=24, **NO_PREFIX)
    for request_id, p in prompts.items():
        pins = [(request_id, i) for i in range(len(p.images))]
        iris.add_request(request_id, p, GREEDY, pins)
    requests = dict(iris.requests)
    reported: list[tuple[str, int]] = []
    while iris.has_unfinished_requests():
        finished = {out.request_id for out in iris.step() if out.finished}
        done = iris.pop_released_pins()
        for request_id, index in done:
            request = requests[request_id]
            assert not iris.pixels.has(request_id, index)
            assert request_id not in finished  # released at first use, not left for the end
            image = request.images[index]
            first = request.images[[i.key for i in request.images].index(image.key)]
            assert request.page_table.num_computed_tokens > first.offset  # not before it was needed
        reported += done
    expected = [(rid, i) for rid, p in prompts.items() for i in range(len(p.images))]
    assert sorted(reported) == sorted(expected) and len(set(reported)) == len(reported)
    assert iris.stats().pinned_images == 0
    assert iris.embedding_cache.num_held == 0 and iris.embedding_cache.pending_keys() == []
    assert iris.stats().images_encoded == 3


def test_an_abort_lets_go_of_the_entries_and_releases_each_pin_once(model_dir, builder):
    iris = engine(model_dir, max_num_batched_tokens=16, **NO_PREFIX)
    iris.add_request("gone", prompt(builder, A, FILLER, B, "?"), GREEDY, ["a", "b"])
    while iris.stats().images_encoded == 0:
        iris.step()
    assert iris.embedding_cache.num_held == 1 and iris.pop_released_pins() == ["a"]
    iris.abort("gone")
    assert iris.pop_released_pins() == ["b"] and iris.embedding_cache.num_held == 0
    assert iris.pop_released_pins() == [] and iris.stats().pinned_images == 0
    assert len(iris.embedding_cache) == 1  # kept for whoever sends A next


def test_the_pixel_store_releases_each_pin_once():
    store = PixelStore()
    store.add("r", [torch.zeros(1)] * 3, ["h0", None, "h2"])
    store.add("s", [torch.zeros(1)], ["k0"])
    store.drop("r", 2)
    store.drop("r", 2)
    store.drop("s", 0)
    store.drop("gone", 0)
    assert store.pop_released() == ["h2", "k0"] and store.num_pinned == 1
    assert store.has("r", 1) and not store.has("r", 2) and not store.has("s", 0)
    store.drop_request("r")
    store.drop_request("r")
    store.drop_request("s")
    assert store.pop_released() == ["h0"] and store.pop_released() == []
    assert store.num_pinned == 0
    with pytest.raises(RuntimeError, match="released"):
        store.get("r", 0)


class _Recorder:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message.handles)


def test_the_scheduler_process_sends_each_release_to_its_worker():
    def pointer(worker_id: int, offset: int) -> ShmPointer:
        return ShmPointer(worker_id, f"seg-{worker_id}", offset, 4, "float32", (1,), offset)

    loop = object.__new__(SchedulerLoop)
    loop.to_workers = [_Recorder(), _Recorder()]
    pins = [pointer(0, 0), pointer(1, 8), pointer(0, 16)]
    loop._send_releases(pins)
    assert loop.to_workers[0].sent == [[pins[0].handle, pins[2].handle]]
    assert loop.to_workers[1].sent == [[pins[1].handle]]


def test_a_key_whose_entry_has_another_token_count_is_never_a_hit(model_dir, builder, caplog):
    large = sized_prompt(builder, A, 28 * 28 * 80)
    small = sized_prompt(builder, A, 28 * 28 * 4)
    forged_image = msgspec.structs.replace(small.images[0], key=large.images[0].key)
    forged = PromptInput(Prompt(small.token_ids, [forged_image]), small.pixels)
    iris = engine(model_dir, **NO_PREFIX)
    iris.add_request("large", large, GREEDY, ["large"])
    iris.add_request("forged", forged, GREEDY, ["forged"])  # same step: in use, encode apart
    outputs: dict[str, list[int]] = {"large": [], "forged": []}
    done = []
    while iris.has_unfinished_requests():
        finished = set()
        for out in iris.step():
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
        released = iris.pop_released_pins()
        assert "forged" not in released or "forged" in finished  # the private one keeps pixels
        done += released
    assert iris.stats().images_encoded == 2 and done[0] == "large"
    assert sorted(done) == ["forged", "large"]
    wrong = f"has {large.images[0].length} tokens but the image spans {small.images[0].length}"
    assert wrong in caplog.text
    [again] = iris.generate([forged], GREEDY)  # unused now: replaced by the right one
    assert iris.stats().images_encoded == 3 and iris.embedding_cache.hits == 0
    assert_parity(model_dir, [large, forged, forged], [outputs["large"], outputs["forged"], again])
