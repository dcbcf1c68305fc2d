"""A video through the tokenizer worker equals transformers' processing of it, per model.

What is compared, for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (Qwen3-VL's processor):
the sampled frame indices, the grid, the prompt's token ids (video pads; Qwen3-VL's
timestamps and per-patch blocks), each temporal patch's resized uint8 pixels, its M-RoPE
time and whether it continues its video's block.

The reference is transformers' own code wherever it runs without torchvision (which Iris
does not install): Qwen3-VL's video processor (`sample_frames`, `smart_resize`), every
processor's `replace_video_token` (the prompt text), Qwen2.5-VL's
`get_vision_position_ids` (M-RoPE). Qwen2-VL's video processor module imports
torchvision, so its `sample_frames` method and `smart_resize` are compiled here from the
installed transformers' source file itself, unchanged.

Pixels: the processors resize frames with torchvision's `resize` (bicubic, antialiased),
which on the CPU passes a uint8 [frames, C, H, W] tensor to torch's `interpolate` as it is
(torchvision `transforms/v2/functional/_geometry.py`, `resize_image`: uint8 is an
accepted dtype for bicubic on the CPU, so nothing is cast). The reference below makes
that call on all sampled frames at once; the worker resizes frame by frame as it decodes.
"""

from __future__ import annotations

import ast
import json
import math
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    Qwen3VLVideoProcessor,
)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as qwen3_smart_resize,
)
from transformers.video_utils import VideoMetadata

from iris_serve.ipc.codec import unpack_token_ids
from iris_serve.ipc.messages import EngineRequest, Sampling, TokenizeRequest
from iris_serve.ipc.shm_arena import ShmReader
from iris_serve.tiny_checkpoint import reference_processor
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from iris_serve.tokenizer_worker.worker import TokenizerWorker
from tests.video_clips import decode_all, make_clip, video_data_url, video_part
from tests.worker_harness import worker_factory

torch.set_num_threads(2)

ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]
# (frames, fps, width, height): odd and even counts, fewer sampled frames than min_frames
# would give, a frame smaller than the Qwen3 factor, a rate that is no divisor
CLIPS = [(9, 10.0, 64, 48), (20, 8.0, 96, 64), (13, 30.0, 40, 30), (25, 12.5, 64, 48)]


def _from_transformers_source(relative: str, names: set[str]) -> dict[str, Callable]:
    """The named functions and methods of a transformers module, compiled from its
    installed source (for a module that imports torchvision)."""
    path = Path(transformers.__file__).parent / relative
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[ast.stmt] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found.append(node)
    namespace: dict = {"math": math, "torch": torch, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in names}


QWEN2_VIDEO = _from_transformers_source(
    "models/qwen2_vl/video_processing_qwen2_vl.py", {"sample_frames", "smart_resize"}
)


def reference_indices(model_dir: Path, total: int, fps: float) -> list[int]:
    metadata = VideoMetadata(total_num_frames=total, fps=fps)
    config = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    if config["video_processor_type"] == "Qwen3VLVideoProcessor":
        processor = Qwen3VLVideoProcessor.from_pretrained(model_dir)
        return [int(i) for i in processor.sample_frames(metadata)]
    stub = SimpleNamespace(num_frames=None, **config)  # the processor's attributes
    return QWEN2_VIDEO["sample_frames"](stub, metadata).tolist()


def reference_size(model_dir: Path, num_sampled: int, height: int, width: int):
    config = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    factor = config["patch_size"] * config["merge_size"]
    size = config["size"]
    if config["video_processor_type"] == "Qwen3VLVideoProcessor":
        return qwen3_smart_resize(
            num_sampled, height, width, 2, factor, size["shortest_edge"], size["longest_edge"]
        )
    return QWEN2_VIDEO["smart_resize"](
        height, width, factor, size["shortest_edge"], size["longest_edge"]
    )


def reference_resize(frames: list[np.ndarray], height: int, width: int) -> np.ndarray:
    """torchvision's CPU resize of the stacked uint8 frames (see the module's doc)."""
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
    if video.shape[-2:] != (height, width):
        video = torch.nn.functional.interpolate(
            video, size=[height, width], mode="bicubic", align_corners=False, antialias=True
        )
    return video.permute(0, 2, 3, 1).numpy()


def reference_video_text(model_dir: Path, grid: list[int], metadata: VideoMetadata) -> str:
    """What transformers' processor puts in place of the template's `<|video_pad|>`."""
    processor = reference_processor(model_dir)
    config = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    processor.video_processor = SimpleNamespace(
        merge_size=config["merge_size"], temporal_patch_size=config["temporal_patch_size"]
    )
    inputs = {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}
    return processor.replace_video_token(inputs, 0)


def reference_rope_times(model_dir: Path, grid: list[int], metadata: VideoMetadata) -> list[int]:
    config = json.loads((model_dir / "config.json").read_text())
    if config["model_type"] == "qwen2_vl":
        return list(range(grid[0]))
    if config["model_type"] != "qwen2_5_vl":
        return [0] * grid[0]  # Qwen3-VL: each patch is a block of its own
    # the processor's second_per_grid_ts, as the model receives it (a float32 tensor)
    second_per_grid = torch.tensor([2 / metadata.sampled_fps])[0]
    interval = config["vision_config"]["tokens_per_second"] * second_per_grid
    positions = Qwen2_5_VLModel.get_vision_position_ids(None, 0, torch.tensor(grid), 1, 2, interval)
    return positions[0].view(grid[0], -1)[:, 0].tolist()


@pytest.fixture(scope="module", params=ARCHS)
def arch_worker(
    request, tiny_checkpoint, tmp_path_factory
) -> Iterator[tuple[Path, TokenizerWorker]]:
    model_dir = tiny_checkpoint(request.param)
    builder = PromptBuilder(model_dir)
    with worker_factory(
        builder, f"test-{uuid.uuid4().hex[:12]}", tmp_path_factory.mktemp("run")
    ) as make:
        yield model_dir, make()


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}f@{c[1]:g}fps_{c[2]}x{c[3]}")
def test_a_video_is_processed_as_transformers_processes_it(arch_worker, clip):
    model_dir, worker = arch_worker
    num_frames, fps, width, height = clip
    data = make_clip(num_frames, fps, width, height)
    content = [video_part(video_data_url(data)), {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": content}]
    out = worker.handle(TokenizeRequest("r1", Sampling(), messages=messages))
    assert isinstance(out, EngineRequest), out

    indices = reference_indices(model_dir, num_frames, fps)
    resized_height, resized_width = reference_size(model_dir, len(indices), height, width)
    patch = json.loads((model_dir / "video_preprocessor_config.json").read_text())["patch_size"]
    grid = [-(-len(indices) // 2), resized_height // patch, resized_width // patch]
    metadata = VideoMetadata(total_num_frames=num_frames, fps=fps, frames_indices=indices)

    builder = worker.builder
    template_text = builder.render_chat(
        [{"role": "user", "content": [{"type": "video"}, content[1]]}]
    )
    text = template_text.replace(
        "<|video_pad|>", reference_video_text(model_dir, grid, metadata), 1
    )
    token_ids = unpack_token_ids(out.token_ids)
    assert token_ids == builder.encode(text)

    refs = out.images
    assert len(refs) == grid[0]
    video_pad = builder.video_token_id
    one_block = json.loads((model_dir / "config.json").read_text())["model_type"] in (
        "qwen2_vl",
        "qwen2_5_vl",
    )
    for j, ref in enumerate(refs):
        assert ref.grid_thw == (1, grid[1], grid[2]) and ref.frames == 2
        assert token_ids[ref.offset : ref.end] == [video_pad] * (grid[1] * grid[2] // 4)
        assert ref.continue_block == (one_block and j > 0)
        if one_block and j > 0:  # one run of pads, patch after patch
            assert ref.offset == refs[j - 1].end
    assert sum(ref.length for ref in refs) == token_ids.count(video_pad)
    assert [ref.rope_time for ref in refs] == reference_rope_times(model_dir, grid, metadata)

    frames = decode_all(data)
    sampled = [frames[i] for i in indices]
    sampled += [sampled[-1]] * (len(sampled) % 2)  # patchify's padding of an odd count
    expected = reference_resize(sampled, resized_height, resized_width)
    with ShmReader() as reader:
        for j, ref in enumerate(refs):
            assert ref.pixels is not None and ref.pixels.shape == (
                2,
                resized_height,
                resized_width,
                3,
            )
            np.testing.assert_array_equal(
                reader.view(ref.pixels).numpy(), expected[2 * j : 2 * j + 2]
            )
    worker.unpin(out)
    assert worker.arena.num_pinned == 0
