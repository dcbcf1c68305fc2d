"""The Qwen3-VL vision tower: 16-px patches, learned positions, full attention, DeepStack.

Input as for the other towers. Each patch gets the learned position table (`pos_embed`,
a square `side x side` grid) resampled bilinearly (corners aligned) to its image's grid,
plus Qwen2-VL's 2-D rotary; every block attends over the whole frame. After each block
in `deepstack_visual_indexes` its own merger (normalising the concatenated merge block,
"post-shuffle") turns the hidden states into a DeepStack level.

The output is `[sum_patches / merge**2, out_hidden * (1 + L)]`: the main embedding, then
level 0, 1, ... side by side, so an image's levels are cached and evicted with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .layers import SegmentPlan, activation
from .tensor_parallel import ReplicatedLinear
from .vision_qwen2 import (
    VisionAttention,
    VisionRotaryEmbedding,
    frame_cu_seqlens,
    grid_list,
    vision_rope_positions,
)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps into a `side`-long table for positions `index` on an axis of `size`,
    corners aligned: transformers' `_interpolation_axis_taps_weights`, op for op."""
    index = index.to(torch.float32)
    size_t = torch.tensor(size, device=index.device)
    src = index * (side - 1) / torch.clamp(size_t - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    distance = (src[:, None] - floor[:, None] - offsets).abs()
    return taps, (1 - distance).clamp(min=0)


def position_taps(
    grids: list[tuple[int, int, int]], merge: int, side: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch (merge-block order, repeated over frames): 4 rows of the position table
    and their bilinear weights, `[sum_patches, 4]` each."""
    indices, weights = [], []
    for t, h, w in grids:  # vision_rope_positions repeats each frame's rows t times
        rows, cols = vision_rope_positions([(t, h, w)], merge, device).unbind(-1)
        h_taps, h_weights = _axis_taps(rows, h, side)
        w_taps, w_weights = _axis_taps(cols, w, side)
        indices.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4))
        weights.append((h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4))
    return torch.cat(indices), torch.cat(weights)


class _Conv(nn.Module):
    """The checkpoint's Conv3d parameters under its names, `proj.weight` and `proj.bias`."""

    def __init__(self, out_dim: int, in_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_dim, *in_shape))
        self.bias = nn.Parameter(torch.empty(out_dim))


class Qwen3PatchEmbed(nn.Module):
    """Conv3d with bias (kernel == stride) applied as one matmul over flat patches."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        p, t = config.patch_size, config.temporal_patch_size
        self.proj = _Conv(config.hidden_size, (config.in_channels, t, p, p))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.proj.bias)


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(dim, hidden_dim, bias=True)
        self.linear_fc2 = ReplicatedLinear(hidden_dim, dim, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = Qwen3VisionMLP(dim, config.intermediate_size, config.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm per patch (or, `postshuffle`, over the concatenated merge block), then
    fc1 -> GELU -> fc2 to the LM width."""

    def __init__(self, config: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = ReplicatedLinear(self.merged_dim, self.merged_dim, bias=True)
        self.linear_fc2 = ReplicatedLinear(self.merged_dim, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """Checkpoint prefix `model.visual.` (ours: `visual.`)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        side = round(config.num_position_embeddings**0.5)
        if side * side != config.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings {config.num_position_embeddings} is not a square"
            )
        self.config = config
        self.side = side
        self.patch_embed = Qwen3PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.rotary_pos_emb = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList([Qwen3VisionBlock(config) for _ in range(config.depth)])
        self.merger = Qwen3PatchMerger(config, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            [Qwen3PatchMerger(config, postshuffle=True) for _ in config.deepstack_visual_indexes]
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """-> `[sum_patches / merge**2, out_hidden_size * (1 + L)]`, images in input order."""
        config = self.config
        grids = grid_list(grid_thw)
        device = pixel_values.device
        merge = config.spatial_merge_size
        x = self.patch_embed(pixel_values)
        indices, weights = position_taps(grids, merge, self.side, device)
        positions = (self.pos_embed(indices) * weights[:, :, None]).sum(1)
        x = x + positions.to(x.dtype)
        cos, sin = self.rotary_pos_emb(vision_rope_positions(grids, merge, device))
        plan = SegmentPlan(frame_cu_seqlens(grids), device)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, plan)
            if i in config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[config.deepstack_visual_indexes.index(i)]
                levels.append(merger(x))
        return torch.cat([self.merger(x), *levels], dim=-1)
