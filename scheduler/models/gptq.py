"""GPTQ 4-bit weights (`quantization_config.quant_method` "gptq": AutoGPTQ / GPTQModel
checkpoints): a `LinearMethod` that keeps a layer's weight packed eight to an int32 along
its inputs, with a scale and a zero point per group, and computes through a dequantized
copy made per call into a buffer the layers share, unless a kernel takes the layer once
loaded (`int4_kernel`: PyTorch's int4 kernel in bfloat16 on a CPU, our Triton GEMM on
CUDA).

On disk a quantized layer `X` has `X.qweight` (int32 `[K/8, N]`: nibble i of word r is
input row 8r + i), `X.qzeros` (int32 `[G, N/8]`: nibble i of word j is column 8j + i;
`checkpoint_format` "gptq" stores zero - 1, "gptq_v2" the zero itself), `X.scales`
(`[G, N]`) and `X.g_idx` (int32 `[K]`, each input row's group; not monotone when the
checkpoint was quantized in activation order, `desc_act`):
`Wt[k, n] = (q[k, n] - z[g_idx[k], n]) · s[g_idx[k], n]`, `y = x @ Wt`. The parts of a
fused layer (q/k/v, gate/up) share their input, so their `g_idx` agree (a checkpoint
where they do not is refused).

Held here: this rank's slice of `qweight` and `g_idx` (whole words of 8 input rows for a
row-parallel slice), its columns of the zeros and scales (whole words of 8), and every
group: with `desc_act` any row may belong to any group. Groups in input order (no
`desc_act`) dequantize by one broadcast per group; otherwise by a gather over `g_idx`. A
kernel takes a whole layer in activation order too, its rows sorted by group and each
call's inputs gathered into that order (`dequantized.FourBitForm.input_order`).
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
    checkpoint_inputs,
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

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class GptqLinear(DequantizingMethod):
    """One method object per model; `group_size` and `zero_offset` (1 for `checkpoint_format`
    "gptq", 0 for "gptq_v2") from the checkpoint's config, `dtype` the model's."""

    name: ClassVar[str] = "gptq"

    def __init__(
        self, group_size: int, zero_offset: int, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(group_size, dtype)
        self.zero_offset = zero_offset

    def create_weights(
        self, layer: LinearLayer, in_features: int, out_features: int, bias: bool
    ) -> None:
        packed_layer(layer, "GPTQ", NIBBLES_PER_WORD, NIBBLES_PER_WORD)
        groups = -(-checkpoint_inputs(layer) // self.group_size)
        words = in_features // NIBBLES_PER_WORD
        layer.qweight = nn.Parameter(torch.empty(words, out_features, dtype=torch.int32), False)
        zeros = torch.empty(groups, out_features // NIBBLES_PER_WORD, dtype=torch.int32)
        layer.qzeros = nn.Parameter(zeros, False)
        layer.scales = nn.Parameter(torch.empty(groups, out_features), False)
        parts = len(layer.shard_sizes) if layer.shard_sizes else 1  # a fused layer's, each
        layer.g_idx = nn.Parameter(torch.empty(parts, in_features, dtype=torch.int32), False)
        recreate_bias(layer, out_features, bias)

    def load_weight(self, layer: LinearLayer, leaf: str, tensor: Weight, shard: int | None) -> int:
        """A packed tensor's slice: the layer's split moved to each tensor's axes (see the
        module); a fused layer's parts fill their columns."""
        if leaf == "bias":
            return super().load_weight(layer, leaf, tensor, shard)
        split = _split(layer, leaf)
        if split is not None:
            tensor = split.take(tensor, shard)
        tensor = materialized(tensor)
        destination = registered(getattr(layer, leaf)).data
        if leaf == "g_idx":  # one row per part of a fused layer
            return copy_part(layer, destination[shard or 0], tensor, None, axis=0)
        per = NIBBLES_PER_WORD if leaf == "qzeros" else 1
        return copy_part(layer, destination, tensor, shard, axis=1, per=per)

    def process_after_loading(self, layer: LinearLayer) -> None:
        """Rows whose groups are not in input order keep them as an index (`row_groups`);
        in order, a dequantization is one broadcast per group. The layer is handed to a
        kernel where one runs it (`int4_kernel`): in input order as it is, in activation
        order with its rows sorted by group where each group is `group_size` of its rows
        (a whole layer; a row-parallel share holds scattered rows of each)."""
        parts = registered(layer.g_idx).long()
        if not bool((parts == parts[0]).all()):
            raise ValueError(
                "the parts of a fused GPTQ layer (q/k/v or gate/up) order their input rows "
                "differently (g_idx); Iris holds one order per layer"
            )
        g_idx = parts[0]
        rows = torch.arange(g_idx.numel(), device=g_idx.device) + _row_offset(layer)
        in_order = (
            torch.equal(g_idx, rows // self.group_size) and not rows.numel() % NIBBLES_PER_WORD
        )
        if (
            not in_order
            or layer.in_features % self.group_size
            or _row_offset(layer) % self.group_size
        ):
            layer.register_buffer("row_groups", g_idx, False)
            self._hand_sorted_to_kernel(layer, g_idx)
            return
        qweight = registered(layer.qweight)
        first = _row_offset(layer) // self.group_size
        groups = slice(first, first + layer.in_features // self.group_size)

        def common_form() -> FourBitForm:
            zeros = (_unpacked_columns(registered(layer.qzeros)) + self.zero_offset)[groups]
            return FourBitForm(_unpacked_rows(qweight).t(), registered(layer.scales)[groups], zeros)

        hand_to_kernel(layer, qweight.device, self.dtype, self.group_size, common_form)

    def _hand_sorted_to_kernel(self, layer: LinearLayer, g_idx: torch.Tensor) -> None:
        """Hands a layer in activation order to a kernel with its rows sorted by group,
        where each group present holds exactly `group_size` of its rows."""
        order = torch.argsort(g_idx, stable=True)
        by_group = g_idx[order]
        if by_group.numel() % self.group_size:
            return
        runs = by_group.view(-1, self.group_size)
        groups = runs[:, 0]
        if not bool((runs == groups[:, None]).all()) or not bool((groups[1:] > groups[:-1]).all()):
            return
        qweight = registered(layer.qweight)

        def common_form() -> FourBitForm:
            zeros = _unpacked_columns(registered(layer.qzeros)) + self.zero_offset
            values = _unpacked_rows(qweight)[order].t()
            scales = registered(layer.scales)
            return FourBitForm(values, scales[groups], zeros[groups], order)

        hand_to_kernel(layer, qweight.device, self.dtype, self.group_size, common_form)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_product(x, self.dequantized_t(layer, x.dtype).t(), bias)

    def dequantized_t(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        """`Wt` `[K, N]` in `dtype`, in this thread's buffer (valid until the next call)."""
        qweight, qzeros = registered(layer.qweight), registered(layer.qzeros)
        scales = registered(layer.scales).to(dtype)
        rows, cols = qweight.shape[0] * NIBBLES_PER_WORD, qweight.shape[1]
        out = self._buffers.get("weight", torch.Size([rows, cols]), dtype, qweight.device)
        weights = _unpacked_rows(qweight)
        zeros = _unpacked_columns(qzeros) + self.zero_offset
        row_groups = getattr(layer, "row_groups", None)
        if row_groups is None:
            first = _row_offset(layer) // self.group_size
            groups = rows // self.group_size
            grouped = out.view(groups, self.group_size, cols)
            torch.sub(
                weights.view(groups, self.group_size, cols),
                zeros[first : first + groups, None],
                out=grouped,
            )
            grouped.mul_(scales[first : first + groups, None])
            return out
        torch.sub(weights, zeros[row_groups], out=out)
        return out.mul_(scales[row_groups])


def _row_offset(layer: LinearLayer) -> int:
    split = layer.tp_splits.get("weight")
    return split.pieces[0][0] if split is not None and split.dim == 1 else 0


def _split(layer: LinearLayer, leaf: str) -> TPSplit | None:
    """The layer's split on tensor `leaf`: a column slice cuts every tensor's columns (the
    zeros' in words), a row slice cuts `qweight`'s rows (in words) and `g_idx`; the zeros
    and scales of every group stay."""
    split = layer.tp_splits.get("weight")
    if split is None:
        return None
    if split.dim == 0:  # output columns
        if leaf == "g_idx":
            return None
        per = NIBBLES_PER_WORD if leaf == "qzeros" else 1
        dim = 1
    else:  # input rows
        if leaf in ("qzeros", "scales"):
            return None
        per = NIBBLES_PER_WORD if leaf == "qweight" else 1
        dim = 0
    return packed_slice(split, dim, per, leaf)


def _unpacked_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[W, C]` (nibble i of word r: row 8r + i) -> int32 `[8W, C]`."""
    shifts = SHIFTS.to(packed.device)[None, :, None]
    return ((packed.unsqueeze(1) >> shifts) & 0xF).view(-1, packed.shape[1])


def _unpacked_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[R, W]` (nibble i of word j: column 8j + i) -> int32 `[R, 8W]`."""
    shifts = SHIFTS.to(packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).view(packed.shape[0], -1)
