"""The vision towers' attention in bfloat16 on a CPU (`cpu_kernels/segment_attention.cpp`):
as close to exact attention as torch's own bf16 SDPA is, over whole images and windows of
any length (key blocks and query tiles cut anywhere, a head not whole vectors, q/k/v as
views of one fused projection); float32 keeps SDPA's arithmetic; bad inputs are refused."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from iris_serve.scheduler import cpu_kernels
from iris_serve.scheduler.models.layers import SegmentPlan

torch.set_num_threads(2)


def fused_qkv(total: int, heads: int, head: int, seed: int) -> list[torch.Tensor]:
    """q, k, v `[total, heads, head]` bf16 as the towers get them: views of one projection."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(total, 3, heads, head, generator=generator).mul(2).bfloat16()
    return list(qkv.unbind(1))


def sdpa_per_segment(q, k, v, bounds: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Attention segment by segment through torch's SDPA, computing in `dtype`, in float32."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for start, end in itertools.pairwise(bounds):
        if end > start:
            qs, ks, vs = (t[start:end].to(dtype).transpose(0, 1) for t in (q, k, v))
            attended = F.scaled_dot_product_attention(qs, ks, vs, scale=q.shape[-1] ** -0.5)
            out[start:end] = attended.transpose(0, 1).float()
    return out


@pytest.mark.parametrize(
    ("bounds", "heads", "head"),
    [
        ([0, 203, 803], 2, 80),  # two images, a short and a long: blocks and tiles end mid-way
        ([0, 64, 64, 65, 82, 146, 246], 3, 72),  # windows, one empty, one of 1 token
        ([0, 40, 77], 1, 256),  # the largest head
    ],
)
def test_bf16_segments_attend_as_closely_as_torchs_bf16_sdpa(bounds, heads, head):
    assert cpu_kernels.load("segment_attention")
    q, k, v = fused_qkv(bounds[-1], heads, head, seed=len(bounds))
    exact = sdpa_per_segment(q, k, v, bounds, torch.float64)
    ours = SegmentPlan(bounds, torch.device("cpu")).attend(q, k, v)
    assert ours.dtype is torch.bfloat16 and ours.shape == q.shape
    torch_bf16 = sdpa_per_segment(q, k, v, bounds, torch.bfloat16)
    our_error = (ours.float() - exact).abs().max().item()
    torch_error = (torch_bf16 - exact).abs().max().item()
    assert our_error <= 2 * torch_error + 1e-3, (our_error, torch_error)


def test_the_plan_routes_bf16_through_the_kernel_and_keeps_fp32_on_sdpa():
    bounds = [0, 64, 128, 150]
    plan = SegmentPlan(bounds, torch.device("cpu"))
    q, k, v = fused_qkv(bounds[-1], 2, 16, seed=3)
    kernel = torch.ops.iris_vision.segment_attention(q, k, v, plan.starts, 16**-0.5)
    assert torch.equal(plan.attend(q, k, v), kernel)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    fp32 = plan.attend(q32, k32, v32)
    torch.testing.assert_close(fp32, sdpa_per_segment(q32, k32, v32, bounds, torch.float32))


def test_inputs_the_kernel_cannot_take_are_refused():
    assert cpu_kernels.load("segment_attention")
    kernel = torch.ops.iris_vision.segment_attention
    q, k, v = fused_qkv(10, 2, 16, seed=1)
    starts = torch.tensor([0, 10])
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(q.float(), k.float(), v.float(), starts, 0.25)
    with pytest.raises(RuntimeError, match="from 0 to the token count"):
        kernel(q, k, v, torch.tensor([0, 9]), 0.25)
    with pytest.raises(RuntimeError, match="never decrease"):
        kernel(q, k, v, torch.tensor([0, 6, 4, 10]), 0.25)
    odd = torch.zeros(10, 2, 15, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="even size"):
        kernel(odd, odd, odd, starts, 0.25)
    plan = SegmentPlan([0, 10], torch.device("cpu"))
    assert plan.attend(odd, odd, odd).shape == odd.shape  # SDPA takes what the kernel cannot


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "keys", "head"), [(37, 4, 2, 300, 80), (5, 6, 3, 1, 128)]
)
def test_a_chunks_attention_to_its_history_is_exact_attentions_to_bf16s_rounding(
    rows, heads, kv_heads, keys, head
):
    """`history_attention`: query rows against a run of a head-major cache (a strided view),
    each KV head read by its group of query heads, no mask: the outputs as close to exact
    attention as torch's bf16 SDPA, and the log-sum-exps the merge with the chunk's own
    causal part needs (scores scaled as SDPA's)."""
    generator = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, heads, head, generator=generator).mul(2).bfloat16()
    cache = torch.randn(2, kv_heads, keys + 40, head, generator=generator).mul(2).bfloat16()
    k, v = cache[0, :, 20 : 20 + keys], cache[1, :, 20 : 20 + keys]  # [kv_heads, keys, head]
    assert cpu_kernels.load("segment_attention")
    out, lse = torch.ops.iris_vision.history_attention(q, k, v, head**-0.5)
    group = heads // kv_heads
    k_full, v_full = (t.float().repeat_interleave(group, 0) for t in (k, v))  # per query head
    scores = torch.einsum("nhd,hkd->hnk", q.float(), k_full) * head**-0.5
    exact = torch.einsum("hnk,hkd->nhd", scores.softmax(-1), v_full)
    torch_bf16 = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    ).transpose(0, 1)
    bar = (torch_bf16.float() - exact).abs().max().item()
    assert (out.float() - exact).abs().max().item() <= max(2 * bar, 1e-2)
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        torch.ops.iris_vision.history_attention(q[:, :1].expand(rows, 5, head), k, v, 0.1)
