"""Every decode of a step in one call on a CPU: our C++ paged decode attention
(`cpu_kernels/paged_attention.cpp`), which reads each sequence's keys and values where
they lie in the head-major cache, any number of page runs included, and splits long
contexts across the thread pool; torch's SDPA, called once per sequence and layer, keeps
one core busy on a short context and pays its call overhead per sequence.

`BatchedDecodes.of` returns None where the kernel cannot run (another device, a cache
dtype other than float32 or bfloat16, a head size that is not a whole number of vectors,
or the kernel did not build) or gains nothing (a single float32 decode, which torch's
flash attention streams from memory as fast), and `sdpa` attends to each decode on its
own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import cpu_kernels
from ..kv.kv_cache import KVCache

MAX_GROUP = 16  # query heads per KV head

SlotSpan = tuple[int, int]  # (first slot, number of slots)


class BatchedDecodes:
    """The decodes of one step: their query rows and their contexts' slot spans."""

    def __init__(
        self, rows: Sequence[int], spans: Sequence[Sequence[SlotSpan]], device: torch.device
    ) -> None:
        self.rows: slice | torch.Tensor = _as_slice(rows) or torch.tensor(rows, device=device)
        flat = [span for sequence in spans for span in sequence]
        self.spans = torch.tensor(flat, dtype=torch.long).view(-1, 2).to(device)
        bounds = [0]
        for sequence in spans:
            bounds.append(bounds[-1] + len(sequence))
        self.sequence_spans = torch.tensor(bounds, dtype=torch.long).to(device)

    @classmethod
    def of(
        cls,
        kv_cache: KVCache,
        rows: Sequence[int],
        spans: Sequence[Sequence[SlotSpan]],
        device: torch.device,
    ) -> BatchedDecodes | None:
        """The step's decodes batched for the kernel, or None where it cannot run them."""
        layout = kv_cache.layout
        if (
            not rows
            or device.type != "cpu"
            or layout.dtype not in cpu_kernels.DTYPES
            or layout.head_dim % cpu_kernels.VECTOR_FLOATS
            or layout.head_dim > cpu_kernels.MAX_HEAD_DIM
            or (layout.dtype == torch.float32 and len(rows) == 1)
            or not cpu_kernels.load("paged_attention")
        ):
            return None
        return cls(rows, spans, device)

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor
    ) -> bool:
        """Writes the decodes' attention into their rows of `out`; False (nothing written)
        where the model's heads do not suit the kernel."""
        heads, kv_heads, head_dim = q.shape[1], keys.shape[0], q.shape[2]
        if heads % kv_heads or heads // kv_heads > MAX_GROUP:
            return False
        query = q[self.rows].contiguous()
        kernel = torch.ops.iris_attention.paged_decode_attention
        scale = 1.0 / math.sqrt(head_dim)  # SDPA's default, as the per-sequence path uses
        out[self.rows] = kernel(query, keys, values, self.spans, self.sequence_spans, scale)
        return True


def _as_slice(rows: Sequence[int]) -> slice | None:
    """`rows` as a slice where they are consecutive (a step's decodes usually are)."""
    first = rows[0]
    if list(rows) == list(range(first, first + len(rows))):
        return slice(first, first + len(rows))
    return None
