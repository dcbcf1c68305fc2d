"""The FLOPs a forward spends in attention, counted from the attention calls it makes.

A roofline that counts the weights' matmuls only (2 × parameters × tokens) leaves out
QKᵀ and PV, which are matmuls too: for a large image's tower (thousands of patches in one
sequence in its full-attention layers) or a long prefill they are a large share of the
work. `AttentionFlops` watches the torch SDPA kernels a forward dispatches and adds
up 2 × heads × (query, key) pairs × (key dim + value dim) per call, the pairs a causal or
boolean mask leaves out not counted, our CPU kernel for the towers' segments
(`iris_vision::segment_attention`) as every pair within a segment, and its kernel for a
prefill chunk's history (`iris_vision::history_attention`) as every (row, key) pair. Attention that runs
outside these ops (a Triton kernel on a GPU) is not seen: its rows stay weights-only. torch's own
`FlopCounterMode` counts every pair as if unmasked and skips the CPU flash kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# op: (is_causal's position, the mask's position (None: keyword only) and name)
SDPA_KERNELS = {
    # F.scaled_dot_product_attention reaches a dispatch mode whole, not as the kernel it picks
    aten.scaled_dot_product_attention.default: (5, 3, "attn_mask"),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (4, None, "attn_mask"),
    aten._scaled_dot_product_flash_attention.default: (4, None, None),
    aten._scaled_dot_product_efficient_attention.default: (6, 3, "attn_bias"),
    aten._scaled_dot_product_cudnn_attention.default: (6, 3, "attn_bias"),
}

SEGMENT_KERNEL = "iris_vision::segment_attention"  # q, k, v [tokens, heads, D], starts
HISTORY_KERNEL = "iris_vision::history_attention"  # q [n, heads, D], k, v [kv_heads, L, D]


class AttentionFlops(TorchDispatchMode):
    """`with AttentionFlops() as counted: forward()`, then `counted.flops`."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in SDPA_KERNELS:
            causal_at, mask_at, mask_name = SDPA_KERNELS[func]
            causal = _argument(args, kwargs, causal_at, "is_causal")
            mask = _argument(args, kwargs, mask_at, mask_name)
            self.flops += attention_flops(args[0], args[1], args[2], bool(causal), mask)
        elif getattr(func, "name", lambda: "")() == SEGMENT_KERNEL:
            self.flops += segment_flops(args[0], args[3])
        elif getattr(func, "name", lambda: "")() == HISTORY_KERNEL:
            q, k = args[0], args[1]
            self.flops += 2 * q.shape[1] * q.shape[0] * k.shape[1] * 2 * q.shape[2]
        return func(*args, **kwargs)


def attention_flops(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None
) -> int:
    """FLOPs of one attention call: q `[..., heads, Lq, D]`, k `[..., Lk, D]`, v
    `[..., Lk, Dv]`; a causal call's query i sees keys 0..i, a boolean mask its True pairs
    and a float mask its finite ones."""
    *batch, heads, queries, dim = q.shape
    keys, value_dim = k.shape[-2], v.shape[-1]
    rows = heads
    for size in batch:
        rows *= size
    if mask is not None:
        kept = mask if mask.dtype == torch.bool else torch.isfinite(mask)
        pairs = int(kept.expand(*batch, heads, queries, keys).sum())
        return 2 * pairs * (dim + value_dim)
    if causal:
        # query i sees min(i + 1, keys) keys
        full = max(0, queries - keys)
        seen = min(queries, keys)
        per_row = seen * (seen + 1) // 2 + full * keys
    else:
        per_row = queries * keys
    return 2 * rows * per_row * (dim + value_dim)


def segment_flops(q: torch.Tensor, starts: torch.Tensor) -> int:
    """FLOPs of attention within each segment `[starts[i], starts[i + 1])` of q's tokens."""
    lengths = starts[1:] - starts[:-1]
    pairs = int((lengths * lengths).sum())
    return 2 * q.shape[1] * pairs * 2 * q.shape[2]


def _argument(args: tuple, kwargs: dict, index: int | None, name: str | None) -> Any:
    if name is not None and name in kwargs:
        return kwargs[name]
    return args[index] if index is not None and len(args) > index else None
