"""The one seam between the model code and whoever owns the KV cache.

The language model computes q/k/v and rotary itself and hands them to an
`AttentionContext`; what "history" means is the context's business. The scheduler's
paged implementations are the backends in `scheduler/attention/`.
"""

from __future__ import annotations

from typing import Protocol

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
