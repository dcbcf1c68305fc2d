"""What the quantized weight formats (`block_fp8`, `awq`, `gptq`, `compressed_tensors`)
share: they compute through a dequantized copy of a layer's weight, made per call into a
buffer each thread keeps (the encoder runs beside the steps), unless a faster kernel takes
the layer once it is loaded (`int4_kernel` for the 4-bit formats), and
re-create a layer's parameters once the model is built, the bias in the model's dtype."""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
from torch import nn

from .linear_method import LinearLayer, LinearMethod
from .loader import ShapeMismatch
from .tensor_parallel import RowParallelLinear, TPSplit

NIBBLES_PER_WORD = 8  # 4-bit values packed in an int32 (AWQ, GPTQ, W4A16)


class ThreadBuffers:
    """Per thread and per (role, dtype, device), one flat buffer grown to the largest size
    asked for."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(
        self, role: str, shape: torch.Size, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A view of `shape` into this thread's buffer for `role` (valid until the next
        `get` of the same role in this thread)."""
        key = (role, dtype, device)
        buffers: dict = self._local.__dict__.setdefault("by_key", {})
        flat = buffers.get(key)
        if flat is None or flat.numel() < shape.numel():
            flat = buffers[key] = torch.empty(shape.numel(), dtype=dtype, device=device)
        return flat[: shape.numel()].view(shape)


class DequantizingMethod(LinearMethod):
    """A format's method that computes through a dequantized copy: one object per model
    (each layer holds its tensors), `group_size` its format's (0 where it has none),
    `dtype` the one the model computes in."""

    def __init__(self, group_size: int = 0, dtype: torch.dtype = torch.float32) -> None:
        self.group_size = group_size
        self.dtype = dtype
        self._buffers = ThreadBuffers()

    def dense_bytes(self, layer: LinearLayer) -> int:
        return dense_bytes(layer, self.dtype)


def packed_layer(layer: LinearLayer, fmt: str, in_unit: int, out_unit: int) -> None:
    """Checks that this rank's inputs and outputs are whole units of the packed format
    `fmt` (groups, words), and drops the dense weight the layer was built with."""
    if layer.in_features % in_unit or layer.out_features % out_unit:
        raise ValueError(
            f"a {fmt} layer of {layer.in_features} inputs and {layer.out_features} outputs on "
            f"this rank: inputs must be whole units of {in_unit} and outputs of {out_unit} "
            "(fewer tensor-parallel ranks may divide them)"
        )
    if hasattr(layer, "weight"):
        del layer.weight


def packed_slice(split: TPSplit, dim: int, per: int, leaf: str) -> TPSplit:
    """`split` moved to axis `dim` of tensor `leaf`, counted in its units of `per` (words of
    8 values, groups of rows); raises where the slice would cut a unit."""
    if any(start % per or length % per for start, length in split.pieces):
        raise ValueError(f"a tensor-parallel slice {split.pieces} cuts {leaf}'s units of {per}")
    return TPSplit(dim, tuple((start // per, length // per) for start, length in split.pieces))


def checkpoint_inputs(layer: LinearLayer) -> int:
    """The inputs of the whole checkpoint tensor (a row-parallel layer holds a slice)."""
    if isinstance(layer, RowParallelLinear):
        return layer.in_features * layer.tp.size
    return layer.in_features


def recreate_bias(layer: LinearLayer, out_features: int, bias: bool) -> None:
    """The layer's bias parameter again (or none), in the dtype it was built with."""
    dtype = layer.bias.dtype if layer.bias is not None else torch.get_default_dtype()
    if bias:
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False)
    else:
        layer.register_parameter("bias", None)


class FourBitForm(NamedTuple):
    """A 4-bit layer in the form every 4-bit format reduces to, as kernels take it:
    `W[n, k] = (values[n, k] - zeros[g, n]) · scales[g, n]`, g = k // group, over the
    layer's inputs taken in `input_order` where it has one (GPTQ in activation order: the
    rows sorted by group, so a kernel's groups are runs of inputs again)."""

    values: torch.Tensor  # int [N, K], 0..15
    scales: torch.Tensor  # [K/group, N]
    zeros: torch.Tensor  # [K/group, N]
    input_order: torch.Tensor | None = None  # int64 [K]: kernel input k is layer input order[k]


def hold_input_order(layer: LinearLayer, form: FourBitForm) -> None:
    """Keeps the form's input order on a layer a kernel took (`in_kernel_order` reads it)."""
    if form.input_order is not None:
        layer.register_buffer("int4_input_order", form.input_order, False)


def in_kernel_order(layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
    """`x`'s inputs in the order the layer's kernel holds its weight's (a gather per call
    where the layer has an order of its own)."""
    order = getattr(layer, "int4_input_order", None)
    return x if order is None else x.index_select(-1, order)


def drop_format_tensors(layer: LinearLayer) -> None:
    """Drops every tensor a format's method registered on `layer` but the bias: a kernel's
    method taking the layer over holds the weight in its own form."""
    for name in [*layer._parameters, *layer._buffers]:
        if name != "bias":
            delattr(layer, name)


def registered(value: torch.Tensor | nn.Module) -> torch.Tensor:
    """A tensor a method registered on a layer (typed as nn.Module's attributes are)."""
    assert isinstance(value, torch.Tensor)
    return value


def copy_part(
    layer: LinearLayer,
    destination: torch.Tensor,
    tensor: torch.Tensor,
    shard: int | None,
    *,
    axis: int,
    per: int = 1,
) -> int:
    """Copies `tensor` into `destination`, or, for part `shard` of a fused layer, into that
    part's share of `axis`, the one that runs along the layer's outputs (`per` outputs to
    an element there: 8 for packed words); returns the bytes written. Raises
    `loader.ShapeMismatch`."""
    if shard is not None:
        sizes = layer.shard_sizes
        assert sizes is not None  # a fused layer's
        destination = destination.narrow(axis, sum(sizes[:shard]) // per, sizes[shard] // per)
    if destination.shape != tensor.shape:
        raise ShapeMismatch(f"{tuple(tensor.shape)} vs {tuple(destination.shape)}")
    destination.copy_(tensor)
    return destination.numel() * destination.element_size()


def dense_bytes(layer: LinearLayer, dtype: torch.dtype) -> int:
    """The layer's weight and bias held dense in `dtype`, the model's."""
    dense = layer.in_features * layer.out_features * dtype.itemsize
    return dense + (0 if layer.bias is None else layer.bias.numel() * dtype.itemsize)
