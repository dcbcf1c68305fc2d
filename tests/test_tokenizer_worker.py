"""The tokenizer worker: in-process logic over a real arena, and one real worker process."""

from __future__ import annotations

import base64
import contextlib
import io
import math
import multiprocessing as mp
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from math import prod
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from iris_serve.ipc.codec import unpack_token_ids
from iris_serve.ipc.messages import (
    SCHEDULER_TO_TOKENIZER,
    SERVER_TO_TOKENIZER,
    TO_SERVER,
    TOKENIZER_TO_SCHEDULER,
    AbortEngineRequest,
    AbortRequest,
    CoreReady,
    EngineRequest,
    MediaWork,
    ProcessFailed,
    ProcessReady,
    ReleaseImages,
    RequestError,
    Sampling,
    TokenizeRequest,
    WorkerStats,
)
from iris_serve.ipc.shm_arena import ShmArena, ShmReader
from iris_serve.ipc.shm_names import SHM_DIR, instance_prefix, segment_name, sweep
from iris_serve.ipc.sockets import PullSocket, PushSocket, ipc_address, new_run_dir
from iris_serve.scheduler.encoder.patches import PatchMaker
from iris_serve.tokenizer_worker import process as worker_process
from iris_serve.tokenizer_worker.config import WorkerConfig
from iris_serve.tokenizer_worker.process import _Loop, _Stop, run_worker
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from iris_serve.tokenizer_worker.worker import TokenizerWorker, drop_aborted
from tests.reference import make_image
from tests.worker_harness import worker_factory

MiB = 1 << 20
ONE_BIG = 256 << 10  # an arena that holds one `big` image, not two
SAMPLING = Sampling(max_tokens=7, temperature=0.5, seed=3, stop_token_ids=(5,))


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(encode(image, fmt)).decode()}"


def chat(*parts: dict[str, Any], text: str = "Describe.") -> list[dict[str, Any]]:
    return [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [*parts, {"type": "text", "text": text}]},
    ]


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def request(
    messages: Any = None, prompt: Any = None, rid: str = "r1", **kw: Any
) -> TokenizeRequest:
    return TokenizeRequest(rid, SAMPLING, messages=messages, prompt=prompt, **kw)


@pytest.fixture(scope="module")
def builder(qwen2_vl_tiny: Path) -> PromptBuilder:
    return PromptBuilder(qwen2_vl_tiny)


@pytest.fixture
def instance() -> Iterator[str]:
    instance = f"test-{uuid.uuid4().hex[:12]}"
    yield instance
    sweep(instance_prefix(instance))


@pytest.fixture
def make_worker(
    builder: PromptBuilder, instance: str, tmp_path: Path
) -> Iterator[Callable[..., TokenizerWorker]]:
    with worker_factory(
        builder, instance, tmp_path, allowed_local_media_path=str(tmp_path)
    ) as make:
        yield make


@pytest.fixture
def worker(make_worker: Callable[..., TokenizerWorker]) -> TokenizerWorker:
    return make_worker()


def release_all(worker: TokenizerWorker, engine_request: EngineRequest) -> None:
    handles = [image.pixels.handle for image in engine_request.images if image.pixels]
    worker.release(ReleaseImages(handles))


def test_chat_with_two_images(worker: TokenizerWorker, builder: PromptBuilder, tmp_path: Path):
    first, second = make_image(120, 90, seed=1), make_image(64, 48, "L", seed=2)
    (tmp_path / "second.png").write_bytes(encode(second))
    messages = chat(image_part(data_url(first)), image_part(f"file://{tmp_path}/second.png"))
    out = worker.handle(request(messages))
    assert isinstance(out, EngineRequest), out
    assert out.request_id == "r1" and out.sampling == SAMPLING

    template = chat({"type": "image"}, {"type": "image"})
    template[0]["role"] = "system"
    expected = builder.build(builder.render_chat(template), [first, second])
    assert unpack_token_ids(out.token_ids) == expected.token_ids
    patches = PatchMaker.from_checkpoint(builder.model_dir, torch.device("cpu"), torch.float32)
    with ShmReader() as reader:
        for ref, image, want in zip(out.images, (first, second), expected.images, strict=True):
            assert (ref.offset, ref.length, ref.grid_thw) == (
                want.offset,
                want.length,
                want.grid_thw,
            )
            assert ref.pixels is not None and ref.pixels.dtype == "uint8"
            # the arena's uint8 image, made into rows as the scheduler does: transformers'
            hf = builder.image_processor(images=[image], return_tensors="pt")["pixel_values"]
            made = patches([reader.view(ref.pixels)], [ref.grid_thw])
            torch.testing.assert_close(made, hf, rtol=0, atol=0)
            assert len(ref.key) == 16
    assert out.images[0].key != out.images[1].key
    assert worker.arena.num_pinned == 2
    release_all(worker, out)
    assert worker.arena.num_pinned == 0
    assert worker.arena.cached_bytes == worker.arena.usage_bytes > 0  # kept as a cache


def test_chat_template_kwargs_reach_the_template(worker: TokenizerWorker, builder: PromptBuilder):
    """Qwen2-VL's template numbers images under `add_vision_id`: the variable must get there."""
    image = make_image(64, 48, seed=3)
    messages = chat(image_part(data_url(image)))
    plain = worker.handle(request(messages))
    numbered = worker.handle(
        request(messages, rid="r2", chat_template_kwargs={"add_vision_id": True})
    )
    assert isinstance(plain, EngineRequest) and isinstance(numbered, EngineRequest)
    template = chat({"type": "image"})
    template[0]["role"] = "system"
    text = builder.render_chat(template, add_vision_id=True)
    assert "Picture 1: " in text
    assert unpack_token_ids(numbered.token_ids) == builder.build(text, [image]).token_ids
    assert unpack_token_ids(numbered.token_ids) != unpack_token_ids(plain.token_ids)
    release_all(worker, plain)
    release_all(worker, numbered)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_a_tool_round_trip_is_rendered_as_qwen_writes_it(worker: TokenizerWorker, builder):
    """Tools in the system turn, the assistant's call with its arguments as an object
    (OpenAI sends a JSON string; encoded again it would read as a string), the tool's
    result as a <tool_response> in a user turn; an image in the history still counts."""
    image = make_image(64, 48, seed=5)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        *chat(image_part(data_url(image)), text="Weather where this was taken?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 22C"},
    ]
    out = worker.handle(request(messages, tools=TOOLS))
    assert isinstance(out, EngineRequest), out
    text = builder.tokenizer.decode(unpack_token_ids(out.token_ids))
    assert '\n<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 22C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n") and len(out.images) == 1
    release_all(worker, out)

    bad = dict(call, function={"name": "get_weather", "arguments": "{not json"})
    refused = worker.handle(request([*messages[:2], {"role": "assistant", "tool_calls": [bad]}],
                                    rid="r2", tools=TOOLS))  # fmt: skip
    assert isinstance(refused, RequestError) and "arguments is not valid JSON" in refused.message
    assert worker.arena.num_pinned == 0


def test_cache_hit_skips_processing_and_min_max_pixels_change_the_key(worker: TokenizerWorker):
    url = data_url(make_image(200, 150, seed=4), "JPEG")
    messages = chat(image_part(url), image_part(url))  # the same image twice
    out = worker.handle(request(messages))
    assert isinstance(out, EngineRequest) and worker.images_processed == 1
    a, b = out.images
    assert a.key == b.key and a.pixels == b.pixels and b.offset > a.end
    again = worker.handle(request(messages, rid="r2"))
    assert isinstance(again, EngineRequest) and worker.images_processed == 1
    assert [i.pixels for i in again.images] == [a.pixels, a.pixels]
    assert worker.arena.num_pinned == 1  # one entry, four pins
    small = worker.handle(request(chat(image_part(url)), rid="r3", max_pixels=28 * 28 * 4))
    assert isinstance(small, EngineRequest) and worker.images_processed == 2
    t, h, w = small.images[0].grid_thw
    assert small.images[0].key != a.key and t * h * w <= 16 < prod(a.grid_thw)
    for done in (out, again, small):
        release_all(worker, done)
    assert worker.arena.num_pinned == 0


def test_a_full_hd_image_costs_a_few_bytes_on_the_wire_and_an_eighth_in_the_arena(
    worker: TokenizerWorker, builder: PromptBuilder
):
    size = builder.image_size(max_pixels=12845056)  # Qwen2-VL's published bound: full size
    out = worker.handle(
        request(chat(image_part(data_url(make_image(1920, 1080), "JPEG"))), max_pixels=size[1])
    )
    assert isinstance(out, EngineRequest)
    [image] = out.images
    assert image.length > 1000
    wire = TOKENIZER_TO_SCHEDULER.encode(out)
    assert len(wire) < 4096 + 4 * out.num_tokens  # no pixel bytes cross ZMQ
    # 3 bytes per resized pixel, where the processor's float32 rows take 24
    assert image.pixels is not None and image.pixels.shape == (1092, 1932, 3)
    float_rows = 4 * 3 * 2 * 14 * 14 * (1092 // 14) * (1932 // 14)
    assert image.pixels.nbytes == 1092 * 1932 * 3 == float_rows // 8
    release_all(worker, out)


def test_completions_prompt_as_text_and_as_token_ids(
    worker: TokenizerWorker, builder: PromptBuilder
):
    out = worker.handle(request(prompt="The quick brown fox"))
    assert isinstance(out, EngineRequest) and out.images == []
    assert unpack_token_ids(out.token_ids) == builder.tokenizer.encode("The quick brown fox")
    out = worker.handle(request(prompt=[1, 2, 3, 1500]))
    assert isinstance(out, EngineRequest)
    assert unpack_token_ids(out.token_ids) == [1, 2, 3, 1500]


PNG = encode(make_image(40, 30, seed=5))
OK = image_part(data_url(make_image(40, 30, seed=5)))
BAD_REQUESTS = {
    "too many images": (dict(messages=chat(OK, OK, OK, OK)), "messages", "at most 3 images"),
    "bad base64": (
        dict(messages=chat(image_part("data:image/png;base64,@@@@"))),
        "messages[1].content[0]",
        "messages[1].content[0]: invalid base64",
    ),
    "not an image": (
        dict(messages=chat(image_part("data:image/png;base64,aGVsbG8="))),
        "messages[1].content[0]",
        "not an image",
    ),
    "truncated": (
        dict(
            messages=chat(
                OK, image_part("data:image/png;base64," + base64.b64encode(PNG[:-60]).decode())
            )
        ),
        "messages[1].content[1]",
        "messages[1].content[1]: cannot decode",
    ),
    "outside the allowed path": (
        dict(messages=chat(image_part("/etc/hostname"))),
        "messages[1].content[0]",
        "not under",
    ),
    "scheme": (
        dict(messages=chat(image_part("gopher://x/a.png"))),
        "messages[1].content[0]",
        "unsupported URL scheme",
    ),
    "private host": (  # refused before any connection is made
        dict(messages=chat(OK, image_part("http://127.0.0.1:9/a.png"))),
        "messages[1].content[1]",
        "messages[1].content[1]: refused http://127.0.0.1:9/a.png: 127.0.0.1 is a loopback "
        "address: media is not fetched from loopback, private",
    ),
    "role": (
        dict(messages=[{"role": "function", "content": "x"}]),
        "messages",
        "unsupported role 'function'",
    ),
    "part": (
        dict(messages=chat({"type": "input_audio"})),
        "messages[1].content[0].type",
        "unsupported content part type 'input_audio' (text, image_url, video_url, image_embeds)",
    ),
    "image part": (  # Qwen's form: refused, as the server's protocol refuses it
        dict(messages=chat({"type": "image", "image": "https://example.com/a.png"})),
        "messages[1].content[0].type",
        "unsupported content part type 'image'",
    ),
    "pad in text": (dict(messages=chat(text="<|image_pad|>")), "messages", "0 images"),
    "aspect ratio": (
        dict(messages=chat(image_part(data_url(make_image(1000, 4))))),
        "messages[1].content[0]",
        "aspect ratio",
    ),
    "arena too small": (
        dict(messages=chat(OK), min_pixels=30_000_000, max_pixels=40_000_000),
        "messages[1].content[0]",
        "lower max_pixels",
    ),
    "min over max": (
        dict(messages=chat(OK), min_pixels=5000, max_pixels=4000),
        "min_pixels",
        "larger",
    ),
    "max_pixels": (dict(messages=chat(OK), max_pixels=-1), "max_pixels", "positive"),
    "token id": (dict(prompt=[1, 1 << 20]), "prompt", "out of the vocabulary"),
    "empty prompt": (dict(prompt=""), "prompt", "empty"),
    "pad in prompt": (dict(prompt=[1534]), "prompt", "1 image placeholders for 0 images"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_is_a_400_that_leaks_nothing(
    make_worker: Callable[..., TokenizerWorker], case: str
):
    worker = make_worker(limit_mm_per_prompt={"image": 3})
    fields, param, message = BAD_REQUESTS[case]
    out = worker.handle(request(**fields))
    assert isinstance(out, RequestError), out
    assert (out.request_id, out.status, out.param) == ("r1", 400, param)
    assert message in out.message
    assert worker.arena.num_pinned == 0
    assert worker.arena.usage_bytes == worker.arena.cached_bytes  # at most valid cached images
    if case != "truncated":
        assert worker.arena.usage_bytes == 0


def big(seed: int, rid: str) -> TokenizeRequest:
    """A request for one image of 177 KiB of pixels: one fits a ONE_BIG arena, two do not."""
    return request(chat(image_part(data_url(make_image(300, 200, seed=seed)))), rid=rid)


def test_a_full_arena_makes_a_request_wait_for_releases(
    make_worker: Callable[..., TokenizerWorker],
):
    worker = make_worker(arena_bytes=ONE_BIG)
    one = worker.handle(big(1, "r1"))
    assert isinstance(one, EngineRequest)
    assert worker.handle(big(2, "r2")) is None  # waits, holding nothing
    assert (worker.arena.num_pinned, worker.stats().arena_waiting_requests) == (1, 1)
    assert worker.retry_waiting() == []  # nothing was released
    # Meanwhile other requests flow: a text prompt, and a cache hit on the pinned image.
    assert isinstance(worker.handle(request(prompt="hi", rid="text")), EngineRequest)
    hit = worker.handle(big(1, "hit"))
    assert isinstance(hit, EngineRequest) and worker.cache.hits == 1
    release_all(worker, one)
    assert worker.retry_waiting() == []  # the entry is still pinned, by "hit"
    release_all(worker, hit)
    [done] = worker.retry_waiting()
    assert isinstance(done, EngineRequest) and done.request_id == "r2"
    assert (worker.arena.num_pinned, worker.stats().arena_waiting_requests) == (1, 0)
    assert worker.expire_waiting(math.inf) == []
    release_all(worker, done)
    assert worker.arena.num_pinned == 0


def test_a_request_that_can_never_fit_is_a_400_at_once(
    make_worker: Callable[..., TokenizerWorker],
):
    worker = make_worker(arena_bytes=ONE_BIG)
    small = worker.handle(request(chat(image_part(data_url(make_image(56, 56)))), rid="s"))
    assert isinstance(small, EngineRequest)  # pinned: the arena is not empty
    both = chat(*(image_part(data_url(make_image(300, 200, seed=s))) for s in (3, 4)))
    for rid, pinned in (("r3", 1), ("r4", 0)):  # more than the arena by itself, at once
        alone = worker.handle(request(both, rid=rid))
        assert isinstance(alone, RequestError), alone
        assert (alone.status, alone.param) == (400, "messages")
        assert f"need more than the {ONE_BIG}-byte image arena" in alone.message
        assert (worker.arena.num_pinned, len(worker.waiting)) == (pinned, 0)
        if pinned:
            release_all(worker, small)
    # One that waited is a 400 once nothing else holds the arena and it still finds no room.
    worker = make_worker(arena_bytes=ONE_BIG)
    one = worker.handle(big(1, "r1"))
    assert isinstance(one, EngineRequest)
    assert worker.handle(request(both, rid="r5")) is None  # its first image alone finds no room
    release_all(worker, one)
    [late] = worker.retry_waiting()
    assert (late.request_id, late.status, late.param) == ("r5", 400, "messages")
    assert worker.arena.num_pinned == 0


def test_abort_while_waiting_drops_the_request_with_nothing_pinned(
    make_worker: Callable[..., TokenizerWorker],
):
    worker = make_worker(arena_bytes=ONE_BIG)
    one = worker.handle(big(1, "r1"))
    assert isinstance(one, EngineRequest)
    assert worker.handle(big(2, "r2")) is None
    assert worker.handle(AbortRequest("r2")) == AbortEngineRequest("r2")
    assert worker.stats().arena_waiting_requests == 0
    release_all(worker, one)
    assert worker.retry_waiting() == []  # no answer: it is gone
    assert worker.arena.num_pinned == 0


def test_a_wait_past_its_timeout_is_a_503(make_worker: Callable[..., TokenizerWorker]):
    worker = make_worker(arena_bytes=ONE_BIG, arena_wait_timeout_s=0.01)
    one = worker.handle(big(1, "r1"))
    assert isinstance(one, EngineRequest)
    assert worker.handle(big(2, "r2")) is None
    assert worker.expire_waiting(time.monotonic() - 60) == []  # before its deadline
    [busy] = worker.expire_waiting(time.monotonic() + 1)
    assert (busy.request_id, busy.status, busy.type) == ("r2", 503, "server_busy")
    assert "stayed full of images in flight for 0.01 s" in busy.message
    assert (worker.arena.num_pinned, len(worker.waiting)) == (1, 0)
    assert worker.handle(big(3, "r3")) is None
    [stopped] = worker.drop_waiting()  # the worker stops: every waiting request is a 503
    assert (stopped.request_id, stopped.status, stopped.type) == ("r3", 503, "server_busy")
    at_once = make_worker(arena_bytes=ONE_BIG, arena_wait_timeout_s=0)
    assert isinstance(at_once.handle(big(1, "r1")), EngineRequest)
    busy = at_once.handle(big(2, "r2"))  # no waiting at all
    assert isinstance(busy, RequestError) and (busy.status, busy.type) == (503, "server_busy")


def test_unexpected_errors_are_500s_and_release_pins(worker: TokenizerWorker, monkeypatch):
    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(worker.builder, "splice", broken)  # after the images are pinned
    out = worker.handle(request(chat(OK)))
    assert isinstance(out, RequestError)
    assert (out.status, out.type, out.param) == (500, "server_error", None)
    assert "RuntimeError: boom" in out.message
    assert worker.arena.num_pinned == 0


def test_abort_release_and_batches(worker: TokenizerWorker):
    assert worker.handle(AbortRequest("r9")) == AbortEngineRequest("r9")
    out = worker.handle(request(chat(OK)))
    assert isinstance(out, EngineRequest)
    release_all(worker, out)
    release_all(worker, out)  # a double release is logged and ignored
    assert worker.arena.num_pinned == 0
    a, b = request(prompt="a", rid="a"), request(prompt="b", rid="b")
    batch = [a, b, AbortRequest("a"), AbortRequest("z")]
    assert drop_aborted(batch) == [b, AbortRequest("a"), AbortRequest("z")]


# --- the process ------------------------------------------------------------------------


def receive(socket: PullSocket, kind: type, timeout: float = 30.0) -> Any:
    """The next message of `kind` (skipping others), or fail after `timeout` seconds."""
    return receive_through(socket, kind, timeout)[-1]


def receive_through(socket: PullSocket, kind: type, timeout: float = 30.0) -> list[Any]:
    """Every message up to and including the next one of `kind`, or fail after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    messages = []
    while (left := deadline - time.monotonic()) > 0:
        message = socket.recv(left)
        if message is not None:
            messages.append(message)
        if isinstance(message, kind):
            return messages
    raise AssertionError(f"no {kind.__name__} within {timeout} s")


def test_worker_process(qwen2_vl_tiny: Path, instance: str):
    run_dir = new_run_dir()
    config = WorkerConfig(0, str(qwen2_vl_tiny), str(run_dir), instance, arena_bytes=8 * MiB)
    context = mp.get_context("spawn")
    ready = context.Queue()
    process = context.Process(target=run_worker, args=(config, ready), name="tokenizer-0")
    scheduler = PullSocket(TOKENIZER_TO_SCHEDULER, ipc_address(run_dir, "scheduler"))
    server = PullSocket(TO_SERVER, ipc_address(run_dir, "server"))
    requests = PushSocket(SERVER_TO_TOKENIZER, ipc_address(run_dir, "tokenizer-0"))
    releases = PushSocket(SCHEDULER_TO_TOKENIZER, ipc_address(run_dir, "release-0"))
    process.start()
    try:
        assert ready.get(timeout=60) == ProcessReady("tokenizer-0")
        requests.send(request(chat(OK)))
        out = receive(scheduler, EngineRequest)
        assert out.request_id == "r1" and len(out.images) == 1
        with ShmReader() as reader:
            assert reader.view(out.images[0].pixels).shape[2] == 3  # [H, W, RGB]
        releases.send(ReleaseImages([out.images[0].pixels.handle]))
        requests.send(request(chat(image_part("data:image/png;base64,!!")), rid="bad"))
        to_server = receive_through(server, RequestError)
        error = to_server[-1]
        assert (error.request_id, error.status, error.param) == (
            "bad",
            400,
            "messages[1].content[0]",
        )
        requests.send(AbortRequest("r1"))
        assert receive(scheduler, AbortEngineRequest) == AbortEngineRequest("r1")
        # A request's counters reach the server before its reply; the release's later.
        stats = [m for m in to_server if isinstance(m, WorkerStats)]
        assert stats and stats[-1].requests_processed == 2
        while stats[-1].arena_pinned_entries:
            stats.append(receive(server, WorkerStats))
        assert stats[-1].arena_used_bytes > 0  # the image stays cached, unpinned
    finally:
        process.terminate()
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(5)
        for socket in (scheduler, server, requests, releases):
            socket.close(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert process.exitcode == 0  # SIGTERM is a clean exit
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(instance_prefix(instance))]


def test_worker_process_start_up_failure_is_reported_and_cleaned_up(
    qwen2_vl_tiny: Path, instance: str, tmp_path: Path
):
    missing = tmp_path / "no-such-run-dir"  # binding its sockets fails after the arena exists
    config = WorkerConfig(1, str(qwen2_vl_tiny), str(missing), instance, arena_bytes=MiB)
    context = mp.get_context("spawn")
    ready = context.Queue()
    process = context.Process(target=run_worker, args=(config, ready))
    process.start()
    try:
        report = ready.get(timeout=60)
        process.join(30)
    finally:
        if process.is_alive():
            process.kill()
            process.join(5)
    assert isinstance(report, ProcessFailed) and report.name == "tokenizer-1"
    assert process.exitcode == 1 and "ZMQError" in report.error
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(instance_prefix(instance))]


# --- the loop: waiting for arena room -----------------------------------------------------


Sockets = tuple[PushSocket, PushSocket, PullSocket, PullSocket]


@contextlib.contextmanager
def loop_in_thread(builder: PromptBuilder, instance: str, **config: Any) -> Iterator[Sockets]:
    """The worker process's loop, over a ONE_BIG arena and real sockets, in a thread; yields
    the sockets of the server (requests), the scheduler (releases) and their inboxes."""
    run_dir = new_run_dir()
    cfg = WorkerConfig(0, str(builder.model_dir), str(run_dir), instance, ONE_BIG, **config)
    scheduler = PullSocket(TOKENIZER_TO_SCHEDULER, ipc_address(run_dir, "scheduler"))
    server = PullSocket(TO_SERVER, ipc_address(run_dir, "server"))
    requests = PushSocket(SERVER_TO_TOKENIZER, ipc_address(run_dir, "tokenizer-0"))
    releases = PushSocket(SCHEDULER_TO_TOKENIZER, ipc_address(run_dir, "release-0"))
    stop = _Stop()

    def run() -> None:
        def open_worker(media_work: Callable[[], Any]) -> TokenizerWorker:
            arena = ShmArena(segment_name(instance, 0), cfg.arena_bytes)
            return TokenizerWorker(cfg, builder, arena, media_work=media_work)

        loop = _Loop(cfg, stop, open_worker)
        try:
            loop.run()
        finally:
            loop.close()
            loop.worker.close()

    thread = threading.Thread(target=run, name="tokenizer-0")
    thread.start()
    try:
        yield requests, releases, scheduler, server
    finally:
        stop.set()
        thread.join(30)
        for socket in (scheduler, server, requests, releases):
            socket.close(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert not thread.is_alive()


def stats_until(server: PullSocket, ok: Callable[[WorkerStats], bool]) -> WorkerStats:
    """The first WorkerStats that is `ok` (no RequestError before it), within 30 s."""
    deadline = time.monotonic() + 30
    while (left := deadline - time.monotonic()) > 0:
        message = server.recv(left)
        assert not isinstance(message, RequestError), message
        if isinstance(message, WorkerStats) and ok(message):
            return message
    raise AssertionError("no such WorkerStats within 30 s")


def test_media_work_is_announced_and_starts_once_the_scheduler_leaves_a_core(
    builder: PromptBuilder, instance: str, monkeypatch: pytest.MonkeyPatch
):
    """A request with an image: `MediaWork(busy)` reaches the scheduler first, and the worker
    decodes nothing until the `CoreReady` with its seq comes (a stale one does not count);
    then `MediaWork(idle)` and the request. A text request says nothing of media."""
    monkeypatch.setattr(worker_process, "CORE_WAIT_SECONDS", 60.0)
    with loop_in_thread(builder, instance) as (requests, releases, scheduler, _):
        requests.send(big(1, "r1"))
        busy = receive(scheduler, MediaWork)
        assert (busy.worker_id, busy.busy) == (0, True)
        releases.send(CoreReady(busy.seq + 99))
        assert scheduler.recv(0.5) is None, "the worker went on before its core was ready"
        releases.send(CoreReady(busy.seq))
        idle, engine_request = receive_through(scheduler, EngineRequest)
        assert idle == MediaWork(0, busy=False, seq=busy.seq) and engine_request.request_id == "r1"
        requests.send(request(prompt="hi", rid="text"))
        through = receive_through(scheduler, EngineRequest)
        assert [type(m) for m in through] == [EngineRequest]


def test_an_unanswered_media_work_waits_a_bounded_time(
    builder: PromptBuilder, instance: str, monkeypatch: pytest.MonkeyPatch
):
    """No scheduler answers (it is in a long step): the worker goes on after the wait."""
    monkeypatch.setattr(worker_process, "CORE_WAIT_SECONDS", 0.05)
    with loop_in_thread(builder, instance) as (requests, _, scheduler, _):
        requests.send(big(1, "r1"))
        assert receive(scheduler, EngineRequest).request_id == "r1"


def test_the_loop_serves_others_while_a_request_waits(builder: PromptBuilder, instance: str):
    with loop_in_thread(builder, instance) as (requests, releases, scheduler, server):
        requests.send(big(1, "r1"))
        one = receive(scheduler, EngineRequest)
        requests.send(big(2, "r2"))  # the arena is full: it waits
        requests.send(big(3, "r3"))  # and this one behind it
        requests.send(request(prompt="hi", rid="text"))
        assert receive(scheduler, EngineRequest).request_id == "text"  # the loop is not held
        stats_until(server, lambda s: s.arena_waiting_requests == 2)
        requests.send(AbortRequest("r3"))
        assert receive(scheduler, AbortEngineRequest) == AbortEngineRequest("r3")
        stats_until(server, lambda s: s.arena_waiting_requests == 1)
        releases.send(ReleaseImages([one.images[0].pixels.handle]))
        two = receive(scheduler, EngineRequest)
        assert two.request_id == "r2" and two.images[0].pixels is not None
        releases.send(ReleaseImages([two.images[0].pixels.handle]))
        # The aborted request is not tried again: nothing stays pinned, nothing waits.
        stats_until(server, lambda s: (s.arena_pinned_entries, s.arena_waiting_requests) == (0, 0))
        assert scheduler.recv(0) is None


def test_the_loop_answers_a_wait_past_its_timeout_with_a_503(builder: PromptBuilder, instance: str):
    with loop_in_thread(builder, instance, arena_wait_timeout_s=0.2) as sockets:
        requests, _, scheduler, server = sockets
        requests.send(big(1, "r1"))
        receive(scheduler, EngineRequest)
        requests.send(big(2, "r2"))
        busy = receive(server, RequestError)
        assert (busy.request_id, busy.status, busy.type) == ("r2", 503, "server_busy")
        assert all(isinstance(m, MediaWork) for m in scheduler.drain())  # r2 never went
