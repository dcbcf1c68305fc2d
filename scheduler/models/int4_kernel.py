"""Where a 4-bit layer (AWQ, GPTQ, W4A16) computes once loaded: its format's method hands
it, in the form they share (`dequantized.FourBitForm`), to a kernel's method where one
can run it:

- PyTorch's CPU int4 kernel in bfloat16 on a CPU (`int4_cpu`);
- our Triton 4-bit GEMM on CUDA (`Int4TritonLinear`, `triton_quant.int4_linear`).

Elsewhere (float32 on a CPU: the parity suite's exact arithmetic) the layer stays with its
format's method, which dequantizes per call.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from .dequantized import (
    FourBitForm,
    dense_bytes,
    drop_format_tensors,
    hold_input_order,
    in_kernel_order,
    registered,
)
from .int4_cpu import Int4PackedCpuLinear, can_use
from .linear_method import LinearLayer, LinearMethod


def hand_to_kernel(
    layer: LinearLayer,
    device: torch.device,
    dtype: torch.dtype,
    group: int,
    form: Callable[[], FourBitForm],
) -> None:
    """Moves `layer` (on `device`, the model computing in `dtype`) to a kernel's method
    where one runs it; `form()` gives its shared form (computed only then)."""
    if can_use(device, dtype, group, layer.out_features, layer.in_features):
        Int4PackedCpuLinear.adopt(layer, group, form())
    elif runs_triton(device) and layer.in_features % group == 0:
        Int4TritonLinear.adopt(layer, group, form(), dtype)


def runs_triton(device: torch.device) -> bool:
    """Whether our Triton GEMM computes on `device`: CUDA with triton installed."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


class Int4TritonLinear(LinearMethod):
    """A layer's weight as `triton_quant.int4_linear` reads it: `int4_qweight` int32
    `[K/8, N]`, `int4_scales` and `int4_zeros` `[K/G, N]` in the model's dtype."""

    name: ClassVar[str] = "int4-triton"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    @classmethod
    def adopt(cls, layer: LinearLayer, group: int, form: FourBitForm, dtype: torch.dtype) -> None:
        """Moves `layer` to this method, its scales and zeros in `dtype` (the model's); the
        format's own tensors are dropped (the bias stays)."""
        from .triton_quant import pack_int4

        qweight = pack_int4(form.values)
        drop_format_tensors(layer)
        layer.int4_qweight = nn.Parameter(qweight, False)
        layer.int4_scales = nn.Parameter(form.scales.to(dtype).contiguous(), False)
        layer.int4_zeros = nn.Parameter(form.zeros.to(dtype).contiguous(), False)
        hold_input_order(layer, form)
        layer.method = cls(group)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from .triton_quant import int4_linear

        out = int4_linear(
            in_kernel_order(layer, x),
            registered(layer.int4_qweight),
            registered(layer.int4_scales),
            registered(layer.int4_zeros),
            self.group_size,
        )
        return out if bias is None else out + bias

    def dense_bytes(self, layer: LinearLayer) -> int:
        return dense_bytes(layer, registered(layer.int4_scales).dtype)
