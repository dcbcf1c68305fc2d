"""The `triton` backend: our Triton kernels (`triton_kernels.py`) over the paged cache.

`prepare` turns the step's chunks into device metadata once per step — `cu_seqlens_q`,
`seq_lens`, the block table and the new tokens' slots, packed in one int32 tensor and
copied to the device in one transfer — and every layer's `attend` launches the KV write
and one attention kernel with no host sync.

Which attention kernel (decided once per step, on the host, from the chunks):

- **split-K decode** when every chunk is a decode, there are at most
  `SPLIT_MAX_PROGRAMS // kv_heads` of them (vLLM's rule: below that the unified kernel's
  `seqs x kv_heads` programs leave most of the GPU idle) and the longest context has at
  least `SPLIT_MIN_CONTEXT` tokens (one full tile per segment; a shorter one leaves
  segments empty and pays the reduce for nothing);
- the **unified** kernel otherwise (any mix of prefill chunks and decodes).

When decode steps run under CUDA graphs the path must depend on the batch bucket only
(`notes/gpu-engine.md` §3), so the context-length condition will go there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from iris_serve.scheduler.attention import triton_kernels as kernels
from iris_serve.scheduler.attention.base import AttentionBackend, SequenceChunk, new_token_slots
from iris_serve.scheduler.kv_cache import KVCache

SPLIT_MAX_PROGRAMS = 128
SPLIT_MIN_CONTEXT = kernels.NUM_SEGMENTS * kernels.TILE_DECODE


def use_split_decode(chunks: Sequence[SequenceChunk], num_kv_heads: int) -> bool:
    """The rule above: split-K for a few decodes with long contexts."""
    return (
        0 < len(chunks) <= max_split_seqs(num_kv_heads)
        and all(chunk.is_decode for chunk in chunks)
        and max(chunk.context_len for chunk in chunks) >= SPLIT_MIN_CONTEXT
    )


def max_split_seqs(num_kv_heads: int) -> int:
    return max(1, SPLIT_MAX_PROGRAMS // num_kv_heads)


class TritonBackend(AttentionBackend):
    """`split_decode`: None applies `use_split_decode`; True/False force the split path
    on or off for decode-only steps (tests compare the two)."""

    name = "triton"

    def __init__(
        self, kv_cache: KVCache, device: torch.device, split_decode: bool | None = None
    ) -> None:
        super().__init__(kv_cache, device)
        self.split_decode = split_decode
        self._scratch: kernels.SplitScratch | None = None

    def prepare(self, chunks: Sequence[SequenceChunk]) -> TritonStep:
        if self.split_decode is None:
            split = use_split_decode(chunks, self.kv_cache.layout.num_kv_heads)
        else:
            split = self.split_decode and bool(chunks) and all(c.is_decode for c in chunks)
        return TritonStep(self, chunks, split)

    def scratch(self, num_seqs: int, num_heads: int) -> kernels.SplitScratch:
        """The split-K partials, allocated once (for the rule's most sequences) and reused."""
        scratch = self._scratch
        if scratch is None or scratch.num_heads != num_heads or scratch.max_seqs < num_seqs:
            max_seqs = max(num_seqs, max_split_seqs(self.kv_cache.layout.num_kv_heads))
            scratch = kernels.SplitScratch(
                max_seqs, num_heads, self.kv_cache.layout.head_dim, self.device
            )
            self._scratch = scratch
        return scratch


class TritonStep:
    """The `AttentionContext` of one step: device metadata built once, kernels per layer."""

    def __init__(self, backend: TritonBackend, chunks: Sequence[SequenceChunk], split: bool):
        self.kv_cache = backend.kv_cache
        self.backend = backend
        self.split = split
        self.num_seqs = len(chunks)
        page_size = self.kv_cache.page_size
        cu_seqlens = [0]
        seq_lens = []
        slots: list[int] = []
        for chunk in chunks:
            cu_seqlens.append(cu_seqlens[-1] + chunk.num_new)
            seq_lens.append(chunk.context_len)
            slots.extend(new_token_slots(chunk, page_size))
        page_counts = [-(-chunk.context_len // page_size) for chunk in chunks]
        self.max_pages = max(page_counts, default=1)
        table: list[int] = []
        for chunk, count in zip(chunks, page_counts, strict=True):
            table.extend(chunk.pages[:count])
            table.extend([0] * (self.max_pages - count))  # never read: masked by seq_lens
        packed = torch.tensor(cu_seqlens + seq_lens + slots + table, dtype=torch.int32)
        packed = packed.to(backend.device)
        sizes = [len(cu_seqlens), len(seq_lens), len(slots), len(table)]
        cu, lens, slot_mapping, flat_table = packed.split(sizes)
        self.cu_seqlens_q = cu
        self.seq_lens = lens
        self.slot_mapping = slot_mapping
        self.block_table = flat_table.view(self.num_seqs, self.max_pages)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer_idx)
        kernels.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        out = torch.empty_like(q)
        page_size = self.kv_cache.page_size
        if self.split:
            scratch = self.backend.scratch(self.num_seqs, q.shape[1])
            kernels.split_decode_attention(
                q, k_cache, v_cache, out, self.seq_lens, self.block_table, page_size, scratch
            )
        else:
            kernels.unified_attention(
                q,
                k_cache,
                v_cache,
                out,
                self.cu_seqlens_q,
                self.seq_lens,
                self.block_table,
                page_size,
            )
        return out
