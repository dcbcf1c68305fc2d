"""Client-supplied image ids (`uuid` on an image part): the worker's uuid map, the router
that sends a uuid to the worker that knows it, and the engine's images without pixels."""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import (
    EngineRequest,
    ImageReport,
    ReleaseImages,
    RequestError,
    RequestOutput,
    Sampling,
    TokenizeRequest,
)
from iris_serve.scheduler.encoder.given_images import RefusedImage
from iris_serve.scheduler.step.engine import Engine
from iris_serve.server.image_router import ImageRouter, affinity_hash, image_parts
from iris_serve.tokenizer_worker.images.uuids import Binding, ImageUuids
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from iris_serve.tokenizer_worker.worker import TokenizerWorker
from tests.reference import cpu_engine, make_image
from tests.test_tokenizer_worker import data_url, image_part
from tests.worker_harness import worker_factory

MiB = 1 << 20
SAMPLING = Sampling(max_tokens=4, temperature=0.0)
SMALL = data_url(make_image(64, 48, seed=1))
BIG = [data_url(make_image(300, 200, seed=s)) for s in (2, 3)]  # 177 KiB of pixels each


def uuid_part(uuid: Any, url: str | None = None) -> dict[str, Any]:
    return {"type": "image_url", "image_url": None if url is None else {"url": url}, "uuid": uuid}


def chat(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}]


def ask(worker: TokenizerWorker, *parts: dict[str, Any], **kw: Any) -> Any:
    rid = f"r{worker.requests_processed}"
    return worker.handle(TokenizeRequest(rid, SAMPLING, messages=chat(*parts), **kw))


def release(worker: TokenizerWorker, *requests: EngineRequest) -> None:
    for out in requests:
        worker.release(ReleaseImages([i.pixels.handle for i in out.images if i.pixels]))


@pytest.fixture(scope="module")
def builder(qwen2_vl_tiny: Path) -> PromptBuilder:
    return PromptBuilder(qwen2_vl_tiny)


@pytest.fixture
def make_worker(builder: PromptBuilder, tmp_path: Path) -> Iterator[Callable[..., TokenizerWorker]]:
    with worker_factory(builder, f"test-{uuidlib.uuid4().hex[:12]}", tmp_path) as make:
        yield make


# --- the worker -------------------------------------------------------------------------


def test_a_uuid_sent_with_data_names_the_image_later(make_worker):
    worker = make_worker()
    first = ask(worker, uuid_part("cat", SMALL))
    assert isinstance(first, EngineRequest), first
    assert first.reports == [ImageReport("messages[0].content[0]", "cat", "none")]
    later = ask(worker, uuid_part("cat"))
    assert isinstance(later, EngineRequest), later
    assert later.token_ids == first.token_ids
    [a], [b] = first.images, later.images
    assert (b.key, b.grid_thw, b.offset, b.length) == (a.key, a.grid_thw, a.offset, a.length)
    assert b.pixels == a.pixels  # the processor cache still holds them: no decode
    assert later.reports == [ImageReport("messages[0].content[0]", "cat", "processor")]
    stats = worker.stats()
    assert (stats.image_uuid_hits, stats.image_uuid_misses, stats.image_uuids) == (1, 0, 1)
    assert worker.images_processed == 1
    release(worker, first, later)
    assert worker.arena.num_pinned == 0


def test_an_unknown_uuid_is_a_400_naming_the_part_before_any_work(make_worker):
    worker = make_worker()
    out = ask(worker, image_part(SMALL), uuid_part("dog"))
    assert isinstance(out, RequestError), out
    assert (out.status, out.param) == (400, "messages[0].content[1]")
    assert "'dog'" in out.message and "send it again with its data" in out.message
    assert worker.images_processed == 0 and worker.arena.usage_bytes == 0
    assert worker.stats().image_uuid_misses == 1


def test_evicted_pixels_leave_the_image_to_the_embedding_cache(make_worker):
    worker = make_worker(arena_bytes=256 << 10)  # one BIG image, not two
    bound = ask(worker, uuid_part("shot", BIG[0]))
    release(worker, bound)
    other = ask(worker, image_part(BIG[1]))  # needs the room: evicts "shot"'s pixels
    release(worker, other)
    later = ask(worker, uuid_part("shot"))
    assert isinstance(later, EngineRequest), later
    [image] = later.images
    assert image.pixels is None and image.key == bound.images[0].key
    assert image.grid_thw == bound.images[0].grid_thw
    assert later.reports[0].cache == "none"  # the scheduler says what served it
    assert worker.arena.num_pinned == 0


def test_data_sent_again_under_a_uuid_rebinds_it(make_worker):
    worker = make_worker()
    one = ask(worker, uuid_part("x", SMALL))
    two = ask(worker, uuid_part("x", BIG[0]))  # the later data wins
    later = ask(worker, uuid_part("x"))
    assert one.images[0].key != two.images[0].key == later.images[0].key
    release(worker, one, two, later)


def test_a_binding_holds_for_its_min_max_pixels_only(make_worker):
    worker = make_worker()
    release(worker, ask(worker, uuid_part("x", SMALL)))
    other_size = ask(worker, uuid_part("x"), max_pixels=28 * 28 * 4)
    assert isinstance(other_size, RequestError) and other_size.status == 400
    assert "min/max pixels" in other_size.message


def test_a_uuid_bound_anywhere_in_a_request_names_its_image_everywhere_in_it(make_worker):
    worker = make_worker()
    out = ask(worker, uuid_part("x"), uuid_part("x", SMALL))
    assert isinstance(out, EngineRequest), out
    a, b = out.images
    assert a.key == b.key and a.pixels == b.pixels is not None
    assert [r.cache for r in out.reports] == ["processor", "none"]
    release(worker, out)


@pytest.mark.parametrize("bad", ["", "u" * 257, 7])
def test_a_bad_uuid_is_a_400_naming_the_part(make_worker, bad):
    out = ask(make_worker(), uuid_part(bad, SMALL))
    assert isinstance(out, RequestError) and (out.status, out.param) == (
        400,
        "messages[0].content[0]",
    )


def test_the_uuid_map_forgets_the_least_recently_used():
    uuids = ImageUuids(capacity=2)
    size = (1, 2)
    for name in "ab":
        uuids.bind(name, size, Binding(name.encode() * 16, (1, 2, 2), 1))
    assert uuids.recall("a", size) is not None  # a is now the most recent
    uuids.bind("c", size, Binding(b"c" * 16, (1, 2, 2), 1))
    assert uuids.recall("b", size) is None and len(uuids) == 2
    assert uuids.recall("a", size) and uuids.recall("c", size)
    assert uuids.recall("a", (1, 3)) is None  # another size: another binding
    assert (uuids.hits, uuids.misses) == (3, 2)


def test_the_worker_bounds_its_uuids(make_worker):
    worker = make_worker(max_image_uuids=2)
    for name in ("u0", "u1", "u2"):
        release(worker, ask(worker, uuid_part(name, SMALL)))
    assert worker.stats().image_uuids == 2
    assert isinstance(ask(worker, uuid_part("u0")), RequestError)
    release(worker, ask(worker, uuid_part("u2")))


# --- the router -------------------------------------------------------------------------


def test_a_uuid_alone_goes_where_its_data_went_whatever_the_load():
    router = ImageRouter(4)
    home = router.pick(chat(uuid_part("cat", "https://example.com/cat.png")), [0, 0, 0, 0])
    busy = [100 if worker == home else 0 for worker in range(4)]
    assert router.pick(chat(uuid_part("cat")), busy) == home
    # a URL alone would have yielded to balance
    assert router.pick(chat(image_part("https://example.com/cat.png")), busy) != home
    unknown = router.pick(chat(uuid_part("never")), [0, 0, 0, 0])
    assert unknown == affinity_hash("uuid:never") % 4  # that worker answers the 400


def test_the_router_forgets_uuids_past_its_capacity():
    router = ImageRouter(2, uuid_capacity=1)
    router.pick(chat(uuid_part("a", "https://x/a.png")), [0, 0])
    router.pick(chat(uuid_part("b", "https://x/b.png")), [0, 0])
    assert list(router._uuid_home) == ["b"]


def test_image_parts_reads_urls_and_uuids():
    parts = [uuid_part("a"), uuid_part("b", "u"), image_part("v"), uuid_part(3), {"type": "image"}]
    assert image_parts(chat(*parts)) == [(None, "a"), ("u", "b"), ("v", None)]


# --- the engine -------------------------------------------------------------------------


def run(engine: Engine, rid: str, prompt: PromptInput, reports: list[ImageReport]):
    engine.add_request(rid, prompt, SAMPLING, reports=reports)
    outputs: list[RequestOutput] = [o for o in engine.run_until_idle() if o.request_id == rid]
    return [t for o in outputs for t in o.new_token_ids], outputs[0].images


@pytest.fixture(scope="module")
def qwen25_builder(qwen2_5_vl_tiny: Path) -> PromptBuilder:
    return PromptBuilder(qwen2_5_vl_tiny)


def image_prompt(builder: PromptBuilder, seed: int) -> PromptInput:
    text = "Describe this picture in a few words, please, and be brief about it."
    content = [{"type": "image"}, {"type": "text", "text": text}]
    return builder.build(builder.render_chat([{"role": "user", "content": content}]),
                         [make_image(64, 48, seed=seed)])  # fmt: skip


REPORT = [ImageReport("messages[0].content[0]", "cat")]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_an_image_without_pixels_is_served_from_the_embedding_cache(
    qwen2_5_vl_tiny, qwen25_builder, prefix_caching
):
    engine = cpu_engine(qwen2_5_vl_tiny, enable_prefix_caching=prefix_caching)
    prompt = image_prompt(qwen25_builder, seed=5)
    tokens, reports = run(engine, "a", prompt, REPORT)
    assert reports == REPORT  # cache "none": decoded and encoded
    without = PromptInput(prompt.prompt, (None,))
    again, reports = run(engine, "b", without, REPORT)
    assert again == tokens
    assert reports[0].cache == ("prefix" if prefix_caching else "embedding")
    assert engine.stats().images_encoded == 1
    assert engine.embedding_cache.num_held == 0


def test_an_image_with_neither_pixels_nor_embedding_is_refused_holding_nothing(
    qwen2_5_vl_tiny, qwen25_builder
):
    engine = cpu_engine(qwen2_5_vl_tiny, mm_embedding_cache_bytes=0)  # kept while used only
    prompt = image_prompt(qwen25_builder, seed=6)
    run(engine, "a", prompt, REPORT)
    with pytest.raises(RefusedImage, match="send it again with its data") as refused:
        engine.add_request("b", PromptInput(prompt.prompt, (None,)), SAMPLING, reports=REPORT)
    assert refused.value.param == "messages[0].content[0]"
    assert not engine.requests and engine.embedding_cache.num_held == 0
    assert engine.stats().kv_pages_used == 0 and engine.pop_released_pins() == []
