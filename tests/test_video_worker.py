"""Videos in the tokenizer worker: keys and reuse, uuids, options, limits and bad input.

How a video's frames, tokens and pixels compare with transformers is
tests/test_video_golden.py's; here, what the worker does around them: the same video or
an overlapping clip gives the same patch keys, a video sent again is not decoded again,
and every bad video or option is a 400 naming its part or option that leaves no pin."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from iris_serve.ipc.codec import unpack_token_ids
from iris_serve.ipc.messages import EngineRequest, RequestError, Sampling, TokenizeRequest
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from iris_serve.tokenizer_worker.worker import TokenizerWorker
from tests.reference import make_image
from tests.test_tokenizer_worker import data_url, image_part
from tests.video_clips import encode_clip, make_clip, recording, video_data_url, video_part
from tests.worker_harness import worker_factory

torch.set_num_threads(2)

CLIP = make_clip(9)


def ask(*parts: dict[str, Any], rid: str = "r1", **fields: Any) -> TokenizeRequest:
    content = [*parts, {"type": "text", "text": "What happens?"}]
    return TokenizeRequest(
        rid, Sampling(), messages=[{"role": "user", "content": content}], **fields
    )


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def builder(request, tiny_checkpoint) -> PromptBuilder:
    return PromptBuilder(tiny_checkpoint(request.param))


@pytest.fixture
def make_worker(builder: PromptBuilder, tmp_path: Path) -> Iterator[Callable[..., TokenizerWorker]]:
    instance = f"test-{uuid.uuid4().hex[:12]}"
    with worker_factory(
        builder, instance, tmp_path, allowed_local_media_path=str(tmp_path)
    ) as make:
        yield make


def answer(worker: TokenizerWorker, request: TokenizeRequest) -> EngineRequest:
    out = worker.handle(request)
    assert isinstance(out, EngineRequest), out
    return out


def test_the_same_video_again_has_the_same_keys_and_is_not_decoded_again(make_worker):
    worker = make_worker()
    first = answer(worker, ask(video_part(video_data_url(CLIP))))
    second = answer(worker, ask(video_part(video_data_url(CLIP)), rid="r2"))
    assert [ref.key for ref in first.images] == [ref.key for ref in second.images]
    assert len({ref.key for ref in first.images}) == len(first.images)  # a key per patch
    assert first.token_ids == second.token_ids
    assert [r.cache for r in first.reports] == ["none"] * len(first.images)
    assert [r.cache for r in second.reports] == ["processor"] * len(second.images)
    assert worker.videos is not None and worker.videos.loader.videos_decoded == 1
    worker.unpin(first)
    worker.unpin(second)
    assert worker.arena.num_pinned == 0


def test_other_video_settings_decode_again_with_other_keys(make_worker):
    worker = make_worker()
    default = answer(worker, ask(video_part(video_data_url(CLIP))))
    sparse = answer(worker, ask(video_part(video_data_url(CLIP)), rid="r2", num_frames=2))
    assert len(sparse.images) == 1 < len(default.images)
    assert worker.videos is not None and worker.videos.loader.videos_decoded == 2


def test_overlapping_clips_share_the_keys_of_the_patches_they_share(tiny_checkpoint, tmp_path):
    """Qwen2-VL samples every (video fps / 2)-th frame and resizes frame by frame, so two
    clips that start at the same frame share their first patches exactly (MJPG codes each
    frame on its own, so the shared frames decode alike)."""
    builder = PromptBuilder(tiny_checkpoint("qwen2_vl"))
    frames = recording(30)
    short, long = encode_clip(frames[:20], 10.0, "MJPG"), encode_clip(frames, 10.0, "MJPG")
    with worker_factory(builder, f"test-{uuid.uuid4().hex[:12]}", tmp_path) as make:
        worker = make()
        a = answer(worker, ask(video_part(video_data_url(short, "video/x-msvideo"))))
        b = answer(worker, ask(video_part(video_data_url(long, "video/x-msvideo")), rid="r2"))
        assert (len(a.images), len(b.images)) == (2, 3)  # frames 0, 5 | 10, 15 | 20, 25
        assert [ref.key for ref in b.images[:2]] == [ref.key for ref in a.images]
        assert b.reports[0].cache == "none"  # decoded; its shared patches were cache hits
        assert [ref.pixels for ref in b.images[:2]] == [ref.pixels for ref in a.images]


def test_a_uuid_names_a_video_sent_before(make_worker):
    worker = make_worker()
    sent = answer(worker, ask(video_part(video_data_url(CLIP), uuid="clip-1")))
    again = answer(worker, ask(video_part(None, uuid="clip-1"), rid="r2"))
    assert [ref.key for ref in again.images] == [ref.key for ref in sent.images]
    assert again.token_ids == sent.token_ids
    assert {r.uuid for r in again.reports} == {"clip-1"}
    unknown = worker.handle(ask(video_part(None, uuid="clip-2"), rid="r3"))
    assert isinstance(unknown, RequestError) and unknown.status == 400
    assert unknown.param == "messages[0].content[0]" and "clip-2" in unknown.message
    other_settings = worker.handle(ask(video_part(None, uuid="clip-1"), rid="r4", fps=1.0))
    assert isinstance(other_settings, RequestError) and "other video settings" in (
        other_settings.message
    )


def test_images_and_videos_keep_prompt_order(make_worker, builder: PromptBuilder):
    worker = make_worker()
    image = image_part(data_url(make_image(64, 48, seed=3)))
    out = answer(worker, ask(image, video_part(video_data_url(CLIP)), image))
    offsets = [ref.offset for ref in out.images]
    assert offsets == sorted(offsets)
    frames = [ref.frames for ref in out.images]
    assert frames[0] == frames[-1] == 1 and set(frames[1:-1]) == {2}
    assert {r.part for r in out.reports[1:-1]} == {"messages[0].content[1]"}
    ids = unpack_token_ids(out.token_ids)
    for ref in out.images:
        pad = builder.image_token_id if ref.frames == 1 else builder.video_token_id
        assert ids[ref.offset : ref.end] == [pad] * ref.length


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


# name → (request fields, worker config, the error's param, what its message says)
BAD_VIDEOS: dict[str, tuple[TokenizeRequest, dict[str, Any], str, str]] = {
    "not a video": (
        ask(video_part(video_data_url(b"\x00\x01" * 500))),
        {},
        "messages[0].content[0]",
        "not a video",
    ),
    "truncated, its index lost": (  # an MP4 whose index (moov) comes last
        ask(video_part(video_data_url(_half(make_clip(40))))),
        {},
        "messages[0].content[0]",
        "not a video",
    ),
    "truncated, frames lost": (  # an AVI's header counts the frames the file lost
        ask(video_part(video_data_url(_half(make_clip(40, codec="MJPG")), "video/x-msvideo"))),
        {},
        "messages[0].content[0]",
        "the video ends at frame 19 of the 40 its header announces",
    ),
    "no frames": (
        ask(video_part(video_data_url(encode_clip([], 10.0, "MJPG"), "video/x-msvideo"))),
        {},
        "messages[0].content[0]",
        "the video has no frames",
    ),
    "one frame": (
        ask(video_part(video_data_url(make_clip(1)))),
        {},
        "messages[0].content[0]",
        "the video has 1 frame(s)",
    ),
    "huge frames": (
        ask(video_part(video_data_url(CLIP))),
        {"max_image_pixels": 1000},
        "messages[0].content[0]",
        "more than the limit of 1000",
    ),
    "too many frames": (
        ask(video_part(video_data_url(CLIP))),
        {"max_video_frames": 5},
        "messages[0].content[0]",
        "the video has 9 frames, more than the limit of 5",
    ),
    "too large for the arena": (
        ask(video_part(video_data_url(CLIP))),
        {"arena_bytes": 16 << 10},
        "messages[0].content[0]",
        "image arena",
    ),
    "an image's data URL": (
        ask(video_part(data_url(make_image(8, 8)))),
        {},
        "messages[0].content[0]",
        "must start with data:video/",
    ),
    "a private host": (
        ask(video_part("http://127.0.0.1:9/clip.mp4")),
        {},
        "messages[0].content[0]",
        "refused",
    ),
    "a file outside the allowed folder": (
        ask(video_part("file:///etc/hostname")),
        {},
        "messages[0].content[0]",
        "not under the allowed local media path",
    ),
    "too many videos": (
        ask(*[video_part(video_data_url(CLIP))] * 3),
        {"limit_mm_per_prompt": {"video": 2}},
        "messages",
        "at most 2 videos per prompt",
    ),
    "too many frames asked": (
        ask(video_part(video_data_url(CLIP)), num_frames=1000),
        {},
        "mm_processor_kwargs.num_frames",
        "num_frames must be between 2 and 768",
    ),
    "a video pad in a completion": (
        TokenizeRequest("r1", Sampling(), prompt="a <|video_pad|> here"),
        {},
        "prompt",
        "the text must not contain <|video_pad|>",
    ),
}


@pytest.mark.parametrize("case", BAD_VIDEOS)
def test_a_bad_video_is_a_400_naming_its_part_that_leaks_nothing(make_worker, case):
    request, config, param, says = BAD_VIDEOS[case]
    worker = make_worker(**config)
    out = worker.handle(request)
    assert isinstance(out, RequestError), out
    assert (out.status, out.param) == (400, param), out
    assert says in out.message
    assert worker.arena.num_pinned == 0


def test_frame_bounds_are_refused_by_name_where_the_processor_has_none(make_worker, builder):
    out = make_worker().handle(ask(video_part(video_data_url(CLIP)), min_frames=8))
    if builder.video_settings is not None and builder.video_settings.one_block:
        assert isinstance(out, EngineRequest)  # Qwen2-VL's processor takes min_frames
        assert len(out.images) == 4  # 8 frames of 9, 2 a patch
    else:
        assert isinstance(out, RequestError), out
        assert (out.status, out.param) == (400, "mm_processor_kwargs.min_frames")


def test_a_full_arena_makes_a_video_wait_holding_nothing(make_worker):
    probe = answer(make_worker(), ask(video_part(video_data_url(CLIP))))
    assert probe.images[0].pixels is not None
    patch_bytes = probe.images[0].pixels.nbytes
    one_video = len(probe.images) * patch_bytes + patch_bytes // 2  # not two
    worker = make_worker(arena_bytes=one_video, enable_processor_cache=False)
    first = answer(worker, ask(video_part(video_data_url(CLIP))))
    assert worker.handle(ask(video_part(video_data_url(make_clip(9, fps=9.0))), rid="r2")) is None
    assert worker.arena.num_pinned == len(first.images)  # the waiting request holds nothing
    worker.unpin(first)
    [second] = worker.retry_waiting()
    assert isinstance(second, EngineRequest) and second.request_id == "r2"
