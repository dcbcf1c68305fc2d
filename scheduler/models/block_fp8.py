"""Block-wise FP8 weights (Qwen's `-FP8` releases, `quantization_config.quant_method` "fp8"
with `weight_block_size` [128, 128]): a `LinearMethod` that keeps a layer's weight as
float8 e4m3 with one float32 scale per 128×128 block, and computes through a dequantized
copy made per call into a buffer the layers share.

On disk a quantized layer `X` has `X.weight` (e4m3, `[N, K]`) and `X.weight_scale_inv`
(`[ceil(N/128), ceil(K/128)]`, bf16, fp16 or fp32): `W[n, k] = f32(Wq[n, k]) · S[n // 128,
k // 128]`. Held here: the e4m3 weight of this rank's slice, as the layer's `tp_splits`
take it, and the scale grid expanded along the rows to `[N_rank, blocks]` over the
blocks this rank's columns fall in, so a fused layer's parts (q, k, v) each keep their
own grid and a tensor-parallel slice needs no 128-aligned boundary. Weights stay at about
a quarter of float32's bytes; the buffer holds one layer dequantized.

On a CPU activations stay in the model's dtype (weight-only), which is what transformers
runs for these checkpoints: up to `FUSED_ROWS` rows (a decode step) through our C++ kernel
(`cpu_kernels/fp8_linear.cpp`), which reads each e4m3 byte once and widens it in
registers, so a step costs what the bytes cost to read; more rows (a prefill chunk), or
where the kernel cannot be built, through the buffer. On CUDA our Triton GEMMs compute
without the buffer: on a device with FP8 tensor cores with the activations quantized to
e4m3 per row and weight block (the format's "dynamic" activation scheme, as vLLM runs it:
`triton_quant.block_fp8_linear_fp8_activations`), elsewhere weight-only, dequantizing
tile by tile (`triton_quant.block_fp8_linear`).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import nn

from .. import cpu_kernels
from .cpu_linear import dense_product
from .dequantized import (
    DequantizingMethod,
    ThreadBuffers,
    copy_part,
    recreate_bias,
    registered,
)
from .linear_method import LinearLayer
from .loader import ShapeMismatch, Weight, load_parameter, materialized

BLOCK = 128
FP8 = torch.float8_e4m3fn
FUSED_ROWS = 16  # rows up to which the CPU kernel beats dequantize + GEMM (where they cross)
SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` beside `X.weight`


class BlockFp8Linear(DequantizingMethod):
    """One method object for every quantized layer of a model (its state lives on the
    layers); the dequantization buffer is per thread, as the encoder runs beside the steps."""

    name: ClassVar[str] = "block-fp8"
    cpu_kernel: bool = False  # whether `cpu_kernels/fp8_linear.cpp` loaded (CPU layers)

    def create_weights(
        self, layer: LinearLayer, in_features: int, out_features: int, bias: bool
    ) -> None:
        """The e4m3 weight and the row-expanded scale grid (see the module); called once the
        layer's `tp_splits` are known. The bias keeps the model's dtype."""
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), False)
        _, count = _column_blocks(layer)
        layer.weight_scale_inv = nn.Parameter(torch.empty(out_features, count), False)
        recreate_bias(layer, out_features, bias)

    def load_weight(self, layer: LinearLayer, leaf: str, tensor: Weight, shard: int | None) -> int:
        if leaf != "weight_scale_inv":
            return load_parameter(layer, leaf, tensor, shard)
        grid = materialized(tensor).float()
        rows = _checkpoint_rows(layer, shard) // BLOCK
        first, count = _column_blocks(layer)
        if (rows.numel() and int(rows.max()) >= grid.shape[0]) or first + count > grid.shape[1]:
            raise ShapeMismatch(f"a scale grid {tuple(grid.shape)} too small for the weight")
        expanded = grid[rows][:, first : first + count]
        destination = registered(layer.weight_scale_inv).data
        return copy_part(layer, destination, expanded, shard, axis=0)

    def process_after_loading(self, layer: LinearLayer) -> None:
        """Where a slice starts inside a block (row-parallel, unaligned), each column's block
        in the held grid, once (an index on the weight's device); aligned slices need none."""
        offset, (first, _) = _column_offset(layer), _column_blocks(layer)
        if layer.weight.device.type == "cpu" and self.dtype in cpu_kernels.DTYPES:
            self.cpu_kernel = cpu_kernels.load("fp8_linear")
        if offset % BLOCK:
            columns = torch.arange(layer.in_features, device=layer.weight.device)
            layer.register_buffer("scale_columns", (offset + columns) // BLOCK - first, False)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:  # our Triton GEMMs (`triton_quant`)
            from . import triton_quant

            scales = registered(layer.weight_scale_inv)
            gemm = triton_quant.block_fp8_linear  # weights dequantized tile by tile
            if has_fp8_tensor_cores(x.device.index):  # activations in e4m3 per block too
                gemm = triton_quant.block_fp8_linear_fp8_activations
            out = gemm(x, layer.weight, scales, _column_offset(layer) % BLOCK)
            return out if bias is None else out + bias
        rows = x.numel() // layer.in_features
        if self.cpu_kernel and 0 < rows <= FUSED_ROWS and x.dtype in cpu_kernels.DTYPES:
            return self._fused(layer, x, bias)
        return dense_product(x, self.dequantized(layer, x.dtype), bias)

    def _fused(
        self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`x` times the layer through the C++ kernel (a few rows, on a CPU)."""
        flat = x.reshape(-1, layer.in_features).contiguous()
        codes, scales = layer.weight.view(torch.uint8), registered(layer.weight_scale_inv)
        out = torch.ops.iris_fp8.block_fp8_linear(
            flat, codes, scales, _column_offset(layer) % BLOCK
        )
        out = out.view(*x.shape[:-1], layer.out_features)
        return out if bias is None else out + bias

    def dequantized(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight in `dtype`, in this thread's buffer (valid until the next call)."""
        columns = getattr(layer, "scale_columns", None)
        return dequantized_blocks(
            layer.weight, registered(layer.weight_scale_inv), columns, dtype, self._buffers
        )


@functools.cache
def has_fp8_tensor_cores(device_index: int | None) -> bool:
    """Whether the CUDA device multiplies e4m3 by e4m3 (compute capability 8.9: Ada,
    Hopper and later), where block FP8 runs with its activations quantized, as the
    format's "dynamic" activation scheme and vLLM do."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def dequantized_blocks(
    weight: torch.Tensor,
    scales: torch.Tensor,
    columns: torch.Tensor | None,
    dtype: torch.dtype,
    buffers: ThreadBuffers,
) -> torch.Tensor:
    """e4m3 `weight` `[R, C]` times its row-expanded scale grid `scales` `[R, blocks]`
    (`columns`: each column's block, where a slice starts mid-block) in `dtype`, in this
    thread's buffer of `buffers` (valid until the next call).

    e4m3 to `dtype` by moving its bits (`_e4m3_bits`) or, in other dtypes, through a
    256-entry table (torch's own conversion is scalar, several times slower), then each
    block times its scale: one broadcast over the whole blocks, one for a partial last
    block; a slice starting mid-block gathers instead."""
    rows, cols = weight.shape
    out = buffers.get("weight", weight.shape, dtype, weight.device)
    scales = scales.to(dtype)
    if dtype in BIT_LAYOUTS:
        sign = buffers.get("sign", weight.shape, BIT_LAYOUTS[dtype][0], weight.device)
        _e4m3_bits(weight, out, sign)
        scales = scales * 2.0**120  # the bits' power of two, exact (see `_e4m3_bits`)
    else:
        codes = buffers.get("codes", torch.Size([weight.numel()]), torch.int32, weight.device)
        codes.copy_(weight.view(torch.uint8).view(-1))
        torch.index_select(_e4m3_values(dtype, weight.device), 0, codes, out=out.view(-1))
    if columns is not None:
        return out.mul_(scales[:, columns])
    whole = cols // BLOCK * BLOCK
    if whole:
        out[:, :whole].view(rows, whole // BLOCK, BLOCK).mul_(scales[:, : whole // BLOCK, None])
    if whole < cols:
        out[:, whole:].mul_(scales[:, -1:])
    return out


BIT_LAYOUTS = {  # dtype: (its integer twin, where e4m3's exponent+mantissa bits go, sign's)
    torch.bfloat16: (torch.int16, 4, 8),
    torch.float32: (torch.int32, 20, 24),
}


def _e4m3_bits(weight: torch.Tensor, out: torch.Tensor, sign: torch.Tensor) -> None:
    """`out` (bf16 or fp32) = `weight` (e4m3) · 2^-120, exactly, by bit moves alone.

    e4m3's 4 exponent and 3 mantissa bits, placed at the bottom of `out`'s exponent and at
    the top of its mantissa, read as `2^(e-bias) · 1.m` with `out`'s bias of 127 where
    e4m3's is 7 (and as the same subnormal where e = 0), so the value is off by 2^-120
    only, which the block scale takes back. NaN codes (none in a checkpoint) are not kept."""
    bits, (_, shift, sign_shift) = out.view(BIT_LAYOUTS[out.dtype][0]), BIT_LAYOUTS[out.dtype]
    bits.copy_(weight.view(torch.uint8))
    torch.bitwise_and(bits, 0x80, out=sign).bitwise_left_shift_(sign_shift)
    bits.bitwise_and_(0x7F).bitwise_left_shift_(shift).bitwise_or_(sign)


@functools.cache
def _e4m3_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every e4m3 code's value in `dtype` (exact: bf16, fp16 and fp32 hold them all)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(FP8).to(dtype).to(device)


def _column_offset(layer: LinearLayer) -> int:
    """Where this rank's input columns start in the checkpoint tensor (a row-parallel slice)."""
    split = layer.tp_splits.get("weight")
    return split.pieces[0][0] if split is not None and split.dim == 1 else 0


def _column_blocks(layer: LinearLayer) -> tuple[int, int]:
    """(first, count) of the column blocks this rank's input columns fall in."""
    offset = _column_offset(layer)
    first = offset // BLOCK
    return first, (offset + layer.in_features - 1) // BLOCK - first + 1


def _checkpoint_rows(layer: LinearLayer, shard: int | None) -> torch.Tensor:
    """The rows of the checkpoint tensor (part `shard` of a fused layer) this rank holds."""
    split = layer.tp_splits.get("weight")
    if split is not None and split.dim == 0:
        pieces = split.pieces if shard is None else (split.pieces[shard],)
        return torch.cat([torch.arange(start, start + length) for start, length in pieces])
    sizes = layer.shard_sizes
    rows = layer.out_features if shard is None or sizes is None else sizes[shard]
    return torch.arange(rows)
