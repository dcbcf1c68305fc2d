"""Our C++ CPU kernels (`scheduler/cpu_kernels`) build on a machine like CI's, compute what
their PyTorch paths compute, and where one cannot be built the PyTorch path runs with a
line saying why. The block-FP8 kernel against the layer's own dequantized weights: every
e4m3 code, ragged shapes (rows, outputs and inputs not whole vectors, tiles or blocks), a
row-parallel slice starting inside a block, float32 and bfloat16. The paged decode
attention against torch's SDPA per sequence: long contexts split across parts, a run per
page, grouped query heads, decodes beside a prefill chunk. Gated DeltaNet's decode step against
its batched products, in place on the state slots. The RMS norms and the rotary embedding
in one pass each."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

from iris_serve.scheduler import cpu_kernels
from iris_serve.scheduler.attention import SequenceChunk, cpu_decode
from iris_serve.scheduler.attention.sdpa import SdpaBackend
from iris_serve.scheduler.auto_dtype import native_bf16_cpu
from iris_serve.scheduler.cpu_kernels import build
from iris_serve.scheduler.kv.kv_cache import KVCache, KVLayout
from iris_serve.scheduler.models import block_fp8, layers
from iris_serve.scheduler.models.block_fp8 import BlockFp8Linear
from iris_serve.scheduler.models.cpu_linear import BF16_KERNEL_ROWS, dense_product
from iris_serve.scheduler.models.gated_deltanet import (
    causal_conv_step,
    l2_normalized,
    recurrent_delta_step,
)
from iris_serve.scheduler.models.layers import (
    RMSNorm,
    ZeroCenteredRMSNorm,
    apply_rotary,
    fused_rms_norm,
    rms_normalized,
)
from iris_serve.scheduler.models.linear_method import LinearLayer, use_method
from iris_serve.scheduler.models.tensor_parallel import RowParallelLinear, TPShard
from iris_serve.tiny_checkpoint.fp8 import dequantize, quantize
from tests.reference import cpu_engine

torch.set_num_threads(2)


def fp8_layer(
    layer: LinearLayer, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype
) -> LinearLayer:
    use_method(layer.to(dtype), BlockFp8Linear(dtype=dtype))  # the bias in the model's dtype
    layer.load_weight("weight", q, None)
    layer.load_weight("weight_scale_inv", s, None)
    if layer.bias is not None:
        layer.load_weight("bias", torch.randn(layer.out_features).to(dtype), None)
    layer.method.process_after_loading(layer)
    return layer


def fused_calls(monkeypatch) -> list[int]:
    """The row counts of each call that went through the kernel."""
    calls: list[int] = []
    fused = BlockFp8Linear._fused

    def counted(self, layer, x, bias):
        calls.append(x.numel() // layer.in_features)
        return fused(self, layer, x, bias)

    monkeypatch.setattr(BlockFp8Linear, "_fused", counted)
    return calls


def test_the_kernels_build_on_this_machine():
    """CI's machine has a C++ compiler and AVX-512: the fast path is the one tested."""
    for kernel in (
        "fp8_linear",
        "paged_attention",
        "gated_delta",
        "rms_norm",
        "rotary",
        "bf16_linear",
        "segment_attention",
        "pair_linear",
    ):
        assert cpu_kernels.load(kernel), f"{kernel}: see the log line of iris.cpu_kernels"


def test_every_e4m3_code_comes_out_exact():
    """All 254 finite codes, each block's scale its own: one-hot rows pick single weights,
    so each output is a code's value times its scale, with nothing to round."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    q = finite.repeat(2 * 256 // finite.numel() + 1)[: 2 * 256].view(256, 2).t().contiguous()
    s = torch.tensor([[0.75, 3e-3]], dtype=torch.bfloat16)
    layer = fp8_layer(LinearLayer(256, 2, bias=False), q, s, torch.float32)
    expected = (q.float() * s.float().repeat_interleave(128, dim=1)).t()
    for first in range(0, 256, 16):  # 16 one-hot rows a call: the kernel's largest
        assert torch.equal(layer(torch.eye(256)[first : first + 16]), expected[first : first + 16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("inputs", "rank"), [(300, None), (300, 1), (256, None), (256, 1)])
def test_a_few_rows_go_through_the_kernel_and_equal_the_dequantized_product(
    dtype, inputs, rank, monkeypatch
):
    """203 outputs (not whole groups of 4 rows), 1 to 16 rows through the kernel, 17
    through the buffer. 300 inputs: a partial last block and vector, and rank 1 of 2 of a
    row-parallel layer reads columns 150..299, starting 22 into block 1. 256 inputs: whole
    blocks, so bfloat16 takes the AVX512-BF16 pair products where the CPU has them (rank
    1's columns 128..255 too)."""
    generator = torch.Generator().manual_seed(0)
    q, s = quantize(torch.randn(203, inputs, generator=generator), torch.bfloat16)
    weight = dequantize(q, s)
    if rank is None:
        layer = fp8_layer(LinearLayer(inputs, 203, bias=True), q, s, dtype)
    else:
        tp = TPShard(rank=rank, size=2)
        layer = fp8_layer(RowParallelLinear(inputs, 203, bias=False, tp=tp), q, s, dtype)
        weight = weight[:, inputs // 2 :]
    calls = fused_calls(monkeypatch)
    for rows in (1, 3, 5, 16, 17):
        x = torch.randn(rows, layer.in_features, generator=generator).to(dtype)
        bias = None if layer.bias is None else layer.bias.float()
        expected = F.linear(x.float(), weight, bias)
        scale = expected.abs().max()
        tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
        got = layer.method.apply(layer, x, layer.bias)  # rank 1's share, before the all-reduce
        assert got.dtype == dtype
        torch.testing.assert_close(got.float() / scale, expected / scale, rtol=0, atol=tolerance)
    assert calls == [1, 3, 5, 16]


def test_a_bf16_dense_product_of_a_few_rows_goes_through_the_kernel(monkeypatch):
    """The LM head's product in a decode step: 1 to 16 rows, with and without a bias, 203
    outputs (not whole units of rows), through the kernel and equal to the float32 product
    of the same bf16 values up to the output's one rounding; 17 rows, and a weight seen
    transposed (a quantized layer's dequantized view), through F.linear."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(203, 96, generator=generator).to(torch.bfloat16)
    bias = torch.randn(203, generator=generator).to(torch.bfloat16)
    kernel = torch.ops.iris_bf16.bf16_linear
    calls: list[int] = []

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, w, b)

    monkeypatch.setattr(torch.ops.iris_bf16, "bf16_linear", counted)
    for rows, b in ((1, None), (3, bias), (5, None), (BF16_KERNEL_ROWS, bias), (17, None)):
        x = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
        expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
        got = dense_product(x, weight, b)
        assert got.dtype == torch.bfloat16
        # bf16's half unit in the last place, 2^-9 of the value, with room for the sums' order
        torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-4)
    assert calls == [1, 3, 5, BF16_KERNEL_ROWS]
    x = torch.randn(2, 1, 96, generator=generator).to(torch.bfloat16)  # [sequences, 1, H]
    assert dense_product(x, weight).shape == (2, 1, 203) and calls[-1] == 2
    transposed = weight.t().contiguous().t()
    torch.testing.assert_close(dense_product(x, transposed), F.linear(x, weight))
    assert len(calls) == 5


def test_a_prompt_of_rows_keeps_its_shape_through_the_kernel():
    """Inputs of [batch, tokens, features] come back as [batch, tokens, outputs]."""
    q, s = quantize(torch.randn(64, 128), torch.bfloat16)
    layer = fp8_layer(LinearLayer(128, 64, bias=False), q, s, torch.float32)
    x = torch.randn(2, 3, 128)
    torch.testing.assert_close(layer(x), x @ dequantize(q, s).t(), rtol=1e-5, atol=1e-5)


def test_with_the_kernels_off_the_buffer_path_runs(monkeypatch, caplog):
    monkeypatch.setenv("IRIS_CPU_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="iris.cpu_kernels"):
        assert not build.build_and_load("fp8_linear")
    assert "IRIS_CPU_KERNELS=0" in caplog.text


def test_threads_asking_for_a_kernel_at_once_build_it_once(monkeypatch):
    """The encoder's thread and the step's both reach a kernel on their first use."""
    builds: list[str] = []
    started, release = threading.Event(), threading.Event()

    def slow_build(name: str) -> bool:
        builds.append(name)
        started.set()
        assert release.wait(30), "the test never released the build"
        return True

    monkeypatch.setattr(build, "build_and_load", slow_build)
    monkeypatch.setattr(build, "_loaded", {})
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(build.load("k"))) for _ in "ab"]
    for thread in threads:
        thread.start()
    assert started.wait(30), "no thread started the build"
    release.set()
    for thread in threads:
        thread.join(30)
    assert builds == ["k"] and results == [True, True]


@pytest.mark.parametrize(
    ("arch", "dtype", "kernels"),
    [("qwen2_5_vl", "float32", ["paged_attention", "rotary"]),
     ("qwen3_5", "bfloat16",
      ["bf16_linear", "gated_delta", "paged_attention", "rms_norm", "rotary",
       "segment_attention"])],
)  # fmt: skip
def test_a_cpu_engine_loads_its_models_kernels_before_any_request(
    arch, dtype, kernels, request, monkeypatch
):
    """A build takes seconds (once per machine): at start-up, not in a request's TTFT;
    only the kernels that run in the model's dtype (the norm's, the LM head's and the
    towers' attention run in bf16 only; the linear layers' where `--cpu-linear auto` takes
    them, bf16 on AVX512-BF16 without AMX)."""
    built: list[str] = []
    monkeypatch.setattr(build, "build_and_load", lambda name: built.append(name) or True)
    monkeypatch.setattr(build, "_loaded", {})
    cpu_engine(request.getfixturevalue(f"{arch}_tiny"), dtype=dtype)
    if dtype == "bfloat16" and native_bf16_cpu() == "AVX512-BF16":
        kernels = sorted([*kernels, "pair_linear"])
    assert sorted(built) == kernels


def test_the_kernel_cache_is_the_machines_unless_told(tmp_path, monkeypatch):
    monkeypatch.delenv("IRIS_KERNEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("IRIS_CACHE_DIR", str(tmp_path / "cache"))
    assert build.cache_dir() == tmp_path / "cache" / "kernels"
    monkeypatch.setenv("IRIS_KERNEL_CACHE_DIR", str(tmp_path / "kernels"))
    assert build.cache_dir() == tmp_path / "kernels"  # a private checkpoint cache, shared builds


def test_a_kernel_that_does_not_build_says_why_and_is_not_used(tmp_path, monkeypatch, caplog):
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCES", tmp_path)
    monkeypatch.delenv("IRIS_KERNEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("IRIS_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="iris.cpu_kernels"):
        assert not build.build_and_load("broken")
    assert "broken did not build" in caplog.text and "error" in caplog.text
    assert not list((tmp_path / "cache" / "kernels").iterdir())  # no half-written library


def test_an_fp8_layer_whose_kernel_did_not_load_computes_through_the_buffer(monkeypatch):
    monkeypatch.setattr(block_fp8.cpu_kernels, "load", lambda name: False)
    calls = fused_calls(monkeypatch)
    q, s = quantize(torch.randn(64, 128), torch.bfloat16)
    layer = fp8_layer(LinearLayer(128, 64, bias=False), q, s, torch.float32)
    x = torch.randn(1, 128)
    torch.testing.assert_close(layer(x), x @ dequantize(q, s).t())
    assert calls == []


@pytest.mark.parametrize(
    ("dtype", "heads"), [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 6)]
)
def test_a_steps_decodes_through_the_kernel_equal_sdpa_per_sequence(dtype, heads, monkeypatch):
    """Three decodes around a prefill chunk (their rows not consecutive), contexts of 5, 300
    and 700 tokens (one part, two, three: merged by log-sum-exps) over pages handed out in
    reverse (a run per page), 4 query heads on 2 KV heads (a group the kernel compiles as a
    constant) or 6 (one it takes at run time): the kernel's rows equal torch's SDPA run per
    sequence, and the chunk's rows are untouched by it."""
    kv_heads, dim, page = 2, 32, 16
    layout = KVLayout(1, kv_heads, dim, page, dtype)
    cache = KVCache(layout, num_pages=128, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    cache.slots.copy_(torch.randn(cache.slots.shape, generator=generator).to(dtype))
    contexts = [5, 300, 40, 700]  # the third is a prefill chunk of 8 after 32 cached
    chunks = []
    for i, context in enumerate(contexts):
        pages = cache.pool.allocate(-(-context // page))[::-1]
        new = 8 if i == 2 else 1
        chunks.append(SequenceChunk.of(pages, context - new, new))
    rows = sum(chunk.num_new for chunk in chunks)
    q, k, v = (torch.randn(rows, h, dim, generator=generator).to(dtype) for h in (heads, 2, 2))
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    step = SdpaBackend(cache, torch.device("cpu")).prepare(chunks)
    assert step.decodes is not None
    got = step.attend(0, q, k, v)
    monkeypatch.setattr(cpu_decode.BatchedDecodes, "of", classmethod(lambda *_: None))
    expected = SdpaBackend(cache, torch.device("cpu")).prepare(chunks).attend(0, q, k, v)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(got[2:10], expected[2:10])  # the prefill chunk: the same path


@pytest.mark.parametrize(("head_dim", "group"), [(64, 1), (128, 4), (256, 2), (128, 8), (64, 3)])
def test_bf16_decode_attention_equals_exact_attention_over_scattered_pages(head_dim, group):
    """A bf16 cache on a CPU with AVX512-BF16 takes the kernel's pair-product path (one
    vector of pairs per 32 dims, value passes of 1 to 8 vectors by group; a group of 3
    the generic path): over pages handed out at random, with partial pages and one to
    three parts, the output equals float32 attention over the same bf16 values up to
    the output's rounding."""
    assert cpu_kernels.load("paged_attention")
    generator = torch.Generator().manual_seed(0)
    kv_heads, slots, page = 2, 2048, 16
    keys, values = (
        torch.randn(kv_heads, slots, head_dim, generator=generator).to(torch.bfloat16)
        for _ in range(2)
    )
    for context in (1, 17, 300, 700):
        pages = torch.randperm(slots // page, generator=generator)[: -(-context // page)]
        lengths = [min(page, context - i * page) for i in range(len(pages))]
        spans = torch.tensor([[int(p) * page, n] for p, n in zip(pages, lengths, strict=True)])
        q = torch.randn(1, kv_heads * group, head_dim, generator=generator).to(torch.bfloat16)
        scale = head_dim**-0.5
        got = torch.ops.iris_attention.paged_decode_attention(
            q, keys, values, spans, torch.tensor([0, len(spans)]), scale
        )
        used = torch.cat([torch.arange(first, first + n) for first, n in spans.tolist()])
        k = keys[:, used].float().repeat_interleave(group, 0)
        v = values[:, used].float().repeat_interleave(group, 0)
        weights = torch.softmax(q[0].float()[:, None] @ k.transpose(1, 2) * scale, dim=-1)
        expected = (weights @ v)[:, 0]
        torch.testing.assert_close(got[0].float(), expected, rtol=0, atol=1e-2)


def test_decodes_the_kernel_cannot_run_or_speed_up_go_through_sdpa():
    """A head size that is not whole vectors, and a single float32 decode (SDPA streams it
    as fast): no batch, the per-sequence path; one bfloat16 decode, or two in float32,
    are batched."""

    def batched(head_dim: int, dtype: torch.dtype, decodes: int) -> bool:
        cache = KVCache(KVLayout(1, 2, head_dim, 16, dtype), 8, torch.device("cpu"))
        chunks = [SequenceChunk.of(cache.pool.allocate(1), 3, 1) for _ in range(decodes)]
        return SdpaBackend(cache, torch.device("cpu")).prepare(chunks).decodes is not None

    assert not batched(24, torch.float32, 2)
    assert not batched(32, torch.float32, 1)
    assert batched(32, torch.bfloat16, 1) and batched(32, torch.float32, 2)


def test_a_gated_deltanet_decode_step_advances_its_slots_in_place():
    """Two sequences in slots 3 and 1 of 5, 4 value heads, Dk 32 and Dv 48: outputs and
    new states equal the batched products' (`recurrent_delta_step`), and the other slots'
    states are untouched."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, dk, dv = 2, 4, 32, 48
    states = torch.randn(5, heads, dk, dv, generator=generator)
    q, k = (F.normalize(torch.randn(batch, heads, dk, generator=generator), dim=-1) for _ in "qk")
    v = torch.randn(batch, heads, dv, generator=generator)
    g = -torch.rand(batch, heads, generator=generator)
    beta = torch.rand(batch, heads, generator=generator)
    slots = torch.tensor([3, 1])
    expected_out, expected_states = recurrent_delta_step(q, k, v, g, beta, states[slots])
    before = states.clone()
    assert cpu_kernels.load("gated_delta")
    out = torch.ops.iris_gdn.gated_delta_decode(q, k, v, g, beta, states, slots)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[slots], expected_states, rtol=1e-5, atol=1e-5)
    for other in (0, 2, 4):
        assert torch.equal(states[other], before[other])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_gated_deltanet_decode_step_is_the_ops_it_replaces(dtype):
    """Three sequences in slots 4, 0 and 2 of 6, 2 key heads serving 4 value heads, the
    projections' views of one row (a, b after the conv's columns): from the projections to
    the output, what `forward`'s g and β, `causal_conv_step`, `_heads` and the decode kernel
    give, both states advanced in place and the other slots untouched. bf16: the conv's sum
    rounded once (as transformers' conv1d), not each product, so to bf16's rounding."""
    generator = torch.Generator().manual_seed(0)
    batch, key_heads, value_heads, dk, dv, width = 3, 2, 4, 32, 48, 4
    channels = 2 * key_heads * dk + value_heads * dv
    projections = torch.randn(batch, channels + 2 * value_heads, generator=generator).to(dtype)
    columns, b, a = projections.split((channels, value_heads, value_heads), dim=-1)
    conv = torch.randn(6, channels, width - 1, generator=generator).to(dtype)
    weight = (0.5 * torch.randn(channels, 1, width, generator=generator)).to(dtype)
    a_log, dt_bias = (0.3 * torch.randn(2, value_heads, generator=generator)).to(dtype)
    recurrent = 0.1 * torch.randn(6, value_heads, dk, dv, generator=generator)
    slots = torch.tensor([4, 0, 2])
    expected_conv, expected_recurrent = conv.clone(), recurrent.clone()
    beta = b.sigmoid().float()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    mixed, window = causal_conv_step(columns, expected_conv[slots], weight)
    expected_conv.index_copy_(0, slots, window)
    q, k, v = mixed.float().split((key_heads * dk, key_heads * dk, value_heads * dv), dim=-1)
    q, k = (
        l2_normalized(x.view(batch, key_heads, 1, dk))
        .expand(batch, key_heads, value_heads // key_heads, dk)
        .reshape(batch, value_heads, dk)
        for x in (q, k)
    )
    inputs = (q * dk**-0.5, k, v.reshape(batch, value_heads, dv), g, beta)
    assert cpu_kernels.load("gated_delta")
    kernels = torch.ops.iris_gdn
    expected = kernels.gated_delta_decode(
        *(x.contiguous() for x in inputs), expected_recurrent, slots
    )
    before = recurrent.clone()
    out = kernels.gated_delta_decode_step(
        columns, a, b, conv, weight, a_log, dt_bias, recurrent, slots, key_heads, dk
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(recurrent, expected_recurrent, rtol=tolerance, atol=tolerance)
    assert torch.equal(conv, expected_conv)
    for other in (1, 3, 5):
        assert torch.equal(recurrent[other], before[other])


def test_the_rms_norms_in_one_pass_round_as_transformers_order_does():
    """Rows of 96 (not whole vectors' worth of 16 after 80), bfloat16: both norms against
    their PyTorch ops to one rounding step at most; float32 keeps PyTorch's ops."""
    dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 96, generator=generator) * 4).to(dtype)
    weight = (torch.randn(96, generator=generator) * 0.5 + 1).to(dtype)
    assert cpu_kernels.load("rms_norm")
    for zero_centered, module in ((False, RMSNorm(96)), (True, ZeroCenteredRMSNorm(96))):
        module = module.to(dtype).requires_grad_(False)
        module.weight.copy_(weight)
        assert fused_rms_norm(x, module.weight, 1e-6, zero_centered) is not None
        got = module(x)
        expected = (
            (rms_normalized(x, 1e-6) * (1.0 + weight.float())).to(dtype)
            if zero_centered
            else weight * rms_normalized(x, 1e-6).to(dtype)
        )
        assert got.dtype == dtype and got.shape == x.shape
        tolerance = 1.6e-2  # one step of bfloat16's 2^-7
        torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
        assert fused_rms_norm(x.transpose(0, 1), module.weight, 1e-6, zero_centered) is None
        assert fused_rms_norm(x.float(), module.weight.float(), 1e-6, zero_centered) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [32, 16])
def test_the_rotary_embedding_in_one_pass_rounds_as_pytorchs_ops(dtype, rotary):
    """A query slice of a fused projection's rows (heads contiguous, tokens strided), whole
    rotary and partial (Qwen3.5's: the last dims pass through): bit for bit PyTorch's
    ops, which round each product and the sum in x's dtype."""
    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(5, 3 * 4 * 32, generator=generator).to(dtype)
    x = fused[:, : 4 * 32].view(5, 4, 32)  # [tokens, heads, head_dim], token stride 384
    angles = torch.rand(5, rotary, generator=generator) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert cpu_kernels.load("rotary") and layers._rotary_kernel_runs(x, cos, sin)
    got = apply_rotary(x, cos, sin)
    reference = x.clone()  # contiguous: the same values through PyTorch's ops
    rotated = reference[..., :rotary]
    expected = rotated * cos[:, None] + layers.rotate_half(rotated) * sin[:, None]
    expected = torch.cat((expected, reference[..., rotary:]), dim=-1)
    assert torch.equal(got, expected)


def test_a_span_outside_the_cache_is_refused_not_read():
    """The kernel checks every span against the cache before reading a slot."""
    assert cpu_kernels.load("paged_attention")
    keys = values = torch.zeros(2, 64, 16)
    q = torch.zeros(1, 4, 16)
    kernel = torch.ops.iris_attention.paged_decode_attention
    bounds = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(q, keys, values, torch.tensor([[60, 8]]), bounds, 0.25)
    with pytest.raises(RuntimeError, match="rise within the spans"):
        kernel(q, keys, values, torch.tensor([[0, 8]]), torch.tensor([0, 2]), 0.25)
