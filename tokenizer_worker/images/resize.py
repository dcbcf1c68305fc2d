"""An image converted and resized exactly as the checkpoint's image processor does it,
kept as uint8: what the worker stores in its arena.

Of the Qwen-VL processors' four steps (convert to RGB, transparency composited onto
white; resize, bicubic, to a multiple of patch × merge pixels within min/max pixels;
rescale and normalise; patchify) only the first two need PIL; they run here. The last
two run on the device (`scheduler.patches`), and together the two halves reproduce the
processor's `pixel_values` bit for bit (tests/test_patches.py).

The processor is transformers' PIL backend (`backend="pil"`), on every machine: the
torchvision backend resizes differently, and which one `AutoImageProcessor` picks
would otherwise depend on whether torchvision is installed.
"""

from __future__ import annotations

import numpy as np
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

Grid = tuple[int, int, int]
ImageSize = tuple[int, int]  # (min_pixels, max_pixels)

PIXEL_FORMAT = "uint8 HWC, resized, v1"  # part of every image key: a change re-keys them


class ImageResizer:
    """Converts and resizes images as `processor` does; refuses, when built, a processor
    whose settings would make the uint8 image differ from what it resizes."""

    def __init__(self, processor: object) -> None:
        unsupported = [
            f"{name}={getattr(processor, name, None)!r}"
            for name, wanted in (("do_resize", True), ("do_convert_rgb", True))
            if getattr(processor, name, None) is not wanted
        ]
        if getattr(processor, "backend", None) != "pil":
            unsupported.append(f"backend={getattr(processor, 'backend', None)!r}")
        if unsupported:
            raise ValueError(
                f"unsupported image processor settings for {type(processor).__name__}: "
                f"{', '.join(unsupported)} (Iris resizes with PIL and converts to RGB)"
            )
        self.patch_size: int = processor.patch_size  # type: ignore[attr-defined]
        self.merge_size: int = processor.merge_size  # type: ignore[attr-defined]
        self.resample = processor.resample  # type: ignore[attr-defined]

    def target_size(self, width: int, height: int, size: ImageSize) -> tuple[int, int]:
        """(height, width) after resizing; ValueError for an aspect ratio over 200."""
        min_pixels, max_pixels = size
        factor = self.patch_size * self.merge_size
        return smart_resize(height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels)

    def grid(self, width: int, height: int, size: ImageSize) -> Grid:
        """The image's patch grid (t, h, w) after resizing."""
        resized_height, resized_width = self.target_size(width, height, size)
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    def resize(self, image: Image.Image, size: ImageSize) -> tuple[np.ndarray, Grid]:
        """The resized image as a contiguous uint8 array [height, width, 3] and its grid."""
        resized_height, resized_width = self.target_size(image.width, image.height, size)
        rgb = to_rgb(image)
        if rgb.size != (resized_width, resized_height):
            rgb = rgb.resize((resized_width, resized_height), resample=self.resample)
        pixels = np.asarray(rgb, dtype=np.uint8)
        grid = (1, resized_height // self.patch_size, resized_width // self.patch_size)
        return np.ascontiguousarray(pixels), grid


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' `convert_to_rgb` makes it: an image with transparency (an
    alpha band, or a palette's transparent colour) is composited onto white first."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
