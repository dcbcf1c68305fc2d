"""Paged attention with torch SDPA, for a step that mixes prefill chunks and decodes.

The model hands every layer's q/k/v for the step's new tokens, flat over sequences.
`PagedAttention.attend` writes k/v into the sequences' pages, then attends:

- each prefill chunk on its own, over its whole history, with a causal mask shifted by
  the tokens already cached (a chunk's first query sees every earlier token);
- all single-token decodes in one padded SDPA call, masked to each sequence's length.

Slot indices and masks are built once per step (`build`) and reused by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iris_serve.scheduler.kv_cache import KVCache, slots_for


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a step: `num_new` tokens after `num_cached` cached ones."""

    pages: Sequence[int]
    num_cached: int
    num_new: int

    @property
    def context_len(self) -> int:
        return self.num_cached + self.num_new


@dataclass
class _Prefill:
    query_start: int
    query_len: int
    context_slots: torch.Tensor  # [context_len]
    mask: torch.Tensor | None  # [query_len, context_len] bool, None = plain causal


@dataclass
class _DecodeBatch:
    query_index: torch.Tensor  # [B] rows of the flat batch
    context_slots: torch.Tensor  # [B, max_context]
    mask: torch.Tensor  # [B, 1, 1, max_context] bool


class PagedAttention:
    """The `AttentionContext` of one step over the paged KV cache."""

    def __init__(self, kv_cache: KVCache, chunks: list[SequenceChunk], device: torch.device):
        self.kv_cache = kv_cache
        page_size = kv_cache.page_size
        new_slots = [slots_for(c.pages, c.num_cached, c.context_len, page_size) for c in chunks]
        self.slot_mapping = torch.cat(new_slots).to(device)

        self.prefills: list[_Prefill] = []
        decode_rows: list[int] = []
        decode_chunks: list[SequenceChunk] = []
        query_start = 0
        for chunk in chunks:
            if chunk.num_new == 1 and chunk.num_cached > 0:
                decode_rows.append(query_start)
                decode_chunks.append(chunk)
            else:
                self.prefills.append(self._prefill(chunk, query_start, page_size, device))
            query_start += chunk.num_new
        self.decodes = self._decode_batch(decode_rows, decode_chunks, page_size, device)

    @staticmethod
    def _prefill(
        chunk: SequenceChunk, query_start: int, page_size: int, device: torch.device
    ) -> _Prefill:
        mask = None
        if chunk.num_cached:
            mask = torch.ones(chunk.num_new, chunk.context_len, dtype=torch.bool, device=device)
            mask = mask.tril(diagonal=chunk.num_cached)
        return _Prefill(
            query_start=query_start,
            query_len=chunk.num_new,
            context_slots=slots_for(chunk.pages, 0, chunk.context_len, page_size).to(device),
            mask=mask,
        )

    @staticmethod
    def _decode_batch(
        rows: list[int], chunks: list[SequenceChunk], page_size: int, device: torch.device
    ) -> _DecodeBatch | None:
        if not chunks:
            return None
        max_context = max(c.context_len for c in chunks)
        slots = torch.zeros(len(chunks), max_context, dtype=torch.long)
        mask = torch.zeros(len(chunks), 1, 1, max_context, dtype=torch.bool)
        for i, chunk in enumerate(chunks):
            slots[i, : chunk.context_len] = slots_for(chunk.pages, 0, chunk.context_len, page_size)
            mask[i, ..., : chunk.context_len] = True
        return _DecodeBatch(
            query_index=torch.tensor(rows, device=device),
            context_slots=slots.to(device),
            mask=mask.to(device),
        )

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.kv_cache.write(layer_idx, self.slot_mapping, k, v)
        out = torch.empty_like(q)
        for p in self.prefills:
            keys, values = self.kv_cache.gather(layer_idx, p.context_slots)
            query = q[p.query_start : p.query_start + p.query_len]
            out[p.query_start : p.query_start + p.query_len] = _sdpa(
                query.transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                mask=p.mask,
                causal=p.mask is None,
            )[0].transpose(0, 1)
        if self.decodes is not None:
            d = self.decodes
            keys, values = self.kv_cache.gather(layer_idx, d.context_slots)  # [B, L, H, D]
            query = q[d.query_index].unsqueeze(2)  # [B, H, 1, D]
            attended = _sdpa(query, keys.transpose(1, 2), values.transpose(1, 2), mask=d.mask)
            out[d.query_index] = attended.squeeze(2)
        return out


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA over `[B, heads, L, D]` with grouped-query K/V (`kv_heads` divides `heads`)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )
