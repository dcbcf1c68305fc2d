"""The roofline's attention FLOPs: what `bench.attention_flops` counts for the calls the
engine makes (torch's SDPA whole, or its CPU flash kernel called directly)."""

import torch
import torch.nn.functional as F

from bench.attention_flops import AttentionFlops

HEADS, QUERIES, DIM = 2, 12, 8
PER_PAIR = 2 * (DIM + DIM)  # QKᵀ and PV: a multiply-add per dim each


def qkv(queries: int = QUERIES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, queries, DIM, generator=generator)
    k = torch.randn(1, HEADS, QUERIES, DIM, generator=generator)
    return q, k, k.clone()


def counted(call) -> int:  # type: ignore[no-untyped-def]
    with torch.inference_mode(), AttentionFlops() as attention:
        call()
    return attention.flops


def test_full_attention_counts_every_query_key_pair() -> None:
    q, k, v = qkv()
    assert counted(lambda: F.scaled_dot_product_attention(q, k, v)) == (
        HEADS * QUERIES * QUERIES * PER_PAIR
    )


def test_causal_attention_counts_the_lower_triangle_only() -> None:
    q, k, v = qkv()
    triangle = QUERIES * (QUERIES + 1) // 2
    assert counted(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)) == (
        HEADS * triangle * PER_PAIR
    )
    direct = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    assert counted(lambda: direct(q, k, v, 0.0, True)) == HEADS * triangle * PER_PAIR


def test_masks_count_the_pairs_they_keep() -> None:
    q, k, v = qkv(queries=3)  # a chunk's last 3 queries over all the keys so far
    keep = torch.ones(QUERIES, QUERIES, dtype=torch.bool).tril()[-3:]
    kept = int(keep.sum())
    assert counted(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)) == (
        HEADS * kept * PER_PAIR
    )
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    assert counted(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive)) == (
        HEADS * kept * PER_PAIR
    )


def test_other_ops_count_nothing() -> None:
    q, k, _ = qkv()
    assert counted(lambda: q @ k.transpose(-1, -2)) == 0


def test_our_cpu_kernel_counts_the_pairs_within_each_segment() -> None:
    from iris_serve.scheduler import cpu_kernels

    assert cpu_kernels.load("segment_attention")
    q = torch.randn(10, HEADS, DIM).bfloat16()
    starts = torch.tensor([0, 4, 4, 10])  # segments of 4, 0 and 6 tokens
    kernel = torch.ops.iris_vision.segment_attention
    assert counted(lambda: kernel(q, q, q, starts, 1.0)) == HEADS * (16 + 36) * PER_PAIR


def test_our_history_kernel_counts_every_row_and_key() -> None:
    from iris_serve.scheduler import cpu_kernels

    assert cpu_kernels.load("segment_attention")
    q = torch.randn(5, HEADS, DIM).bfloat16()  # 5 rows, every head reading one KV head
    k = torch.randn(1, 7, DIM).bfloat16()
    kernel = torch.ops.iris_vision.history_attention
    assert counted(lambda: kernel(q, k, k, 1.0)) == HEADS * 5 * 7 * PER_PAIR
