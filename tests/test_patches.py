"""uint8 pixels from the worker, `pixel_values` made on the device: together they are the
image processor's output, bit for bit, for every image mode and odd sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.encoder.patches import PatchMaker
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, cpu_engine, make_image

CPU = torch.device("cpu")


def transparent_palette(width: int, height: int) -> Image.Image:
    image = make_image(width, height, "P", seed=5)
    image.info["transparency"] = 3  # one palette entry is see-through
    return image


def sixteen_bit(width: int, height: int) -> Image.Image:
    levels = np.random.default_rng(6).integers(0, 65536, (height, width), dtype=np.uint16)
    return Image.fromarray(levels).convert("I;16")


# (name, image) pairs: every mode a decoder hands the worker, at sizes that are no
# multiple of the patch and need up- and downscaling, one of extreme aspect ratio
IMAGES = [
    ("RGB 97x53", lambda: make_image(97, 53, seed=1)),
    ("RGBA 301x211", lambda: make_image(301, 211, "RGBA", seed=2)),
    ("LA 50x61", lambda: make_image(50, 61, "LA", seed=3)),
    ("L 33x120", lambda: make_image(33, 120, "L", seed=4)),
    ("P 640x480", lambda: make_image(640, 480, "P", seed=5)),
    ("P with transparency 129x77", lambda: transparent_palette(129, 77)),
    ("CMYK 129x77", lambda: make_image(129, 77, "CMYK", seed=7)),
    ("1 90x70", lambda: make_image(90, 70, "1", seed=8)),
    ("I;16 81x60", lambda: sixteen_bit(81, 60)),
    ("RGB 1500x1100 (downscaled)", lambda: make_image(1500, 1100, seed=9)),
    ("RGB 900x20 (45:1)", lambda: make_image(900, 20, seed=10)),
]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def model_dir(request: pytest.FixtureRequest, tiny_checkpoint) -> Path:
    """Qwen2.5-VL's processor (14-px patches, CLIP mean and std; Qwen2-VL's too) and
    Qwen3-VL's (16-px patches, mean and std 0.5)."""
    return tiny_checkpoint(request.param)


def test_device_patches_equal_the_processor_pixel_values(model_dir: Path):
    builder = PromptBuilder(model_dir)
    patches = PatchMaker.from_checkpoint(model_dir, CPU, torch.float32)
    processor = builder.image_processor
    for name, make in IMAGES:
        image = make()
        expected = processor(images=[image], return_tensors="pt")
        pixels, grid = builder.resize_image(image)
        assert pixels.dtype == np.uint8 and pixels.shape == patches.pixel_shape(grid), name
        assert grid == tuple(expected["image_grid_thw"][0].tolist()), name
        made = patches([torch.from_numpy(pixels.copy())], [grid])
        assert made.dtype == torch.float32
        assert torch.equal(made, expected["pixel_values"]), f"{name}: differs from transformers"


def test_a_request_s_own_min_and_max_pixels_resize_as_the_processor_does(model_dir: Path):
    builder = PromptBuilder(model_dir)
    patches = PatchMaker.from_checkpoint(model_dir, CPU, torch.float32)
    image = make_image(211, 157, "RGBA", seed=11)
    factor = builder.resizer.patch_size * builder.resizer.merge_size
    for size in [(8 * factor * factor, 16 * factor * factor), (300 * 300, 600 * 600)]:
        expected = builder.image_processor(
            images=[image],
            size={"shortest_edge": size[0], "longest_edge": size[1]},
            return_tensors="pt",
        )
        pixels, grid = builder.resize_image(image, size)
        made = patches([torch.from_numpy(pixels.copy())], [grid])
        assert torch.equal(made, expected["pixel_values"]), size


def test_several_images_are_concatenated_in_order_and_bf16_is_the_fp32_rounded(model_dir):
    builder = PromptBuilder(model_dir)
    images = [builder.resize_image(make_image(w, h, seed=w)) for w, h in [(64, 90), (120, 33)]]
    pixels = [torch.from_numpy(p.copy()) for p, _ in images]
    grids = [grid for _, grid in images]
    fp32 = PatchMaker.from_checkpoint(model_dir, CPU, torch.float32)
    bf16 = PatchMaker.from_checkpoint(model_dir, CPU, torch.bfloat16)
    together = fp32(pixels, grids)
    alone = [fp32([p], [g]) for p, g in zip(pixels, grids, strict=True)]
    assert torch.equal(together, torch.cat(alone))
    rounded = bf16(pixels, grids)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, together.bfloat16())


def test_pixels_that_do_not_match_their_grid_are_refused_and_nothing_is_held(qwen2_vl_tiny):
    builder = PromptBuilder(qwen2_vl_tiny)
    engine = cpu_engine(qwen2_vl_tiny)
    prompt = chat_prompt(builder, "What is it?", [make_image(96, 64, seed=12)])
    (pixels,) = prompt.pixels
    assert pixels is not None
    wrong = [
        pixels[:-14],  # a patch row short
        pixels.float(),  # the processor's dtype, not the worker's
        pixels.permute(2, 0, 1),  # channels first
    ]
    for bad in wrong:
        with pytest.raises(ValueError, match="do not match the grid"):
            engine.add_request("bad", PromptInput(prompt.prompt, (bad,)), Sampling(max_tokens=2))
        assert not engine.requests and not engine.pixels.has("bad", 0)
        assert not engine.has_unfinished_requests()
    assert len(engine.generate([prompt], Sampling(max_tokens=2, temperature=0.0))[0]) == 2


def test_a_video_patch_keeps_its_frames_in_the_video_processors_layout(model_dir: Path):
    """Two different frames `[2, H, W, 3]` give the rows of transformers' video
    processor. Its module imports torchvision, which Iris does not install, so its
    `patchify` permutation is restated here (`Qwen2VLVideoProcessor.patchify`, 5.24)."""
    patches = PatchMaker.from_checkpoint(model_dir, CPU, torch.float32)
    p, m, t = patches.patch_size, patches.merge_size, patches.temporal_patch_size
    grid = (1, 2 * m, 3 * m)
    frames = torch.randint(0, 256, patches.pixel_shape(grid, frames=t), dtype=torch.uint8)
    values = patches.table.view(3, 256)[torch.arange(3), frames.long()]  # [T, H, W, C]
    videos = values.permute(0, 3, 1, 2)[None]  # [B, T, C, H, W], as the processor holds them
    gh, gw = grid[1], grid[2]
    expected = (
        videos.view(1, 1, t, 3, gh // m, m, p, gw // m, m, p)
        .permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
        .reshape(gh * gw, 3 * t * p * p)
    )
    rows = patches([frames], [grid])
    assert torch.equal(rows, expected)
    image = patches([frames[0]], [grid])  # one frame: an image, repeated
    assert not torch.equal(rows, image)
    with pytest.raises(ValueError, match="temporal patch has 2 frames"):
        patches([torch.zeros(3, *frames.shape[1:], dtype=torch.uint8)], [grid])
