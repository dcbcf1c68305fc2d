"""The image processor's `pixel_values`, made on the device from the worker's uint8 pixels
`[H, W, 3]` (`tokenizer_worker/images/resize.py`): 3 bytes per pixel in shared memory and
across the host-to-device copy, 8x less than the processor's float32 rows.

- rescale and normalise: per channel, each of the 256 levels maps to one value. The
  table of those 768 values is computed once, by the processor's own `rescale` and
  `normalize` on an image holding every level, so a lookup reproduces its arithmetic
  bit for bit, whatever the formula;
- patchify: rows of C·T·P·P in the raster order of the merge blocks (4 rows per LLM
  token), as the processor's `patchify` lays them out: an image's single frame repeated
  T times, a video's temporal patch (`[T, H, W, 3]`, T consecutive frames) as it is.

Both are a gather from the table and one copy into the row layout. The table is kept in
the model's dtype: a bf16 model gets the processor's values cast to bf16, never values
computed in bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

Grid = tuple[int, int, int]


class PatchMaker:
    def __init__(
        self,
        table: np.ndarray,
        patch_size: int,
        temporal_patch_size: int,
        merge_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """`table`: float32 [3, 256], the processor's value of every level of each channel."""
        if table.shape != (3, 256):
            raise ValueError(f"the level table is {table.shape}, not (3, 256)")
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.device = device
        self.dtype = dtype
        self.table = torch.from_numpy(np.ascontiguousarray(table, dtype=np.float32))
        self.table = self.table.reshape(-1).to(device=device, dtype=dtype)
        self._channel_offsets = torch.arange(3, device=device).mul_(256)

    @classmethod
    def from_checkpoint(
        cls, model_dir: str | Path, device: torch.device, dtype: torch.dtype
    ) -> PatchMaker:
        """From the checkpoint's image processor (transformers' PIL backend, as the worker's)."""
        from transformers import AutoImageProcessor

        # Any: the processor's class is the checkpoint's (transformers types it as its base)
        processor: Any = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        levels = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256))  # [C, H, W]
        values: np.ndarray = np.asarray(levels, dtype=np.float32)
        if processor.do_rescale:
            values = processor.rescale(np.array(levels), processor.rescale_factor)
        if processor.do_normalize:
            values = processor.normalize(values, processor.image_mean, processor.image_std)
        return cls(
            np.asarray(values, dtype=np.float32).reshape(3, 256),
            processor.patch_size,
            processor.temporal_patch_size,
            processor.merge_size,
            device,
            dtype,
        )

    def pixel_shape(self, grid: Sequence[int], frames: int = 1) -> tuple[int, ...]:
        """The uint8 pixels of a one-frame grid: an image `[height, width, 3]`, or a video's
        temporal patch of `frames` frames, `[frames, height, width, 3]`."""
        _, grid_h, grid_w = grid
        image = (grid_h * self.patch_size, grid_w * self.patch_size, 3)
        return image if frames == 1 else (frames, *image)

    def check(self, pixels: torch.Tensor, grid: Sequence[int], frames: int = 1) -> None:
        """ValueError unless `pixels` are uint8 pixels of a one-frame `grid`: an image
        (`frames` 1) or a temporal patch of the processor's T frames."""
        expected = self.pixel_shape(grid, frames)
        if (
            grid[0] != 1
            or frames not in (1, self.temporal_patch_size)
            or pixels.dtype != torch.uint8
            or tuple(pixels.shape) != expected
        ):
            raise ValueError(
                f"pixels of shape {tuple(pixels.shape)} {pixels.dtype} do not match the grid "
                f"{tuple(grid)} of {frames} frame(s): uint8 {expected} expected (a video's "
                f"temporal patch has {self.temporal_patch_size} frames)"
            )

    def __call__(self, images: Sequence[torch.Tensor], grids: Sequence[Grid]) -> torch.Tensor:
        """The processor's `pixel_values` of `images` (uint8 [H, W, 3] each, or a video's
        temporal patch [T, H, W, 3], on any device), concatenated: [sum of h·w patches,
        C·T·P·P] on the device, in the model's dtype."""
        rows = [self._rows(image, grid) for image, grid in zip(images, grids, strict=True)]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _rows(self, pixels: torch.Tensor, grid: Grid) -> torch.Tensor:
        frames = 1 if pixels.dim() == 3 else pixels.shape[0]
        self.check(pixels, grid, frames)
        _, grid_h, grid_w = grid
        m, p, t = self.merge_size, self.patch_size, self.temporal_patch_size
        levels = pixels.to(self.device, non_blocking=True).view(frames, *pixels.shape[-3:])
        values = self.table[levels.int() + self._channel_offsets]  # [F, H, W, C]
        # [F, gh/m, m, P, gw/m, m, P, C] -> [gh/m, gw/m, m, m, C, F, P, P]: the processor's
        # rows (an image's one frame repeated T times)
        blocks = values.view(frames, grid_h // m, m, p, grid_w // m, m, p, 3)
        blocks = blocks.permute(1, 4, 2, 5, 7, 0, 3, 6).expand(-1, -1, -1, -1, -1, t, -1, -1)
        return blocks.reshape(grid_h * grid_w, 3 * t * p * p)
