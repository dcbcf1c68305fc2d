"""The `sdpa` backend: torch's scaled_dot_product_attention over the paged cache in place.

Nothing is gathered: the cache is head-major, so a run of consecutive pages is a strided
view that SDPA reads as it is (`free_pages.py` keeps runs few). Per sequence and layer:

- a decode is one SDPA call over the view of its context, with the query heads of each
  KV head packed as that head's query rows (no K/V expansion, no mask);
- a prefill chunk with no history attends causally over its own new k/v;
- a prefill chunk after cached tokens attends over its whole context with a causal mask
  shifted by the cached tokens; on the CPU, a chunk of at least `SPLIT_MIN_NEW_TOKENS`
  attends causally over its own new k/v and, unmasked, over each run of its history,
  merged by log-sum-exps: a mask makes the CPU kernel compute every block of the
  rectangle, while the causal part skips those above the diagonal; below the bound the
  mask is as fast or faster (bench/results/chunk_attention_small.md). In bfloat16 every
  chunk after history splits, its history through our kernel
  (`cpu_kernels/segment_attention.cpp`'s `history_attention`: bf16 pair products, where
  torch's CPU flash attention computes bf16 at fp32's pace), faster than the mask at
  every chunk size measured.

A context over several runs (a shared prefix, a fragmented pool): a decode over a few
runs attends to each on its own and merges the results by their log-sum-exps (CPU;
elsewhere the runs are concatenated); over `GATHER_MIN_RUNS` or more (a pool the prefix
cache has fragmented by evicting), it gathers its pages into one K and one V per layer
first, a page-sized copy each: one SDPA call instead of one per run and layer; a prefill
chunk concatenates them.

On a CPU every decode of a step goes through our C++ paged decode attention in one
call instead (`cpu_decode.py`), over its runs as they lie; the per-sequence paths above
stay for where it cannot run.

Host work per step is O(new tokens + runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import cpu_kernels
from ..kv.kv_cache import KVCache
from ..models.attention_api import KernelDecodes
from .base import AttentionBackend, SequenceChunk, new_token_slots
from .cpu_decode import MAX_GROUP, BatchedDecodes, SlotSpan

SPLIT_MIN_NEW_TOKENS = 512  # on the CPU, a chunk after history this long splits its attention
GATHER_MIN_RUNS = 8  # a decode whose context has this many runs gathers its pages first


@dataclass(frozen=True)
class _Item:
    """One chunk's attention in a step: its query rows and where its context lives."""

    rows: slice
    spans: tuple[SlotSpan, ...]  # the context's slots, in order; empty: no history read
    is_decode: bool
    mask: torch.Tensor | None  # [new, context] bool for a chunk after cached tokens
    split: bool = False  # history and own tokens apart (CPU): `spans` are the history's
    # a decode over many runs: its context's pages, gathered before attending
    pages: torch.Tensor | None = None
    context_len: int = 0


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def prepare(self, chunks: Sequence[SequenceChunk]) -> SdpaStep:
        return SdpaStep(self.kv_cache, chunks, self.device)


class SdpaStep:
    """The `AttentionContext` of one step."""

    def __init__(
        self, kv_cache: KVCache, chunks: Sequence[SequenceChunk], device: torch.device
    ) -> None:
        self.kv_cache = kv_cache
        page_size = kv_cache.page_size
        slots = [slot for chunk in chunks for slot in new_token_slots(chunk, page_size)]
        self.slot_mapping = torch.tensor(slots, dtype=torch.long).to(device)
        self.items: list[_Item] = []
        history_kernel = _history_kernel_runs(kv_cache, device)
        decode_rows: list[int] = []
        decode_spans: list[tuple[SlotSpan, ...]] = []
        row = 0
        for chunk in chunks:
            rows = slice(row, row + chunk.num_new)
            row += chunk.num_new
            if chunk.num_cached == 0:
                self.items.append(_Item(rows, (), is_decode=False, mask=None))
                continue
            split = not chunk.is_decode and (
                chunk.num_new >= SPLIT_MIN_NEW_TOKENS or history_kernel
            )
            if split and device.type == "cpu":
                spans = _context_spans(chunk, page_size, chunk.num_cached)
                self.items.append(_Item(rows, spans, is_decode=False, mask=None, split=True))
                continue
            spans = _context_spans(chunk, page_size, chunk.context_len)
            if chunk.is_decode:
                decode_rows.append(rows.start)
                decode_spans.append(spans)
            if chunk.is_decode and len(spans) >= GATHER_MIN_RUNS:
                pages = _context_pages(chunk, page_size, device)
                self.items.append(_Item(rows, spans, True, None, False, pages, chunk.context_len))
                continue
            mask = None
            if not chunk.is_decode:
                mask = torch.ones(chunk.num_new, chunk.context_len, dtype=torch.bool)
                mask = mask.tril(diagonal=chunk.num_cached).to(device)
            self.items.append(_Item(rows, spans, chunk.is_decode, mask))
        self.decodes = BatchedDecodes.of(kv_cache, decode_rows, decode_spans, device)
        self.history_kernel = history_kernel

    def kernel_decodes(self) -> KernelDecodes | None:
        """The step as `KernelDecodes` where each of its rows is a decode the C++ kernel
        attends to (rows in order: one per chunk); None otherwise."""
        decodes = self.decodes
        if decodes is None or not all(item.is_decode for item in self.items):
            return None
        if decodes.rows != slice(0, len(self.items)):
            return None
        cache = self.kv_cache.slots
        return KernelDecodes(
            cache, self.slot_mapping, decodes.spans, decodes.sequence_spans, MAX_GROUP
        )

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.kv_cache.write(layer_idx, self.slot_mapping, k, v)
        keys, values = self.kv_cache.layer(layer_idx)  # [kv_heads, slots, head_dim]
        num_kv_heads = keys.shape[0]
        out = torch.empty_like(q)
        decoded = self.decodes is not None and self.decodes.attend(q, keys, values, out)
        for item in self.items:
            if decoded and item.is_decode:
                continue
            query = q[item.rows]  # [new, heads, head_dim]
            if not item.spans:
                out[item.rows] = _causal(query, k[item.rows], v[item.rows])
                continue
            if item.split:
                own = (query, k[item.rows], v[item.rows])
                out[item.rows] = _after_history(*own, keys, values, item.spans, self.history_kernel)
            elif item.is_decode:
                packed = query.view(1, num_kv_heads, -1, query.shape[-1])  # [1, kv, group, D]
                if item.pages is not None:
                    size, length = self.kv_cache.page_size, item.context_len
                    context_k = _gather(keys, item.pages, size, length)
                    context_v = _gather(values, item.pages, size, length)
                    attended = F.scaled_dot_product_attention(packed, context_k, context_v)
                else:
                    attended = _decode(packed, keys, values, item.spans)
                out[item.rows] = attended.reshape(query.shape)
            else:
                context_k = _context(keys, item.spans)  # [kv_heads, context, head_dim]
                context_v = _context(values, item.spans)
                attended = F.scaled_dot_product_attention(
                    query.transpose(0, 1).unsqueeze(0),
                    context_k.unsqueeze(0),
                    context_v.unsqueeze(0),
                    attn_mask=item.mask,
                    enable_gqa=num_kv_heads != query.shape[1],
                )
                out[item.rows] = attended[0].transpose(0, 1)
        return out


def _context_spans(chunk: SequenceChunk, page_size: int, length: int) -> tuple[SlotSpan, ...]:
    """The slots of the chunk's first `length` tokens as spans, one per page run."""
    spans = []
    remaining = length
    for first_page, num_pages in chunk.runs:
        span_length = min(num_pages * page_size, remaining)
        spans.append((first_page * page_size, span_length))
        remaining -= span_length
        if remaining == 0:
            break
    return tuple(spans)


def _context_pages(chunk: SequenceChunk, page_size: int, device: torch.device) -> torch.Tensor:
    """The pages holding the chunk's context, in order (int64, on `device`)."""
    needed = -(-chunk.context_len // page_size)
    pages = [page for first, count in chunk.runs for page in range(first, first + count)]
    return torch.tensor(pages[:needed], dtype=torch.long).to(device)


def _gather(cache: torch.Tensor, pages: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """`[1, kv_heads, length, head_dim]`: the first `length` slots of `pages`, copied out
    of one layer's `[kv_heads, slots, head_dim]` a page at a time."""
    heads, _, head_dim = cache.shape
    by_page = cache.view(heads, -1, page_size, head_dim).index_select(1, pages)
    return by_page.view(heads, -1, head_dim)[:, :length].unsqueeze(0)


def _decode(
    packed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, spans: tuple[SlotSpan, ...]
) -> torch.Tensor:
    """One decode over its context's spans, no mask. Several spans on the CPU: one
    flash-attention call per span, merged by their log-sum-exps (no copy of K/V)."""
    if len(spans) == 1 or packed.device.type != "cpu":
        k, v = _context(keys, spans), _context(values, spans)
        return F.scaled_dot_product_attention(packed, k.unsqueeze(0), v.unsqueeze(0))
    outs, lses = [], []
    for start, length in spans:
        k = keys[:, start : start + length].unsqueeze(0)
        v = values[:, start : start + length].unsqueeze(0)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            packed, k, v, 0.0, False
        )[:2]
        outs.append(out)
        lses.append(lse)
    weights = torch.softmax(torch.stack(lses), dim=0).unsqueeze(-1)  # [spans, 1, kv, g, 1]
    return (torch.stack(outs) * weights).sum(dim=0).to(packed.dtype)


def _after_history(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    spans: tuple[SlotSpan, ...],
    history_kernel: bool = False,
) -> torch.Tensor:
    """A prefill chunk after cached tokens, on the CPU: q `[n, heads, dim]` and its own
    k/v `[n, kv, dim]` causally, each history span unmasked (through our kernel where
    `history_kernel`), merged by log-sum-exps."""
    query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]; the kernel groups heads
    parts = [_flash(query, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), True)]
    for start, length in spans:
        span_k, span_v = keys[:, start : start + length], values[:, start : start + length]
        if history_kernel:
            kernel = torch.ops.iris_vision.history_attention
            out, lse = kernel(q, span_k, span_v, q.shape[-1] ** -0.5)  # SDPA's default scale
            parts.append((out.permute(1, 0, 2).unsqueeze(0), lse.unsqueeze(0)))
        else:
            parts.append(_flash(query, span_k.unsqueeze(0), span_v.unsqueeze(0), False))
    outs, lses = zip(*parts, strict=True)
    weights = torch.softmax(torch.stack(lses), dim=0).unsqueeze(-1)  # [parts, 1, heads, n, 1]
    merged = (torch.stack(outs) * weights).sum(dim=0).to(q.dtype)
    return merged[0].transpose(0, 1)


def _history_kernel_runs(kv_cache: KVCache, device: torch.device) -> bool:
    """Whether a prefill chunk's attention to its history runs through our bf16 kernel: a
    bfloat16 cache on a CPU, heads of an even size it keeps in registers, the kernel built."""
    layout = kv_cache.layout
    return (
        device.type == "cpu"
        and layout.dtype == torch.bfloat16
        and layout.dtype in cpu_kernels.RUNS_IN["segment_attention"]
        and layout.head_dim % 2 == 0
        and layout.head_dim <= cpu_kernels.MAX_HEAD_DIM
        and cpu_kernels.load("segment_attention")
    )


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention: the output and its log-sum-exps (grouped KV heads)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
    return out, lse


def _context(cache: torch.Tensor, spans: tuple[SlotSpan, ...]) -> torch.Tensor:
    """`[kv_heads, context, head_dim]`: a view for one span, a copy for several."""
    if len(spans) == 1:
        start, length = spans[0]
        return cache[:, start : start + length]
    return torch.cat([cache[:, start : start + length] for start, length in spans], dim=1)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a chunk over itself: q `[n, heads, dim]`, k/v `[n, kv, dim]`."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)
