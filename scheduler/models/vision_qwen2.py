"""The Qwen2-VL vision tower, plus the pieces Qwen2.5-VL's tower reuses.

Input is the image processor's `pixel_values`, `[sum_patches, C*T*P*P]`, several images
concatenated, with `grid_thw` `[num_images, 3]`. Patches arrive in merge-block order
(each run of `merge**2` rows is one future LM token), so the merger is a reshape.
Attention never crosses an image (or a frame) boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .layers import SegmentPlan, activation, rope_inv_freq, rotate_half
from .tensor_parallel import ReplicatedLinear


def grid_list(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def frame_cu_seqlens(grids: list[tuple[int, int, int]]) -> list[int]:
    """Segment boundaries with one segment per frame (`h * w` patches), as transformers."""
    cu = [0]
    for t, h, w in grids:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


def vision_rope_positions(
    grids: list[tuple[int, int, int]], merge: int, device: torch.device
) -> torch.Tensor:
    """(row, col) of every patch in processor order (merge blocks), `[sum_patches, 2]`."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(block).transpose(1, 2).flatten()
        cols = cols.reshape(block).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


class VisionRotaryEmbedding(nn.Module):
    """2-D rotary: the first half of each rotated pair follows the row, the second the column."""

    inv_freq: torch.Tensor  # registered as a buffer in __init__

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.dim = head_dim // 2
        self.theta = theta
        self.register_buffer("inv_freq", rope_inv_freq(self.dim, theta), persistent=False)

    def reset_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.dim, self.theta, device=self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[N, 2]` -> fp32 cos/sin `[N, head_dim]`."""
        freqs = positions[..., None].float() * self.inv_freq  # [N, 2, dim/2]
        freqs = freqs.flatten(1)  # [N, dim]: row freqs then column freqs
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates in fp32 and casts back, as transformers does for the ViT."""
    dtype = x.dtype
    x = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x * cos + rotate_half(x) * sin).to(dtype)


class _ConvWeight(nn.Module):
    """Holds the Conv3d's weight under the checkpoint's name, `proj.weight`."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel == stride) applied as one matmul over flat patches."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        p, t = config.patch_size, config.temporal_patch_size
        self.proj = _ConvWeight(torch.empty(config.hidden_size, config.in_channels, t, p, p))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.flatten(1))


class VisionAttention(nn.Module):
    CPU_KERNELS: ClassVar[tuple[str, ...]] = ("segment_attention",)  # cpu_kernels.load_for

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True)
        self.proj = ReplicatedLinear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q = apply_vision_rotary(q, cos, sin)
        k = apply_vision_rotary(k, cos, sin)
        return self.proj(plan.attend(q, k, v).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(dim, hidden_dim, bias=True)
        self.fc2 = ReplicatedLinear(hidden_dim, dim, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = VisionMLP(dim, config.intermediate_size, config.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each merge block of `merge**2` patches, project to the LM."""

    def __init__(self, config: VisionConfig, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = norm(config.hidden_size)
        self.mlp = nn.Sequential(
            ReplicatedLinear(self.merged_dim, self.merged_dim, bias=True),
            nn.GELU(),
            ReplicatedLinear(self.merged_dim, config.out_hidden_size, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class Qwen2VisionTransformer(nn.Module):
    """Checkpoint prefix `visual.`."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary_pos_emb = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList([Qwen2VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config, lambda dim: nn.LayerNorm(dim, eps=1e-6))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """-> `[sum_patches / merge**2, out_hidden_size]`, images in input order."""
        grids = grid_list(grid_thw)
        device = pixel_values.device
        x = self.patch_embed(pixel_values)
        positions = vision_rope_positions(grids, self.config.spatial_merge_size, device)
        cos, sin = self.rotary_pos_emb(positions)
        plan = SegmentPlan(frame_cu_seqlens(grids), device)
        for block in self.blocks:
            x = block(x, cos, sin, plan)
        return self.merger(x)
