"""The one seam between the model code and whoever owns the KV cache.

The language model computes q/k/v and rotary itself and hands them to an
`AttentionContext`; what "history" means is the context's business. The scheduler's
paged implementations are the backends in `scheduler/attention/`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class AttentionContext(Protocol):
    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[N, num_heads, head_dim]`, k/v `[N, num_kv_heads, head_dim]` for this step's new
        tokens (rotary applied), flat over all sequences of the step. Returns
        `[N, num_heads, head_dim]`: each token attends causally over its sequence's history
        (which the implementation stores) and itself, with scale `head_dim ** -0.5`."""
        ...


class KernelDecodes(NamedTuple):
    """A step of decodes only, every one attended to by the CPU paged decode kernel
    (`cpu_kernels/paged_attention.cpp`): what a model's fused decode step needs to write
    the new K/V and attend in C++ (`fused_decode.py`)."""

    cache: torch.Tensor  # [layers, 2, kv_heads, slots, head_dim]
    slot_mapping: torch.Tensor  # [N] int64: each row's new slot
    spans: torch.Tensor  # [S, 2] int64: (first slot, length) of each context run
    sequence_spans: torch.Tensor  # [N + 1] int64: row n's runs are spans[b[n]:b[n + 1]]
    max_group: int  # the most query heads per KV head the kernel takes


def kernel_decodes(attn: AttentionContext) -> KernelDecodes | None:
    """`attn`'s step as `KernelDecodes` where it is one; None for any other step, or a
    context that has no such steps (the GPU's)."""
    method = getattr(attn, "kernel_decodes", None)
    return None if method is None else method()
