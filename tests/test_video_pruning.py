"""Video token pruning (`--video-pruning-rate`, `tokenizer_worker/video/pruning.py`) in the
tokenizer worker and in the positions: which tokens a patch keeps, how many, under which
key, and where they sit.

q=0 (the default) changes nothing: every other video test runs with it, and here a
worker with the flag at 0 gives the very token ids, keys and spans of one without it.
With q>0 patch 0 keeps all its tokens and each later patch `max(1, round(n (1 - q)))`;
a static video keeps the first ones (ties go to the lower index), a moving region's
tokens are the ones kept; kept tokens sit at their unpruned positions and the text after
the video where it sits unpruned."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from iris_serve.ipc.codec import unpack_token_ids
from iris_serve.ipc.messages import EngineRequest, ImageRef, Sampling, TokenizeRequest
from iris_serve.launch.args import parse_serve_args
from iris_serve.launch.launcher import worker_config
from iris_serve.scheduler.models.mrope import mrope_positions
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from iris_serve.tokenizer_worker.video.pruning import (
    VideoPruner,
    dissimilarity,
    keep_count,
    pruned_key,
)
from iris_serve.tokenizer_worker.video.rules import VideoProcessorSettings
from iris_serve.tokenizer_worker.worker import TokenizerWorker
from tests.reference import prompt_positions
from tests.video_clips import encode_clip, make_clip, recording, video_data_url, video_part
from tests.worker_harness import worker_factory

CLIP = make_clip(12, width=128, height=96)  # at 10 fps: 6 patches of 12 tokens or so


def ask(url: str, rid: str = "r1") -> TokenizeRequest:
    """A question about the video at `url`, every frame of it sampled (at up to 10 fps)."""
    content = [video_part(url), {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": content}]
    return TokenizeRequest(rid, Sampling(), messages=messages, fps=10.0)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def builder(request, tiny_checkpoint) -> PromptBuilder:
    return PromptBuilder(tiny_checkpoint(request.param))


@pytest.fixture
def make_worker(builder: PromptBuilder, tmp_path: Path) -> Iterator[Callable[..., TokenizerWorker]]:
    with worker_factory(builder, f"test-{uuid.uuid4().hex[:12]}", tmp_path) as make:
        yield make


def answer(worker: TokenizerWorker, request: TokenizeRequest) -> EngineRequest:
    out = worker.handle(request)
    assert isinstance(out, EngineRequest), out
    worker.unpin(out)
    return out


def video_refs(out: EngineRequest) -> list[ImageRef]:
    return [ref for ref in out.images if ref.frames > 1]


def grid_tokens(ref: ImageRef) -> int:
    t, h, w = ref.grid_thw
    return t * h * w // 4


def positions(out: EngineRequest) -> tuple[torch.Tensor, list[int]]:
    """The request's M-RoPE positions, as the engine admits it, and its token ids."""
    ids = unpack_token_ids(out.token_ids)
    return prompt_positions(len(ids), out.images)[0], ids


# --- the choice ----------------------------------------------------------------------


def test_keep_count_is_a_per_patch_budget_of_at_least_one():
    assert keep_count(6, 0.5) == 3
    assert keep_count(6, 0.75) == 2  # round(1.5), Python's round half to even
    assert keep_count(6, 0.99) == 1
    assert keep_count(6, 0.0) == 6


def pruner(builder: PromptBuilder, rate: float) -> VideoPruner:
    settings = VideoProcessorSettings.from_checkpoint(builder.model_dir)
    assert settings is not None
    return VideoPruner(settings, rate)


def test_a_static_patch_keeps_the_first_tokens_and_a_moving_cell_is_kept(builder):
    prune = pruner(builder, 0.75)
    cell = prune.cell
    still = np.full((2, 2 * cell, 3 * cell, 3), 100, dtype=np.uint8)  # 6 tokens
    assert prune.kept(None, still) is None  # the first patch keeps all
    assert prune.kept(still, still) == (0, 1)  # ties: the lower indices
    moved = still.copy()
    moved[1, cell:, 2 * cell :] = 140  # token 5 (row 1, column 2), in the second frame
    moved[0, :4, cell : cell + 4] = 90  # a little of token 1
    assert prune.kept(still, moved) == (1, 5)
    scores = dissimilarity(still, moved, cell, prune.scale)
    assert scores.shape == (6,) and scores.argmax() == 5 and np.count_nonzero(scores) == 2


def test_the_measure_is_the_mean_absolute_difference_of_normalised_values(builder):
    prune = pruner(builder, 0.5)
    cell = prune.cell
    a = np.zeros((2, cell, cell, 3), dtype=np.uint8)
    b = a.copy()
    b[..., 0] = 51  # one channel, every pixel of both frames
    processor = builder.image_processor
    expected = 51 * processor.rescale_factor / processor.image_std[0] / 3
    assert dissimilarity(a, b, cell, prune.scale) == pytest.approx([expected])


def test_the_pruned_key_covers_the_predecessor_the_rate_and_the_choice():
    own, before, other = b"a" * 16, b"b" * 16, b"c" * 16
    key = pruned_key(own, before, 0.5, (0, 2))
    assert len(key) == 16 and key != own
    assert key == pruned_key(own, before, 0.5, (0, 2))
    assert key != pruned_key(own, other, 0.5, (0, 2))
    assert key != pruned_key(own, before, 0.75, (0, 2))
    assert key != pruned_key(own, before, 0.5, (0, 3))


# --- in the worker -------------------------------------------------------------------


def test_rate_zero_is_what_the_worker_gives_without_the_flag(make_worker):
    plain = answer(make_worker(), ask(video_data_url(CLIP)))
    zero = answer(make_worker(video_pruning_rate=0.0), ask(video_data_url(CLIP)))
    assert zero.token_ids == plain.token_ids
    assert [(r.key, r.offset, r.length, r.kept) for r in zero.images] == [
        (r.key, r.offset, r.length, None) for r in plain.images
    ]
    assert all(ref.length == grid_tokens(ref) for ref in video_refs(zero))


@pytest.mark.parametrize("rate", [0.5, 0.75])
def test_later_patches_keep_their_budget_and_go_by_pruned_keys(make_worker, rate):
    plain = answer(make_worker(), ask(video_data_url(CLIP)))
    pruned = answer(make_worker(video_pruning_rate=rate), ask(video_data_url(CLIP)))
    refs, full = video_refs(pruned), video_refs(plain)
    assert len(refs) == len(full) >= 3
    n = grid_tokens(refs[0])
    assert [ref.length for ref in refs] == [n] + [keep_count(n, rate)] * (len(refs) - 1)
    assert refs[0].kept is None and refs[0].key == full[0].key  # patch 0 is unpruned
    for ref, whole in zip(refs[1:], full[1:], strict=True):
        assert ref.kept is not None and len(ref.kept) == ref.length
        assert ref.key != whole.key and ref.grid_thw == whole.grid_thw
        assert ref.pixels is not None and whole.pixels is not None
        assert ref.pixels.shape == whole.pixels.shape  # the whole patch's pixels
    removed = sum(whole.length - ref.length for ref, whole in zip(refs, full, strict=True))
    assert len(pruned.token_ids) == len(plain.token_ids) - 4 * removed


def test_kept_tokens_and_the_text_after_the_video_keep_their_unpruned_positions(make_worker):
    plain = answer(make_worker(), ask(video_data_url(CLIP)))
    pruned = answer(make_worker(video_pruning_rate=0.75), ask(video_data_url(CLIP)))
    ours, ids = positions(pruned)
    theirs, plain_ids = positions(plain)
    for ref, whole in zip(video_refs(pruned), video_refs(plain), strict=True):
        cells = list(ref.kept) if ref.kept is not None else list(range(whole.length))
        unpruned = theirs[:, whole.offset : whole.end][:, cells]
        assert torch.equal(ours[:, ref.offset : ref.end], unpruned)
    after = len(ids) - video_refs(pruned)[-1].end
    assert after == len(plain_ids) - video_refs(plain)[-1].end > 0
    assert ids[-after:] == plain_ids[-after:]
    assert torch.equal(ours[:, -after:], theirs[:, -after:])


def test_a_static_video_keeps_the_minimum_and_its_moving_region_is_kept(make_worker, builder):
    """Motion JPEG codes each frame alone: identical frames decode identically."""
    frames = recording(1, 96, 64) * 8
    moving = [frame.copy() for frame in frames]
    for index, frame in enumerate(moving):  # a square brightening in the bottom right corner
        frame[-16:, -16:] = 30 * index
    rate = 0.5
    worker = make_worker(video_pruning_rate=rate)
    for clip, expect_moving in ((frames, False), (moving, True)):
        url = video_data_url(encode_clip(clip, fps=4.0, codec="MJPG"), "video/x-msvideo")
        refs = video_refs(answer(worker, ask(url, rid=f"r{expect_moving}")))
        n = grid_tokens(refs[0])
        count = keep_count(n, rate)
        for ref in refs[1:]:
            assert ref.kept is not None and len(ref.kept) == count
            if expect_moving:  # the token over the corner, then the first (ties)
                assert ref.kept == (*range(count - 1), n - 1)
            else:
                assert ref.kept == tuple(range(count))


def test_positions_refuse_kept_tokens_that_do_not_fit():
    grids, spans = [(1, 4, 6)], [(1, 2)]
    for kept in [(1, 0), (0, 6), (3,), (0, 0)]:
        with pytest.raises(ValueError):
            mrope_positions(5, spans, grids, 2, None, [kept])
    found, _ = mrope_positions(5, spans, grids, 2, None, [(0, 5)])
    assert found[:, 1:3].tolist() == [[1, 1], [1, 2], [1, 3]]  # cells (0, 0) and (1, 2)


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1", "nan", "half"])
def test_a_bad_pruning_rate_is_a_start_up_error_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(["--video-pruning-rate", value])
    assert "--video-pruning-rate" in capsys.readouterr().err


def test_a_good_pruning_rate_reaches_the_worker_config():
    args = parse_serve_args(["--video-pruning-rate", "0.75"])
    config = worker_config(args, 1, Path("/models/tiny"), "inst", Path("/tmp/run"))
    assert config.video_pruning_rate == 0.75
    default = worker_config(parse_serve_args([]), 1, Path("/models/tiny"), "inst", Path("/r"))
    assert default.video_pruning_rate == 0.0
