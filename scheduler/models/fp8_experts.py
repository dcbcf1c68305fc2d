"""Routed MoE experts stored in block FP8 (Qwen's `-FP8` MoE releases: Qwen3-VL-30B-A3B,
Qwen3.5-35B-A3B): the experts' two 3-D tensors held as e4m3 with their scale grids, each
expert dequantized when it has rows to compute.

On disk each expert's projections are separate, `experts.{e}.{gate,up,down}_proj.weight`
(e4m3) with `.weight_scale_inv` (`[ceil(rows/128), ceil(cols/128)]`);
`moe.expert_weights_in_our_layout` stacks them, so they arrive as `gate_up_proj` `[E, 2I, H]`
with `gate_up_proj_scale_inv` `[E, 2·ceil(I/128), ceil(H/128)]` (gate's blocks, then
up's: a part's last block may be partial) and `down_proj` `[E, H, I]` with
`down_proj_scale_inv` `[E, ceil(H/128), ceil(I/128)]`. Held here, as `block_fp8` holds a
linear layer: this rank's rows and columns of the weights (its share of I) and the grids
expanded along the rows to `[E, rows, blocks]` over the column blocks its columns fall in,
so a tensor-parallel slice needs no 128-aligned boundary. On CUDA every expert's rows
go through our grouped Triton GEMM in one launch (`grouped_product`), the weights
dequantized tile by tile in registers; on a CPU an expert's few rows (a decode step's)
through our C++ kernel as `block_fp8` layers do (`cpu_product`); elsewhere through a
dequantized copy (`dequantized`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import cpu_kernels
from .block_fp8 import BLOCK, FP8, FUSED_ROWS, dequantized_blocks
from .cpu_linear import dense_product
from .dequantized import ThreadBuffers
from .loader import ShapeMismatch, Weight, materialized

if TYPE_CHECKING:
    from .moe import RoutedExperts

SCALE = "_scale_inv"  # `gate_up_proj_scale_inv` beside `gate_up_proj`


class Fp8ExpertScales:
    """What a `moe.RoutedExperts` in block FP8 knows about its grids: for each projection,
    the checkpoint rows this rank holds and the column blocks its columns fall in."""

    def __init__(self, hidden: int, intermediate: int, start: int, width: int) -> None:
        self.hidden, self.intermediate = hidden, intermediate
        up_first = -(-intermediate // BLOCK)  # gate's blocks come first in the fused grid
        gate = torch.arange(start, start + width, device="cpu") // BLOCK  # not the meta device
        self.rows = {
            "gate_up_proj": torch.cat([gate, up_first + gate]),
            "down_proj": torch.arange(hidden, device="cpu") // BLOCK,
        }
        first = start // BLOCK
        count = (start + width - 1) // BLOCK - first + 1
        self.column_blocks = {
            "gate_up_proj": (0, -(-hidden // BLOCK)),
            "down_proj": (first, count),
        }
        self.columns: dict[str, torch.Tensor | None] = {"gate_up_proj": None, "down_proj": None}
        self.k_shift = {"gate_up_proj": 0, "down_proj": start % BLOCK}  # into the first block
        if start % BLOCK:
            self.columns["down_proj"] = (start + torch.arange(width, device="cpu")) // BLOCK - first
        self.buffers = ThreadBuffers()


def use_block_fp8(experts: RoutedExperts, start: int, width: int, intermediate: int) -> None:
    """Re-creates `experts`' weights as e4m3 with their expanded grids (before loading,
    on the meta device): `start`, `width` this rank's share of the expert width."""
    num, rows, hidden = experts.gate_up_proj.shape
    scales = Fp8ExpertScales(hidden, intermediate, start, width)
    for name, shape in (("gate_up_proj", (num, rows, hidden)), ("down_proj", (num, hidden, width))):
        setattr(experts, name, nn.Parameter(torch.empty(*shape, dtype=FP8), False))
        count = scales.column_blocks[name][1]
        setattr(experts, name + SCALE, nn.Parameter(torch.empty(*shape[:2], count), False))
    experts.fp8 = scales


def load_scale(experts: RoutedExperts, leaf: str, tensor: Weight) -> int:
    """A stacked grid (see the module) expanded along this rank's rows and cut to its
    column blocks; returns the bytes written. Raises `loader.ShapeMismatch`."""
    scales = experts.fp8
    if scales is None:
        raise ShapeMismatch(f"a scale grid {leaf} for experts not held in block FP8")
    name = leaf.removesuffix(SCALE)
    grid = materialized(tensor).float()
    rows, (first, count) = scales.rows[name], scales.column_blocks[name]
    if grid.dim() != 3 or int(rows.max()) >= grid.shape[1] or first + count > grid.shape[2]:
        raise ShapeMismatch(f"a scale grid {tuple(grid.shape)} too small for {name}")
    expanded = grid[:, rows][:, :, first : first + count]
    destination = getattr(experts, leaf).data
    if destination.shape != expanded.shape:
        raise ShapeMismatch(f"{tuple(expanded.shape)} vs {tuple(destination.shape)}")
    destination.copy_(expanded)
    return destination.numel() * destination.element_size()


def dequantized(
    experts: RoutedExperts, name: str, expert: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Projection `name`'s weights in `dtype` for one `expert` (`[rows, cols]`) or, with
    None, every expert (`[E, rows, cols]`), in this thread's buffer (valid until the next
    call)."""
    scales = experts.fp8
    assert scales is not None  # held in block FP8
    weight, grid = getattr(experts, name), getattr(experts, name + SCALE)
    columns = scales.columns[name]
    if columns is not None:
        columns = columns.to(weight.device)
    if expert is not None:
        return dequantized_blocks(weight[expert], grid[expert], columns, dtype, scales.buffers)
    num, rows, cols = weight.shape
    flat = dequantized_blocks(
        weight.view(num * rows, cols), grid.view(num * rows, -1), columns, dtype, scales.buffers
    )
    return flat.view(num, rows, cols)


def cpu_product(experts: RoutedExperts, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
    """`x` (rows routed to `expert`) times its projection `name` on a CPU: up to
    `block_fp8.FUSED_ROWS` rows through the C++ kernel, more through a dequantized copy."""
    scales = experts.fp8
    assert scales is not None  # held in block FP8
    if (
        x.shape[0] <= FUSED_ROWS
        and x.dtype in cpu_kernels.DTYPES
        and cpu_kernels.load("fp8_linear")
    ):
        weight, grid = getattr(experts, name), getattr(experts, name + SCALE)
        codes = weight[expert].view(torch.uint8)
        kernel = torch.ops.iris_fp8.block_fp8_linear
        return kernel(x.contiguous(), codes, grid[expert], scales.k_shift[name])
    return dense_product(x, dequantized(experts, name, expert, x.dtype))


def grouped_product(
    experts: RoutedExperts, name: str, x: torch.Tensor, rows_per_expert: torch.Tensor
) -> torch.Tensor:
    """`x` sorted by expert times each expert's projection `name`, through our grouped
    Triton GEMM (CUDA): nothing dequantized in memory, no count read back."""
    from .triton_quant import grouped_block_fp8_linear

    scales = experts.fp8
    assert scales is not None  # held in block FP8
    weight, grid = getattr(experts, name), getattr(experts, name + SCALE)
    return grouped_block_fp8_linear(x, rows_per_expert, weight, grid, scales.k_shift[name])
