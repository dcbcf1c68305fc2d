"""oneDNN for a CPU model's linear layers (`--cpu-linear onednn`; what `auto` takes on a CPU
but in bfloat16 on AVX512-BF16 without AMX, where `pair_linear.py`'s kernel is faster): a
`LinearMethod` that, once the checkpoint is loaded, prepacks each layer's weight into
oneDNN's blocked layout, frees the dense weight, and computes through oneDNN's matmul.

PyTorch's default CPU linear goes through MKL's sgemm, which on AMD processors takes a
slow path; oneDNN with a prepacked weight is faster at every row count, from a decode
step's one to a prefill chunk's thousands (`bench/results/cpu_linear_small.md` has the
served figures both ways). vLLM's CPU build computes its linear layers the same way.

Only the packed copy stays, so a CPU model's linear weights take what they take dense.
The LM head is built dense (the logits read its weight), and tied embeddings are the
embedding's, never a linear layer's. `--cpu-linear aten` keeps PyTorch's path.

oneDNN compiles a primitive per input shape and keeps it in two caches, its own and
ideep's (PyTorch's wrapper), 1024 entries each unless told. A server's steps take rows of
every count (the latency budget sizes prefill chunks from measured step times, decodes
join and leave), so at those bounds the scheduler's memory grows with every new row count
for a long time before it levels off; `bound_primitive_caches` caps both.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
import torch.nn.functional as F

from .. import cpu_kernels
from .linear_method import LinearLayer, LinearMethod

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Entries per primitive cache: a step's few shapes (shared by every layer) and the recent
# steps' stay cached; a shape that was not is compiled again (microseconds, once a step).
PRIMITIVE_CACHE_CAPACITY = 128
PRIMITIVE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_primitive_caches() -> None:
    """Caps oneDNN's and ideep's primitive caches at `PRIMITIVE_CACHE_CAPACITY` entries
    where the environment does not say otherwise. Each reads its variable at its first
    use, so this runs before the model loads (in a process that used oneDNN already, the
    caps it read stay)."""
    for name in PRIMITIVE_CACHE_VARIABLES:
        os.environ.setdefault(name, str(PRIMITIVE_CACHE_CAPACITY))


def dense_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x · weightᵀ (+ bias)` for a weight nobody packed ahead (a quantized layer's
    dequantized copy, the LM head): in float32 on a CPU through oneDNN, unpacked, which
    on AMD processors is faster than `F.linear`'s MKL path at every row count; in bfloat16
    on a CPU, up to `BF16_KERNEL_ROWS` rows (a decode step's), through our kernel
    (`cpu_kernels/bf16_linear.cpp`: PyTorch's bf16 paths read a dense weight at about half
    the bandwidth); elsewhere `F.linear`."""
    if x.dtype == weight.dtype == torch.float32 and x.numel() and can_pack(x.device, x.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if _bf16_kernel_takes(x, weight, bias):
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.iris_bf16.bf16_linear(rows.contiguous(), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


BF16_KERNEL_ROWS = 16  # up to here the kernel is at or above F.linear's speed
BF16_KERNEL_COLUMNS = 32  # the kernel reads K a pair vector at a time (`kColumns`)


def _bf16_kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.bfloat16
        and 0 < x.numel() <= BF16_KERNEL_ROWS * x.shape[-1]
        and x.shape[-1] % BF16_KERNEL_COLUMNS == 0
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        and cpu_kernels.load("bf16_linear")
    )


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether layers on `device` in `dtype` can run through oneDNN here."""
    return device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()


class OneDNNPackedLinear(LinearMethod):
    """Dense weights while loading (as checkpoints store them); after it, only the packed
    copy (`layer.packed_weight`, an opaque oneDNN tensor)."""

    name: ClassVar[str] = "onednn"

    def process_after_loading(self, layer: LinearLayer) -> None:
        weight = layer.weight
        if not can_pack(weight.device, weight.dtype):
            raise ValueError(f"oneDNN cannot pack a {weight.dtype} weight on {weight.device}")
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        del layer.weight  # the packed copy owns its memory: nothing reads the dense one

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = layer.packed_weight
        if x.numel() == 0:  # oneDNN rejects empty inputs
            return x.new_empty(*x.shape[:-1], layer.out_features)
        if x.dtype != packed.dtype:
            raise TypeError(f"a {x.dtype} input to a linear layer packed as {packed.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def resident_bytes(self, layer: LinearLayer) -> int:
        """The bias and the packed weight's allocation (oneDNN's blocked layout pads a
        dimension that is not a multiple of its block); before packing, the dense weights."""
        packed = getattr(layer, "packed_weight", None)
        extra = 0 if packed is None else torch.ops.mkldnn._nbytes(packed)
        return super().resident_bytes(layer) + extra

    def dense_bytes(self, layer: LinearLayer) -> int:
        packed = getattr(layer, "packed_weight", None)
        extra = 0 if packed is None else packed.numel() * packed.element_size()
        return super().resident_bytes(layer) + extra
