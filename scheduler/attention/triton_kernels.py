"""Our Triton kernels for paged attention: the KV write, one unified kernel for any mix
of decodes and prefill chunks, and a split-K decode for few sequences with long contexts.

After vLLM's unified Triton attention, on Iris's head-major cache (per layer, K and V
each `[kv_heads, slots, head_dim]`), read in place through a block table:

- **GQA packing.** A program owns one KV head and `BLOCK_Q` consecutive query tokens of
  one sequence, with all `group = heads // kv_heads` query heads of that KV head as its
  rows: row `r` is token `r // group`, head `r % group`. `BLOCK_M = max(16,
  next_pow2(group))` rows, `BLOCK_Q = BLOCK_M // group`, so a one-token decode still
  feeds a 16-row `tl.dot` and K/V are loaded once for the whole group.
- **No host readback.** The grid is an upper bound, `tokens // BLOCK_Q + seqs` q-blocks
  (sequence `s` starts at q-block `cu_seqlens_q[s] // BLOCK_Q + s`); a program finds its
  sequence by binary search over `cu_seqlens_q` and exits early past its end.
- **KV tiles** of `TILE` tokens, independent of the page size. Causal through
  `context_len = seq_len - query_len`: query token `i` of a chunk sees keys
  `0 .. context_len + i`. Softmax online in fp32 (base 2, scale folded in).
- **head_dim** padded to `max(16, next_pow2(head_dim))` with masked loads (16 is the
  smallest `tl.dot` inner size).
- **Split-K decode**: the context is cut into `NUM_SEGMENTS` segments, each written as a
  partial (unnormalised acc, running max, sum) into fp32 scratch, merged by a reduce
  kernel: more programs per sequence when too few sequences fill the GPU.

Offsets into the cache are int64 (slots * head_dim passes 2**31 on a large cache).
"""

# Kernel parameters are annotated `tl.constexpr` (Triton specialises on them) and receive
# plain ints; in a kernel body an int derived from a program id is a tensor (`.to`), and
# `tl.sum`'s result is typed a tuple (`/`). Triton's DSL, which its annotations do not
# express: these three rules are off for this file only.
# pyright: reportArgumentType=false, reportAttributeAccessIssue=false, reportOperatorIssue=false

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_PREFILL = 32  # KV tokens per iteration of the unified kernel
TILE_DECODE = 16  # KV tokens per iteration of a split-K segment
NUM_SEGMENTS = 16  # split-K segments per sequence (vLLM's choice)
_LOG2E = 1.4426950408889634


def padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def rows_per_kv_head(group: int) -> int:
    """BLOCK_M: the GQA group's query heads packed as rows, at least 16 of them."""
    return max(16, triton.next_power_of_2(group))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 dots default to tf32 on the GPU (10-bit mantissa); fp32 caches mean "exact".
    return "ieee" if dtype == torch.float32 else "tf32"


# -- KV write ----------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cache_h,
    stride_cache_s,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token: all its KV heads into `slot`; slot < 0 (padding) skipped."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src_k = k_ptr + token.to(tl.int64) * stride_k_t + heads[:, None] * stride_k_h + dims[None, :]
    src_v = v_ptr + token.to(tl.int64) * stride_v_t + heads[:, None] * stride_v_h + dims[None, :]
    dst = heads[:, None].to(tl.int64) * stride_cache_h + slot * stride_cache_s + dims[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores k/v `[tokens, kv_heads, head_dim]` at `slot_mapping` `[tokens]` of the
    layer's caches `[kv_heads, slots, head_dim]`; a slot < 0 is left alone."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _unit_last_stride(k), _unit_last_stride(v)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


# -- unified attention -------------------------------------------------------------------


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence whose q-blocks hold global q-block `q_block` (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_seqs,
    qk_scale,  # head_dim ** -0.5 * log2(e)
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_cache_h,
    stride_cache_s,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    query_pos = local_block * BLOCK_Q + rows // GROUP  # within the chunk
    row_ok = (rows // GROUP < BLOCK_Q) & (query_pos < q_len)
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows % GROUP
    q_offsets = (q_start + query_pos).to(tl.int64)[:, None] * stride_q_t
    q_offsets += heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    # The last key any row of this block sees: its last token's own position.
    last_query = tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    num_keys = context_len + last_query + 1
    head_offset = kv_head.to(tl.int64) * stride_cache_h
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(0, num_keys, TILE):
        keys = tile_start + tl.arange(0, TILE)
        key_ok = keys < num_keys
        page = tl.load(block_row + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        slots = page * PAGE_SIZE + keys % PAGE_SIZE
        k = tl.load(
            k_cache_ptr + head_offset + slots[None, :] * stride_cache_s + dims[:, None],
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # [HEAD_DIM_PADDED, TILE]
        v = tl.load(
            v_cache_ptr + head_offset + slots[:, None] * stride_cache_s + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE, HEAD_DIM_PADDED]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = (keys[None, :] <= context_len + query_pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_offsets = (q_start + query_pos).to(tl.int64)[:, None] * stride_o_t
    o_offsets += heads[:, None] * stride_o_h + dims[None, :]
    tl.store(
        out_ptr + o_offsets,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
) -> None:
    """Paged causal attention of q `[tokens, heads, head_dim]` (sequence `s`'s tokens are
    rows `cu_seqlens_q[s] .. cu_seqlens_q[s+1]`, the last ones of its `seq_lens[s]`
    tokens) over the caches `[kv_heads, slots, head_dim]` through `block_table`
    `[seqs, max_pages]`, into `out` (q's shape). No host sync: the grid is an upper bound.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    block_m = rows_per_kv_head(group)
    block_q = block_m // group
    q = _unit_last_stride(q)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_table,
        num_seqs,
        head_dim**-0.5 * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=padded_head_dim(head_dim),
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE=TILE_PREFILL,
        DOT_PRECISION=_dot_precision(q.dtype),
    )


# -- split-K decode ----------------------------------------------------------------------


@triton.jit
def _split_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    acc_ptr,  # [seqs, heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32 scratch
    max_ptr,  # [seqs, heads, NUM_SEGMENTS] fp32 scratch (base-2 logits)
    sum_ptr,  # [seqs, heads, NUM_SEGMENTS] fp32 scratch
    seq_lens_ptr,
    block_table_ptr,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_cache_h,
    stride_cache_s,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (seqs, kv_heads, NUM_SEGMENTS): one decode token (token `seq`), its GQA group
    as rows, over one segment of `cdiv(seq_len, NUM_SEGMENTS * TILE)` tiles. An empty
    segment (short context) writes max -inf and sum 0, which the reduce weighs as 0."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_segment = tl.cdiv(seq_len, NUM_SEGMENTS * TILE)
    first_key = segment * tiles_per_segment * TILE
    end_key = tl.minimum(first_key + tiles_per_segment * TILE, seq_len)

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q_offsets = seq.to(tl.int64) * stride_q_t + heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    head_offset = kv_head.to(tl.int64) * stride_cache_h
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(first_key, end_key, TILE):
        keys = tile_start + tl.arange(0, TILE)
        key_ok = keys < end_key
        page = tl.load(block_row + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        slots = page * PAGE_SIZE + keys % PAGE_SIZE
        k = tl.load(
            k_cache_ptr + head_offset + slots[None, :] * stride_cache_s + dims[:, None],
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + head_offset + slots[:, None] * stride_cache_s + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    partial = (seq * NUM_HEADS + heads) * NUM_SEGMENTS + segment
    tl.store(max_ptr + partial, m_i, mask=row_ok)
    tl.store(sum_ptr + partial, l_i, mask=row_ok)
    acc_offsets = partial.to(tl.int64)[:, None] * HEAD_DIM_PADDED + dims[None, :]
    tl.store(acc_ptr + acc_offsets, acc, mask=row_ok[:, None])


@triton.jit
def _reduce_segments_kernel(
    out_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    stride_o_t,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """Grid (seqs, heads): merges the segments' partials of one decode token and head."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    segments = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    partial = (seq * NUM_HEADS + head) * NUM_SEGMENTS + segments
    m = tl.load(max_ptr + partial)
    total_max = tl.max(m, axis=0)  # finite: segment 0 always holds key 0
    weight = tl.exp2(m - total_max)  # 0 for empty segments
    total = tl.sum(tl.load(sum_ptr + partial) * weight, axis=0)
    acc = tl.load(acc_ptr + partial.to(tl.int64)[:, None] * HEAD_DIM_PADDED + dims[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / total
    o_offsets = seq.to(tl.int64) * stride_o_t + head * stride_o_h + dims
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


class SplitScratch:
    """Preallocated fp32 partials for split-K decode of up to `max_seqs` sequences, so
    the buffers' addresses stay fixed across steps (what a CUDA graph will need)."""

    def __init__(self, max_seqs: int, num_heads: int, head_dim: int, device: torch.device) -> None:
        shape = (max_seqs, num_heads, NUM_SEGMENTS)
        self.max_seqs = max_seqs
        self.num_heads = num_heads
        self.acc = torch.empty(
            *shape, padded_head_dim(head_dim), dtype=torch.float32, device=device
        )
        self.max = torch.empty(shape, dtype=torch.float32, device=device)
        self.sum = torch.empty(shape, dtype=torch.float32, device=device)


def split_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    scratch: SplitScratch,
) -> None:
    """Decode-only attention (token `s` is sequence `s`'s one new token, already in the
    cache) in `NUM_SEGMENTS` segments per sequence, then a reduce; same result as
    `unified_attention` on the same inputs."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    if num_seqs > scratch.max_seqs or num_heads != scratch.num_heads:
        raise ValueError(f"split scratch holds {scratch.max_seqs} seqs x {scratch.num_heads} heads")
    q = _unit_last_stride(q)
    head_dim_padded = padded_head_dim(head_dim)
    _split_decode_kernel[(num_seqs, num_kv_heads, NUM_SEGMENTS)](
        q,
        k_cache,
        v_cache,
        scratch.acc,
        scratch.max,
        scratch.sum,
        seq_lens,
        block_table,
        head_dim**-0.5 * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        PAGE_SIZE=page_size,
        BLOCK_M=rows_per_kv_head(group),
        TILE=TILE_DECODE,
        NUM_SEGMENTS=NUM_SEGMENTS,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    _reduce_segments_kernel[(num_seqs, num_heads)](
        out,
        scratch.acc,
        scratch.max,
        scratch.sum,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        NUM_SEGMENTS=NUM_SEGMENTS,
    )


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim densely; a copy only in the rare strided case."""
    return t if t.stride(-1) == 1 else t.contiguous()
