"""The `triton` backend: our Triton kernels (`triton_kernels.py`) over the paged cache.

`prepare` packs the step's `cu_seqlens_q`, `seq_lens`, block table and new tokens' slots
into one int32 tensor, copied to the device in one transfer; every layer's `attend`
launches the KV write and one attention kernel with no host sync. The kernel, chosen once
per step on the host:

- **split-K decode** when every chunk is a decode, there are at most
  `SPLIT_MAX_PROGRAMS // kv_heads` of them (vLLM's rule: below that the unified kernel's
  `seqs x kv_heads` programs leave most of the GPU idle) and the longest context has at
  least `SPLIT_MIN_CONTEXT` tokens (a shorter one leaves segments empty and pays the
  reduce for nothing);
- the **unified** kernel otherwise.

Under CUDA graphs (`StaticTritonDecode`) the choice may depend on the batch size only:
split-K for any graph of at most `max_split_seqs` sequences, whatever their contexts (an
empty segment weighs 0 in the reduce).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kv.kv_cache import KVCache
from . import triton_kernels as kernels
from .base import (
    AttentionBackend,
    SequenceChunk,
    StaticDecode,
    new_token_slots,
)

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
        return TritonStep.of(self, chunks, split)

    def static_decode(self, max_seqs: int, max_pages: int) -> StaticTritonDecode:
        return StaticTritonDecode(self, max_seqs, max_pages)

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
    """The `AttentionContext` of one step: the KV write and one attention kernel per
    layer, over device metadata built once per step (`of`) or held in fixed buffers
    (`StaticTritonDecode`). `scratch_owner` lends the split-K partials."""

    def __init__(
        self,
        kv_cache: KVCache,
        scratch_owner: TritonBackend | StaticTritonDecode,
        split: bool,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
    ) -> None:
        self.kv_cache = kv_cache
        self.scratch_owner = scratch_owner
        self.split = split
        self.num_seqs = seq_lens.shape[0]
        self.cu_seqlens_q = cu_seqlens_q
        self.seq_lens = seq_lens
        self.slot_mapping = slot_mapping
        self.block_table = block_table

    @classmethod
    def of(cls, backend: TritonBackend, chunks: Sequence[SequenceChunk], split: bool) -> TritonStep:
        """`cu_seqlens_q`, `seq_lens`, the new tokens' slots and the block table, packed
        in one int32 tensor and copied to the device in one transfer."""
        page_size = backend.kv_cache.page_size
        cu_seqlens = [0]
        seq_lens = []
        slots: list[int] = []
        for chunk in chunks:
            cu_seqlens.append(cu_seqlens[-1] + chunk.num_new)
            seq_lens.append(chunk.context_len)
            slots.extend(new_token_slots(chunk, page_size))
        page_counts = [-(-chunk.context_len // page_size) for chunk in chunks]
        max_pages = max(page_counts, default=1)
        table: list[int] = []
        for chunk, count in zip(chunks, page_counts, strict=True):
            table.extend(chunk.pages[:count])
            table.extend([0] * (max_pages - count))  # never read: masked by seq_lens
        packed = torch.tensor(cu_seqlens + seq_lens + slots + table, dtype=torch.int32)
        packed = packed.to(backend.device)
        sizes = [len(cu_seqlens), len(seq_lens), len(slots), len(table)]
        cu, lens, slot_mapping, flat_table = packed.split(sizes)
        block_table = flat_table.view(len(chunks), max_pages)
        return cls(backend.kv_cache, backend, split, cu, lens, slot_mapping, block_table)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer_idx)
        kernels.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        out = torch.empty_like(q)
        page_size = self.kv_cache.page_size
        if self.split:
            scratch = self.scratch_owner.scratch(self.num_seqs, q.shape[1])
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


class StaticTritonDecode(StaticDecode):
    """Decode metadata in fixed device buffers: `seq_lens` and `slot_mapping` `[max_seqs]`,
    a full-width block table `[max_seqs, max_pages]` (its row stride is baked into every
    captured kernel), `cu_seqlens_q` = 0, 1, 2, ... and its own split-K scratch. `fill`
    writes a step's rows (the block table cut to its widest sequence) into one pinned host
    buffer, sends it in one non-blocking copy and scatters it into the fixed buffers. Padding
    rows get seq len 1 (key 0 of page 0), slot -1 (no KV write) and page 0."""

    def __init__(self, backend: TritonBackend, max_seqs: int, max_pages: int) -> None:
        device = backend.device
        self.backend = backend
        self.max_seqs = max_seqs
        self.max_pages = max_pages
        self.cu_seqlens_q = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_seqs,), -1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_seqs, max_pages, dtype=torch.int32, device=device)
        flat_size = max_seqs * (2 + max_pages)
        self._staging = torch.empty(flat_size, dtype=torch.int32, device=device)
        self._host = torch.zeros(flat_size, dtype=torch.int32)
        self._sent: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._host = self._host.pin_memory()
        self._scratch: kernels.SplitScratch | None = None
        self._contexts: dict[int, TritonStep] = {}

    def context(self, size: int) -> TritonStep:
        if not 0 < size <= self.max_seqs:
            raise ValueError(
                f"a decode graph of {size} sequences; the buffers hold {self.max_seqs}"
            )
        if size not in self._contexts:
            split = self.backend.split_decode
            if split is None:
                split = size <= max_split_seqs(self.backend.kv_cache.layout.num_kv_heads)
            self._contexts[size] = TritonStep(
                self.backend.kv_cache,
                self,
                split,
                self.cu_seqlens_q[: size + 1],
                self.seq_lens[:size],
                self.slot_mapping[:size],
                self.block_table[:size],
            )
        return self._contexts[size]

    def fill(self, chunks: Sequence[SequenceChunk], size: int) -> None:
        num_seqs = len(chunks)
        if num_seqs > size or size > self.max_seqs:
            raise ValueError(f"{num_seqs} decodes padded to {size} (at most {self.max_seqs})")
        page_size = self.backend.kv_cache.page_size
        page_counts = [-(-chunk.context_len // page_size) for chunk in chunks]
        width = max(page_counts, default=1)
        if width > self.max_pages:
            raise ValueError(f"a sequence of {width} pages; the block table holds {self.max_pages}")
        if self._sent is not None:
            self._sent.synchronize()  # the last step's copy has left the host buffer
        host = self._host.numpy()
        lens, slots = host[:size], host[size : 2 * size]
        table = host[2 * size : size * (2 + width)].reshape(size, width)
        for row, (chunk, count) in enumerate(zip(chunks, page_counts, strict=True)):
            if not chunk.is_decode:
                raise ValueError("a captured step decodes one token per sequence")
            lens[row] = chunk.context_len
            page, offset = divmod(chunk.num_cached, page_size)
            slots[row] = chunk.pages[page] * page_size + offset
            table[row, :count] = chunk.pages[:count]
        lens[num_seqs:] = 1
        slots[num_seqs:] = -1
        table[num_seqs:] = 0
        staging = self._staging[: size * (2 + width)]
        staging.copy_(self._host[: staging.shape[0]], non_blocking=True)
        if self._host.is_pinned():
            self._sent = torch.cuda.Event()
            self._sent.record()
        self.seq_lens[:size].copy_(staging[:size])
        self.slot_mapping[:size].copy_(staging[size : 2 * size])
        self.block_table[:size, :width].copy_(staging[2 * size :].view(size, width))

    def scratch(self, num_seqs: int, num_heads: int) -> kernels.SplitScratch:
        """Allocated once, while the largest split graph warms up, for every split graph."""
        if self._scratch is None:
            max_seqs = min(self.max_seqs, max_split_seqs(self.backend.kv_cache.layout.num_kv_heads))
            head_dim = self.backend.kv_cache.layout.head_dim
            self._scratch = kernels.SplitScratch(
                max(max_seqs, num_seqs), num_heads, head_dim, self.backend.device
            )
        return self._scratch
