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

Activations stay in the model's dtype (weight-only): on a CPU this is what transformers
runs for these checkpoints; a GPU kernel of our own that quantizes activations per token
group is the next step.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .linear_method import LinearLayer, LinearMethod
from .loader import ShapeMismatch, Weight, load_parameter, materialized

BLOCK = 128
FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` beside `X.weight`


class BlockFp8Linear(LinearMethod):
    """One method object for every quantized layer of a model (its state lives on the
    layers); the dequantization buffer is per thread, as the encoder runs beside the steps."""

    name: ClassVar[str] = "block-fp8"

    def __init__(self) -> None:
        self._buffers = threading.local()

    def create_weights(
        self, layer: LinearLayer, in_features: int, out_features: int, bias: bool
    ) -> None:
        """The e4m3 weight and the row-expanded scale grid (see the module); called once the
        layer's `tp_splits` are known. The bias keeps the model's dtype."""
        dtype = layer.bias.dtype if layer.bias is not None else torch.get_default_dtype()
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), False)
        _, count = _column_blocks(layer)
        layer.weight_scale_inv = nn.Parameter(torch.empty(out_features, count), False)
        if bias:
            layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False)
        else:
            layer.register_parameter("bias", None)

    def load_weight(self, layer: LinearLayer, leaf: str, tensor: Weight, shard: int | None) -> int:
        if leaf != "weight_scale_inv":
            return load_parameter(layer, leaf, tensor, shard)
        grid = materialized(tensor).float()
        rows = _checkpoint_rows(layer, shard) // BLOCK
        first, count = _column_blocks(layer)
        if (rows.numel() and int(rows.max()) >= grid.shape[0]) or first + count > grid.shape[1]:
            raise ShapeMismatch(f"a scale grid {tuple(grid.shape)} too small for the weight")
        expanded = grid[rows][:, first : first + count]
        destination = _tensor(layer.weight_scale_inv).data
        if shard is not None:
            sizes = layer.shard_sizes
            assert sizes is not None  # a fused layer's
            destination = destination.narrow(0, sum(sizes[:shard]), sizes[shard])
        if destination.shape != expanded.shape:
            raise ShapeMismatch(f"{tuple(expanded.shape)} vs {tuple(destination.shape)}")
        destination.copy_(expanded)
        return destination.numel() * destination.element_size()

    def process_after_loading(self, layer: LinearLayer) -> None:
        """Each column's block in the held grid, once (an index on the weight's device)."""
        columns = torch.arange(layer.in_features, device=layer.weight.device)
        offset, (first, _) = _column_offset(layer), _column_blocks(layer)
        layer.register_buffer("scale_columns", (offset + columns) // BLOCK - first, False)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantized(layer, x.dtype), bias)

    def dequantized(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight in `dtype`, in this thread's buffer (valid until the next call)."""
        weight = layer.weight
        out = self._buffer(weight.shape, dtype, weight.device)
        out.copy_(weight)
        return out.mul_(_tensor(layer.weight_scale_inv)[:, _tensor(layer.scale_columns)])

    def dense_bytes(self, layer: LinearLayer) -> int:
        bias = layer.bias
        itemsize = bias.element_size() if bias is not None else 4
        return layer.weight.numel() * itemsize + (0 if bias is None else bias.numel() * itemsize)

    def _buffer(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This thread's buffer, grown to the largest layer asked for; a view of `shape`."""
        key = (dtype, device)
        buffers: dict = self._buffers.__dict__.setdefault("by_key", {})
        flat = buffers.get(key)
        if flat is None or flat.numel() < shape.numel():
            flat = buffers[key] = torch.empty(shape.numel(), dtype=dtype, device=device)
        return flat[: shape.numel()].view(shape)


def _tensor(value: torch.Tensor | nn.Module) -> torch.Tensor:
    """A tensor this method registered on a layer (typed as nn.Module's attributes are)."""
    assert isinstance(value, torch.Tensor)
    return value


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
