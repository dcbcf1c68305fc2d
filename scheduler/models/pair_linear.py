"""bfloat16 linear layers packed into blocks of pairs and computed by our kernel
(`cpu_kernels/pair_linear.cpp`): `--cpu-linear pairs`, what `auto` picks on a CPU with
AVX512-BF16 and no AMX in bfloat16.

oneDNN's prepacked weights (`cpu_linear.py`) compute a prefill chunk at the machine's
GEMM rate, but read a decode step's weights at about half its bandwidth, and a decode
step's cost is what its weights cost to read. Our layout is one sequential stream per
thread, so a decode step's rows run near the bandwidth, and its tiles keep the pair
products busy at many rows: faster than oneDNN up to a prefill chunk's rows, within a few
percent of it at a vision tower's thousands (`bench/results/cpu_linear_small_bf16.md` has
the served comparison). With AMX, oneDNN's tile kernels compute many rows several times
faster than pair products can, so `auto` keeps oneDNN there.

Once loaded, a layer holds only the packed copy (its last block padded to whole blocks of
64 outputs); the LM head stays dense as everywhere on a CPU.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .. import cpu_kernels
from ..auto_dtype import native_bf16_cpu
from .linear_method import LinearLayer, LinearMethod

KERNEL = "pair_linear"


def can_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether layers on `device` in `dtype` can compute through the kernel here."""
    return (
        device.type == "cpu" and dtype in cpu_kernels.RUNS_IN[KERNEL] and cpu_kernels.load(KERNEL)
    )


def preferred(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `--cpu-linear auto` takes the kernel: bfloat16 computed by AVX512-BF16's pair
    products, no AMX beside them."""
    return native_bf16_cpu() == "AVX512-BF16" and can_run(device, dtype)


class PairPackedLinear(LinearMethod):
    """Dense weights while loading (as checkpoints store them); after it, only the packed
    copy (`layer.packed_pairs`, a non-persistent buffer)."""

    name: ClassVar[str] = "pairs"

    def process_after_loading(self, layer: LinearLayer) -> None:
        weight = layer.weight
        if not can_run(weight.device, weight.dtype) or layer.in_features % 2:
            raise ValueError(
                f"the pairs method packs bfloat16 weights of an even width on a CPU, not a "
                f"{weight.dtype} weight of {layer.in_features} columns on {weight.device}"
            )
        packed = torch.ops.iris_pairs.pack_pairs(weight.detach().contiguous())
        del layer.weight  # the packed copy owns its memory: nothing reads the dense one
        layer.register_buffer("packed_pairs", packed, persistent=False)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"a {x.dtype} input to a linear layer packed as bfloat16 pairs")
        rows = x.reshape(-1, layer.in_features).contiguous()
        out = torch.ops.iris_pairs.pair_linear(rows, layer.packed_pairs, bias, layer.out_features)
        return out.view(*x.shape[:-1], layer.out_features)

    def dense_bytes(self, layer: LinearLayer) -> int:
        """The bias and the weight as a dense `[out, in]` bfloat16 tensor (the packed copy's
        padding is not the yardstick's)."""
        packed = getattr(layer, "packed_pairs", None)
        if packed is None:
            return super().dense_bytes(layer)
        padding = packed.numel() - layer.out_features * layer.in_features
        return self.resident_bytes(layer) - padding * packed.element_size()
