"""compressed-tensors W4A16 weights (llm-compressor's "pack-quantized" checkpoints,
`quantization_config.quant_method` "compressed-tensors"): a `LinearMethod` that keeps a
layer's weight as signed 4-bit values packed eight to an int32 along its inputs, with a
scale per group of inputs (symmetric), and computes through a dequantized copy made per
call into a buffer the layers share, unless a kernel takes the layer once loaded
(`int4_kernel`: PyTorch's int4 kernel in bfloat16 on a CPU, our Triton GEMM on CUDA).

On disk a quantized layer `X` has `X.weight_packed` (int32 `[N, K/8]`: value i of word j
is input 8j + i, stored plus 8), `X.weight_scale` (`[N, K/G]`) and `X.weight_shape`
(`[N, K]`): `W[n, k] = (q[n, k] - 8) · s[n, k // G]`. Held here: this rank's slice, a
row-parallel one in whole words and groups. Asymmetric schemes (`weight_zero_point`),
activation ordering (`weight_g_idx`) and other bit widths are refused when the config is
read.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from .cpu_linear import dense_product
from .dequantized import (
    NIBBLES_PER_WORD,
    DequantizingMethod,
    FourBitForm,
    checkpoint_inputs,
    copy_part,
    packed_layer,
    packed_slice,
    recreate_bias,
    registered,
)
from .int4_kernel import hand_to_kernel
from .linear_method import LinearLayer
from .loader import ShapeMismatch, Weight, materialized
from .tensor_parallel import TPSplit

OFFSET = 8  # a stored value is the signed one plus 8
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class PackedW4A16Linear(DequantizingMethod):
    """One method object per model; `group_size` from the checkpoint's config."""

    name: ClassVar[str] = "w4a16"

    def create_weights(
        self, layer: LinearLayer, in_features: int, out_features: int, bias: bool
    ) -> None:
        group = self.group_size
        packed_layer(layer, "W4A16", math.lcm(group, NIBBLES_PER_WORD), 1)
        layer.weight_packed = nn.Parameter(
            torch.empty(out_features, in_features // NIBBLES_PER_WORD, dtype=torch.int32), False
        )
        layer.weight_scale = nn.Parameter(torch.empty(out_features, in_features // group), False)
        parts = len(layer.shard_sizes) if layer.shard_sizes else 1
        layer.weight_shape = nn.Parameter(torch.empty(parts, 2, dtype=torch.int64), False)
        recreate_bias(layer, out_features, bias)

    def load_weight(self, layer: LinearLayer, leaf: str, tensor: Weight, shard: int | None) -> int:
        """A tensor's slice (output rows as they are, input columns in words or groups);
        `weight_shape` is checked against the layer's."""
        if leaf == "bias":
            return super().load_weight(layer, leaf, tensor, shard)
        if leaf == "weight_shape":  # [N, K] of the checkpoint tensor
            shape = materialized(tensor).long()
            if shape.numel() != 2 or int(shape[1]) != checkpoint_inputs(layer):
                raise ShapeMismatch(
                    f"weight_shape {shape.tolist()} for {checkpoint_inputs(layer)} inputs"
                )
            registered(layer.weight_shape).data[shard or 0].copy_(shape)
            return shape.numel() * shape.element_size()
        split = _split(layer, leaf, self.group_size)
        if split is not None:
            tensor = split.take(tensor, shard)
        destination = registered(getattr(layer, leaf)).data
        return copy_part(layer, destination, materialized(tensor), shard, axis=0)

    def process_after_loading(self, layer: LinearLayer) -> None:
        """The layer handed to a kernel where one runs it (`int4_kernel`)."""
        packed = registered(layer.weight_packed)

        def common_form() -> FourBitForm:
            values = ((packed.unsqueeze(-1) >> SHIFTS.to(packed.device)) & 0xF).flatten(1)
            scales = registered(layer.weight_scale).t()
            return FourBitForm(values, scales, torch.full_like(scales, OFFSET))

        hand_to_kernel(layer, packed.device, self.dtype, self.group_size, common_form)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_product(x, self.dequantized(layer, x.dtype), bias)

    def dequantized(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        """`W` `[N, K]` in `dtype`, in this thread's buffer (valid until the next call)."""
        packed, scales = registered(layer.weight_packed), registered(layer.weight_scale)
        rows, cols = packed.shape[0], packed.shape[1] * NIBBLES_PER_WORD
        groups = scales.shape[1]
        out = self._buffers.get("weight", torch.Size([rows, cols]), dtype, packed.device)
        values = (packed.unsqueeze(-1) >> SHIFTS.to(packed.device)) & 0xF  # [N, K/8, 8]
        grouped = out.view(rows, groups, cols // groups)
        torch.sub(values.view(rows, groups, cols // groups), OFFSET, out=grouped)
        grouped.mul_(scales.to(dtype).unsqueeze(-1))
        return out


def _split(layer: LinearLayer, leaf: str, group: int) -> TPSplit | None:
    """The layer's split on `leaf`: output rows as they are; input columns in words of 8
    (`weight_packed`) or groups (`weight_scale`)."""
    split = layer.tp_splits.get("weight")
    if split is None or split.dim == 0:
        return split
    return packed_slice(split, 1, NIBBLES_PER_WORD if leaf == "weight_packed" else group, leaf)
