"""PyTorch's CPU kernel for 4-bit weights under the 4-bit formats (AWQ, GPTQ, W4A16) when a
model computes in bfloat16 on a CPU: a `LinearMethod` a format's method hands a layer to
once its tensors are loaded, holding the weight in the kernel's packing only.

`torch.ops.aten._weight_int4pack_mm_for_cpu` multiplies bf16 rows by 4-bit weights packed
two to a byte with a bf16 scale and offset per group of inputs,
`W[n, k] = (q[n, k] - 8) · s[g, n] + o[g, n]` (g = k // G); every format's
`(q - z) · s` is that with `o = (8 - z) · s`. It reads half a byte per weight and
dequantizes in registers, so a decode step (a few rows) costs what the packed bytes cost
to read; for many rows (a prefill chunk) a GEMM over the weight dequantized into a
per-thread buffer is faster, so rows above `FUSED_ROWS` go that way, dequantizing from
the same packed bytes. In float32 the kernel has no fast path: float32 models keep their
format's method (the fp32 parity suite's exact arithmetic).

The packing is the kernel's (`_convert_weight_to_int4pack_for_cpu`): per block of 64
output rows, per input k, 32 bytes whose low nibbles are rows 0-31 of the block and high
nibbles rows 32-63. Iris reads it back for the prefill dequantization, and checks once
per process that this torch packs that way (`packing_is_known`); where it does not, or
a layer's shape does not suit the kernel (outputs in whole blocks of 64, groups of 32,
64, 128 or 256), the layer stays with its format's method.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import nn

from .dequantized import (
    FourBitForm,
    ThreadBuffers,
    dense_bytes,
    drop_format_tensors,
    hold_input_order,
    in_kernel_order,
    registered,
)
from .linear_method import LinearLayer, LinearMethod

BLOCK_N = 64  # output rows per block of the kernel's packing
KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the kernel takes
FUSED_ROWS = 64  # rows up to which the fused kernel beats dequantize + GEMM (where they cross)
DTYPE = torch.bfloat16
BF16_128 = 0x4300  # the bits of bfloat16 128.0


def can_use(device: torch.device, dtype: torch.dtype, group_size: int, n: int, k: int) -> bool:
    """Whether a layer of `n` outputs and `k` inputs in groups of `group_size` can run
    through the kernel on `device` in `dtype`."""
    return (
        device.type == "cpu"
        and dtype == DTYPE
        and group_size in KERNEL_GROUPS
        and n % BLOCK_N == 0
        and k % group_size == 0
        and packing_is_known()
    )


class Int4PackedCpuLinear(LinearMethod):
    """A layer's weight as the kernel packs it (`int4_weight`, uint8 `[N, K/2]`) with its
    scales and offsets (`int4_scales`, bf16 `[K/G, N, 2]`); built by `adopt`, never from a
    checkpoint directly."""

    name: ClassVar[str] = "int4-cpu"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._buffers = ThreadBuffers()

    @classmethod
    def adopt(cls, layer: LinearLayer, group_size: int, form: FourBitForm) -> None:
        """Moves `layer` to this method; the format's own tensors are dropped (the bias
        stays)."""
        method = cls(group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            form.values.to(torch.int32).contiguous(), 1
        )
        scales = form.scales.float()
        offsets = (8 - form.zeros.float()) * scales
        scales_offsets = torch.stack([scales, offsets], dim=-1).to(DTYPE).contiguous()
        drop_format_tensors(layer)
        layer.int4_weight = nn.Parameter(packed, False)
        layer.int4_scales = nn.Parameter(scales_offsets, False)
        hold_input_order(layer, form)
        layer.method = method

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != DTYPE:
            raise TypeError(f"a {x.dtype} input to a layer packed for {DTYPE}")
        rows = in_kernel_order(layer, x.reshape(-1, layer.in_features))
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], layer.out_features)
        if rows.shape[0] <= FUSED_ROWS:
            weight, scales = registered(layer.int4_weight), registered(layer.int4_scales)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.contiguous(), weight, self.group_size, scales
            )
        else:
            out = torch.matmul(rows, self.dequantized_t(layer))
        out = out.view(*x.shape[:-1], layer.out_features)
        return out if bias is None else out + bias

    def dequantized_t(self, layer: LinearLayer) -> torch.Tensor:
        """`Wt` `[K, N]` in bf16 from the packed bytes, in this thread's buffer (valid until
        the next call). Integer ops alone up to the values (torch's integer-to-bf16
        conversion is scalar): each nibble widened into the low bits of bf16 128.0, whose
        last 7 mantissa bits count ones, so the bits read 128 + q, then `(q - 8) · s + o`."""
        packed, scales = registered(layer.int4_weight), registered(layer.int4_scales)
        k, n = layer.in_features, layer.out_features
        out = self._buffers.get("weight", torch.Size([k, n]), DTYPE, packed.device)
        bits = out.view(torch.int16).view(k, n // BLOCK_N, 2, BLOCK_N // 2)
        low, high = bits[:, :, 0], bits[:, :, 1]  # [k, block, row]: rows 0-31, 32-63
        low.copy_(packed.view(n // BLOCK_N, k, BLOCK_N // 2).transpose(0, 1))
        high.copy_(low)
        low.bitwise_and_(0xF)
        high.bitwise_right_shift_(4)
        bits.bitwise_or_(BF16_128)
        out.sub_(128 + 8)  # exact: small integers
        grouped = out.view(k // self.group_size, self.group_size, n)
        scale, offset = (scales[..., i].contiguous()[:, None] for i in (0, 1))  # fast broadcasts
        torch.addcmul(offset, grouped, scale, out=grouped)
        return out

    def dense_bytes(self, layer: LinearLayer) -> int:
        return dense_bytes(layer, DTYPE)


@functools.cache
def packing_is_known() -> bool:
    """Whether this torch's CPU kernel packs as the module says (checked on a small weight,
    once per process), and runs."""
    op = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if op is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    values = torch.arange(2 * BLOCK_N * 64, dtype=torch.int32).view(2 * BLOCK_N, 64) % 13
    try:
        packed = op(values, 1)
    except RuntimeError:
        return False
    blocks = packed.view(2, 64, BLOCK_N // 2)  # [block, k, row]
    unpacked = torch.cat([blocks & 0xF, blocks >> 4], dim=-1).transpose(1, 2)
    return torch.equal(unpacked.reshape(2 * BLOCK_N, 64).to(torch.int32), values)
