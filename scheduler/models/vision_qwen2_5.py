"""The Qwen2.5-VL vision tower: RMSNorm, gated MLP with bias, and window attention.

Most blocks attend within square windows of `window_size` pixels; the blocks in
`fullatt_block_indexes` attend over the whole image. Tokens are permuted once into
window order (whole merge blocks move together), so every window is a contiguous
segment; after the merger the LM tokens are put back into raster order.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import VisionConfig
from .layers import GatedMLP, RMSNorm, SegmentPlan
from .vision_qwen2 import (
    PatchEmbed,
    PatchMerger,
    VisionAttention,
    VisionRotaryEmbedding,
    frame_cu_seqlens,
    grid_list,
    vision_rope_positions,
)


def window_order(
    grids: list[tuple[int, int, int]], merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """Window permutation of the merged tokens and window boundaries in patches, for windows of
    `window` merged tokens a side, tiled from the top-left corner (those on the right and
    bottom edges may be partial). Returns `index` (`[sum_merged]`: the merged token at each
    window-order slot) and `cu_window_seqlens` (cumulative patch counts, empty windows dropped)."""
    index: list[torch.Tensor] = []
    cu = [0]
    offset = 0
    unit = merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        ids = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in ids:
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    cell = frame[r : r + window, c : c + window].flatten()
                    index.append(cell + offset)
                    cu.append(cu[-1] + cell.numel() * unit)
        offset += t * gh * gw
    return torch.cat(index), cu


class Qwen2_5VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = RMSNorm(dim, eps=1e-6)
        self.norm2 = RMSNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = GatedMLP(dim, config.intermediate_size, bias=True, act=config.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class Qwen2_5VisionTransformer(nn.Module):
    """Checkpoint prefix `visual.`."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        if config.window_size % (config.patch_size * config.spatial_merge_size):
            raise ValueError("window_size must be a multiple of patch_size * spatial_merge_size")
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary_pos_emb = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList([Qwen2_5VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config, lambda dim: RMSNorm(dim, eps=1e-6))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """-> `[sum_patches / merge**2, out_hidden_size]`, images in input order."""
        config = self.config
        grids = grid_list(grid_thw)
        device = pixel_values.device
        merge = config.spatial_merge_size
        unit = merge * merge
        window = config.window_size // config.patch_size // merge
        index, cu_windows = window_order(grids, merge, window)
        index = index.to(device)

        def to_windows(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, unit, t.shape[-1])[index].view(-1, t.shape[-1])

        x = to_windows(self.patch_embed(pixel_values))
        positions = vision_rope_positions(grids, merge, device)
        cos, sin = (to_windows(t) for t in self.rotary_pos_emb(positions))
        # window order keeps every frame contiguous, so per-frame segments still apply
        full = SegmentPlan(frame_cu_seqlens(grids), device)
        windowed = SegmentPlan(cu_windows, device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in config.fullatt_block_indexes else windowed)
        merged = self.merger(x)
        return merged[torch.argsort(index)]
