"""oneDNN for a CPU model's linear layers: each `nn.Linear`'s weight is prepacked once, at
load, into oneDNN's blocked layout, and the layer computes through oneDNN's matmul.

PyTorch's default CPU linear goes through MKL's sgemm, which on AMD processors takes a
slow path; oneDNN with a prepacked weight is faster at every row count, from a decode
step's one to a prefill chunk's thousands (`bench/results/cpu_linear_small.md` has the
served figures both ways). vLLM's CPU build computes its linear layers the same way.

The packed copy sits beside the dense weight, which stays for everything that reads it
(loading, tensor-parallel slices, tied embeddings, the LM head's own `F.linear`): a CPU
model's linear weights take twice their memory. `--cpu-linear aten` keeps PyTorch's path.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

from .tensor_parallel import RowParallelLinear

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def pack_linears(model: nn.Module) -> int:
    """Routes every CPU `nn.Linear` of `model` (float32 or bfloat16) through oneDNN with a
    prepacked weight; returns how many. Nothing changes where oneDNN is missing."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
            continue
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
        count += 1
    return count


def _packed_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` through its packed weight; a row-parallel layer under tensor parallelism
    sums the ranks' partial outputs before its bias, as its own `forward` does."""
    if x.numel() == 0 or x.dtype != layer.weight.dtype:
        return type(layer).forward(layer, x)
    split = isinstance(layer, RowParallelLinear) and layer.tp.size > 1
    bias = None if split else layer.bias
    out = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")
    if split:
        assert isinstance(layer, RowParallelLinear)
        out = layer.tp.all_reduce(out)
        if layer.bias is not None:
            out = out + layer.bias
    return out
