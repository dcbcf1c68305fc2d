"""AWQ 4-bit weights (Qwen's `-AWQ` releases, `quantization_config.quant_method` "awq",
`version` "gemm"): a `LinearMethod` that keeps a layer's weight packed eight to an int32
with a scale and a zero point per group of input rows, and computes through a dequantized
copy made per call into a buffer the layers share, unless a kernel takes the layer once
loaded (`int4_kernel`: PyTorch's int4 kernel in bfloat16 on a CPU, our Triton GEMM on
CUDA).

On disk a quantized layer `X` has `X.qweight` (int32 `[K, N/8]`: nibble i of word j is
column 8j + ORDER[i]), `X.qzeros` (int32 `[K/G, N/8]`, packed alike) and `X.scales`
(`[K/G, N]`, fp16): `Wt[k, n] = (q[k, n] - z[k // G, n]) · s[k // G, n]`, `y = x @ Wt`.
Held here: this rank's slice of each, the nibbles put back in column order once loaded
(so a dequantization is shifts and masks, no gather), the scales in float32. A column-
parallel slice must keep whole words (multiples of 8 output columns), a row-parallel one
whole groups.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from .cpu_linear import dense_product
from .dequantized import (
    NIBBLES_PER_WORD,
    DequantizingMethod,
    FourBitForm,
    copy_part,
    packed_layer,
    packed_slice,
    recreate_bias,
    registered,
)
from .int4_kernel import hand_to_kernel
from .linear_method import LinearLayer
from .loader import Weight, materialized
from .tensor_parallel import TPSplit

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of nibble i, within its word
LEAVES = ("qweight", "qzeros", "scales")
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class AwqLinear(DequantizingMethod):
    """One method object per model (each layer holds its tensors); `group_size` from the
    checkpoint's config."""

    name: ClassVar[str] = "awq"

    def create_weights(
        self, layer: LinearLayer, in_features: int, out_features: int, bias: bool
    ) -> None:
        group = self.group_size
        packed_layer(layer, "AWQ", group, NIBBLES_PER_WORD)
        words, groups = out_features // NIBBLES_PER_WORD, in_features // group
        layer.qweight = nn.Parameter(torch.empty(in_features, words, dtype=torch.int32), False)
        layer.qzeros = nn.Parameter(torch.empty(groups, words, dtype=torch.int32), False)
        layer.scales = nn.Parameter(torch.empty(groups, out_features), False)
        recreate_bias(layer, out_features, bias)

    def load_weight(self, layer: LinearLayer, leaf: str, tensor: Weight, shard: int | None) -> int:
        """A packed tensor's slice: the layer's split moved to the packed axes (a weight's
        rows are the tensors' columns, in words for the packed ones, and its columns their
        rows, in groups for the per-group ones)."""
        if leaf == "bias":
            return super().load_weight(layer, leaf, tensor, shard)
        split = self._split(layer, leaf)
        if split is not None:
            tensor = split.take(tensor, shard)
        tensor = materialized(tensor)
        destination = registered(getattr(layer, leaf)).data
        per = NIBBLES_PER_WORD if leaf != "scales" else 1
        return copy_part(layer, destination, tensor, shard, axis=1, per=per)

    def process_after_loading(self, layer: LinearLayer) -> None:
        """The nibbles of the weight and the zeros put in column order (see the module);
        then the layer handed to a kernel where one runs it (`int4_kernel`)."""
        for leaf in ("qweight", "qzeros"):
            packed = registered(getattr(layer, leaf))
            packed.data.copy_(_repack_in_column_order(packed.data))
        qweight = registered(layer.qweight)
        zeros = registered(layer.qzeros)

        def common_form() -> FourBitForm:
            return FourBitForm(_unpacked(qweight).t(), registered(layer.scales), _unpacked(zeros))

        hand_to_kernel(layer, qweight.device, self.dtype, self.group_size, common_form)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_product(x, self.dequantized_t(layer, x.dtype).t(), bias)

    def dequantized_t(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        """`Wt` `[K, N]` in `dtype`, in this thread's buffer (valid until the next call)."""
        qweight, qzeros = registered(layer.qweight), registered(layer.qzeros)
        scales = registered(layer.scales)
        rows, cols = qweight.shape[0], scales.shape[1]
        groups = qzeros.shape[0]
        out = self._buffers.get("weight", torch.Size([rows, cols]), dtype, qweight.device)
        weights = _unpacked(qweight).view(groups, rows // groups, cols)
        zeros = _unpacked(qzeros).view(groups, 1, cols)
        grouped = out.view(groups, rows // groups, cols)
        torch.sub(weights, zeros, out=grouped)
        grouped.mul_(scales.to(dtype).view(groups, 1, cols))
        return out

    def _split(self, layer: LinearLayer, leaf: str) -> TPSplit | None:
        split = layer.tp_splits.get("weight")
        if split is None:
            return None
        per = {("qweight", 0): NIBBLES_PER_WORD, ("qzeros", 0): NIBBLES_PER_WORD, ("scales", 0): 1,
               ("qweight", 1): 1, ("qzeros", 1): self.group_size,
               ("scales", 1): self.group_size}[(leaf, split.dim)]  # fmt: skip
        return packed_slice(split, 1 - split.dim, per, leaf)


def _unpacked(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[R, W]` of column-ordered nibbles -> int32 `[R, 8W]` of their values."""
    shifts = SHIFTS.to(packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).view(packed.shape[0], -1)


def _repack_in_column_order(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's words (nibble i = column ORDER[i]) with nibble i = column i."""
    shifts = SHIFTS.to(packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, W, 8]: nibble i
    by_column = torch.empty_like(nibbles)
    by_column[..., list(ORDER)] = nibbles  # column ORDER[i] takes nibble i
    # disjoint bits: the sum is their OR (in int64, then back to the int32 bit pattern)
    return (by_column.long() << shifts.long()).sum(dim=-1).to(torch.int32)
