"""The image processor's `pixel_values`, made on the device from the worker's uint8 pixels
`[H, W, 3]` (`tokenizer_worker/image_resize.py`): 3 bytes per pixel in shared memory and
across the host-to-device copy, 8x less than the processor's float32 rows.

- rescale and normalise: per channel, each of the 256 levels maps to one value. The
  table of those 768 values is computed once, by the processor's own `rescale` and
  `normalize` on an image holding every level, so a lookup reproduces its arithmetic
  bit for bit, whatever the formula;
- patchify: rows of C·T·P·P in the raster order of the merge blocks (4 rows per LLM
  token), the single frame repeated T times, as the processor's `patchify` lays them out.

Both are a gather from the table and one copy into the row layout. The table is kept in
the model's dtype: a bf16 model gets the processor's values cast to bf16, never values
computed in bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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

        processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
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

    def pixel_shape(self, grid: Sequence[int]) -> tuple[int, int, int]:
        """The uint8 image of a grid: [height, width, 3]."""
        _, grid_h, grid_w = grid
        return grid_h * self.patch_size, grid_w * self.patch_size, 3

    def check(self, pixels: torch.Tensor, grid: Sequence[int]) -> None:
        """ValueError unless `pixels` is the uint8 image of a one-frame `grid`."""
        expected = self.pixel_shape(grid)
        if grid[0] != 1 or pixels.dtype != torch.uint8 or tuple(pixels.shape) != expected:
            raise ValueError(
                f"pixels of shape {tuple(pixels.shape)} {pixels.dtype} do not match the image "
                f"grid {tuple(grid)}: uint8 {expected} expected"
            )

    def __call__(self, images: Sequence[torch.Tensor], grids: Sequence[Grid]) -> torch.Tensor:
        """The processor's `pixel_values` of `images` (uint8 [H, W, 3] each, on any device),
        concatenated: [sum of h·w patches, C·T·P·P] on the device, in the model's dtype."""
        rows = [self._rows(image, grid) for image, grid in zip(images, grids, strict=True)]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _rows(self, image: torch.Tensor, grid: Grid) -> torch.Tensor:
        self.check(image, grid)
        _, grid_h, grid_w = grid
        m, p, t = self.merge_size, self.patch_size, self.temporal_patch_size
        levels = image.to(self.device, non_blocking=True)
        values = self.table[levels.int() + self._channel_offsets]  # [H, W, C]
        # [gh/m, m, P, gw/m, m, P, C] -> [gh/m, gw/m, m, m, C, P, P]: the processor's rows
        blocks = values.view(grid_h // m, m, p, grid_w // m, m, p, 3).permute(0, 3, 1, 4, 6, 2, 5)
        frames = blocks.unsqueeze(-3).expand(*blocks.shape[:5], t, p, p)  # the frame, T times
        return frames.reshape(grid_h * grid_w, 3 * t * p * p)
