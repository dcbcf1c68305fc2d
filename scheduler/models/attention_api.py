"""The one seam between the model code and whoever owns the KV cache.

The language model computes q/k/v and rotary itself and hands them to an
`AttentionContext`; what "history" means (paged cache, no cache) is the context's
business. The scheduler's paged implementations are the backends in `scheduler/attention/`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionContext(Protocol):
    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[N, num_heads, head_dim]`, k/v `[N, num_kv_heads, head_dim]` for this step's new
        tokens (rotary applied), flat over all sequences of the step. Returns
        `[N, num_heads, head_dim]`: each token attends causally over its sequence's history
        (which the implementation stores) and itself, with scale `head_dim ** -0.5`."""
        ...


class SingleSequenceAttention:
    """No cache: full causal attention over the tokens given, for tests and whole-prompt runs.

    By default all N tokens are one sequence. `seq_lens` splits the flat batch into
    several independent sequences (each causal over itself only).
    """

    def __init__(self, seq_lens: Sequence[int] | None = None) -> None:
        self.seq_lens = list(seq_lens) if seq_lens is not None else None

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self.seq_lens is None:
            return _causal(q, k, v)
        if sum(self.seq_lens) != q.shape[0]:
            raise ValueError(f"seq_lens sum to {sum(self.seq_lens)}, got {q.shape[0]} tokens")
        parts = zip(
            q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens), strict=True
        )
        return torch.cat([_causal(*part) for part in parts])


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # [N, heads, D] -> [1, heads, N, D]: the fused SDPA kernels take 4-D inputs only
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qs, ks, vs, is_causal=True, scale=q.shape[-1] ** -0.5, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out[0].transpose(0, 1)
