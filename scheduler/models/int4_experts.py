"""Routed MoE experts of a 4-bit checkpoint (AWQ, GPTQ, W4A16) on CUDA, stacked for our
grouped Triton GEMM: every expert's rows of a projection in one launch, no count read
back, so the decode step stays capturable in a CUDA graph.

The experts load as one `GatedMLP` per expert (`RoutedExperts.use_linear_method`), each
layer handed to `int4_kernel.Int4TritonLinear` once loaded (int32 words `[K/8, N]`, scales
and zeros `[K/G, N]`); `stack` then moves the two projections' tensors into `[E, ...]`
stacks on the experts (`int4_gate_up_proj_*`, `int4_down_proj_*`) and drops the
per-expert layers. Where a layer stayed with its format (a group not dividing this rank's
inputs) or takes its inputs in an order of its own (GPTQ in activation order) the experts
keep running one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .dequantized import registered
from .int4_kernel import Int4TritonLinear

if TYPE_CHECKING:
    from .moe import RoutedExperts

PROJECTIONS = ("gate_up_proj", "down_proj")
LEAVES = ("qweight", "scales", "zeros")


def stack(experts: RoutedExperts) -> bool:
    """Stacks `experts`' per-expert Triton layers (see the module); False, changing
    nothing, where one of them is not held for the Triton GEMM."""
    layers = {name: [getattr(mlp, name) for mlp in experts.per_expert] for name in PROJECTIONS}
    methods = [layer.method for group in layers.values() for layer in group]
    if not methods or not all(isinstance(m, Int4TritonLinear) for m in methods):
        return False
    if any(hasattr(layer, "int4_input_order") for group in layers.values() for layer in group):
        return False  # each expert's inputs in an order of its own (GPTQ's activation order)
    groups = {m.group_size for m in methods if isinstance(m, Int4TritonLinear)}
    if len(groups) != 1:
        return False
    for name, group in layers.items():
        for leaf in LEAVES:
            stacked = torch.stack([registered(getattr(layer, f"int4_{leaf}")) for layer in group])
            setattr(experts, f"int4_{name}_{leaf}", nn.Parameter(stacked, False))
    for expert in range(len(experts.per_expert)):
        delattr(experts, str(expert))
    experts.per_expert = ()
    experts.int4_group = groups.pop()
    return True


def grouped_product(
    experts: RoutedExperts, name: str, x: torch.Tensor, rows_per_expert: torch.Tensor
) -> torch.Tensor:
    """`x` sorted by expert times each expert's projection `name`, in one launch."""
    from .triton_quant import grouped_int4_linear

    assert experts.int4_group is not None  # stacked
    qweight, scales, zeros = (getattr(experts, f"int4_{name}_{leaf}") for leaf in LEAVES)
    return grouped_int4_linear(x, rows_per_expert, qweight, scales, zeros, experts.int4_group)
