"""Our Triton GEMMs for quantized weights (`scheduler/models/triton_quant.py`), run here
under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no
GPU): each equals the dequantized weights' product within the dtype's rounding, on
ragged shapes (rows below and above a tile, outputs and inputs not whole tiles or blocks)
and on tensor-parallel shards (a row-parallel slice starting inside an FP8 block, a
4-bit rank's groups from the middle of the checkpoint's)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from iris_serve.scheduler.models import int4_kernel, triton_quant
from iris_serve.scheduler.models.awq import AwqLinear
from iris_serve.scheduler.models.block_fp8 import BlockFp8Linear
from iris_serve.scheduler.models.compressed_tensors import PackedW4A16Linear
from iris_serve.scheduler.models.gptq import GptqLinear
from iris_serve.scheduler.models.linear_method import LinearLayer, use_method
from iris_serve.scheduler.models.tensor_parallel import RowParallelLinear, TPShard
from iris_serve.tiny_checkpoint import awq, gptq
from iris_serve.tiny_checkpoint import compressed_tensors as w4a16
from iris_serve.tiny_checkpoint.fp8 import dequantize, quantize

torch.set_num_threads(2)
GROUP = 32
# of the output's largest value. Half precision as fp16: the interpreter's bf16 dot is not
# bf16 (numpy has none); the kernels' arithmetic is the same for both.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def interpreted(kernels) -> None:
    """Triton's kernels are interpreted here (the `kernels` fixture checks it)."""


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.abs().max()
    torch.testing.assert_close(got.float() / scale, expected / scale, rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "rank"), [(1, None), (33, 1)])
def test_the_block_fp8_gemm_equals_the_dequantized_weights_product(dtype, rows, rank):
    """200 outputs (a partial 128-block and tile) by 300 inputs: the whole layer, and rank
    1 of 2 of a row-parallel one, whose columns 150..299 start 22 into their first block."""
    generator = torch.Generator().manual_seed(rows)
    q, s = quantize(torch.randn(200, 300, generator=generator), torch.bfloat16)
    weight = dequantize(q, s)
    if rank is None:
        layer = LinearLayer(300, 200, bias=False)
    else:
        layer = RowParallelLinear(300, 200, bias=False, tp=TPShard(rank=rank, size=2))
        weight = weight[:, 150:]
    use_method(layer, BlockFp8Linear())
    layer.load_weight("weight", q, None)
    layer.load_weight("weight_scale_inv", s, None)
    x = torch.randn(rows, layer.in_features, generator=generator)
    shift = 0 if rank is None else 150 % triton_quant.FP8_BLOCK
    got = triton_quant.block_fp8_linear(x.to(dtype), layer.weight, layer.weight_scale_inv, shift)
    assert got.dtype == dtype and got.shape == (rows, 200)
    assert_matches(got, F.linear(x, weight), dtype)


def awq_layer(layer: LinearLayer, dtype: torch.dtype, seed: int) -> torch.Tensor:
    weight = torch.randn(layer.out_features, _inputs(layer), generator=_seeded(seed))
    qweight, qzeros, scales = awq.quantize(weight.t(), GROUP)
    use_method(layer, AwqLinear(GROUP, dtype))
    for leaf, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        layer.load_weight(leaf, tensor, None)
    return awq.dequantize(qweight, qzeros, scales, GROUP).t()


def gptq_layer(
    layer: LinearLayer, dtype: torch.dtype, seed: int, desc_act: bool = False
) -> torch.Tensor:
    weight = torch.randn(layer.out_features, _inputs(layer), generator=_seeded(seed))
    g_idx = gptq.row_groups(weight.shape[1], GROUP, desc_act, seed=seed)
    qweight, qzeros, scales = gptq.quantize(weight.t(), g_idx, GROUP)
    use_method(layer, GptqLinear(GROUP, 1, dtype))
    for leaf, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales),
                         ("g_idx", g_idx)):  # fmt: skip
        layer.load_weight(leaf, tensor, None)
    return gptq.dequantize(qweight, qzeros, scales, g_idx, 1).t()


def w4a16_layer(layer: LinearLayer, dtype: torch.dtype, seed: int) -> torch.Tensor:
    weight = torch.randn(layer.out_features, _inputs(layer), generator=_seeded(seed))
    packed, scale = w4a16.quantize(weight, GROUP)
    use_method(layer, PackedW4A16Linear(GROUP, dtype))
    layer.load_weight("weight_packed", packed, None)
    layer.load_weight("weight_scale", scale, None)
    layer.load_weight("weight_shape", torch.tensor(weight.shape), None)
    return w4a16.dequantize(packed, scale)


def _inputs(layer: LinearLayer) -> int:
    return layer.in_features * (layer.tp.size if isinstance(layer, RowParallelLinear) else 1)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gptq_desc_act_layer(layer: LinearLayer, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return gptq_layer(layer, dtype, seed, desc_act=True)


@pytest.mark.parametrize(
    "fmt",
    [awq_layer, gptq_layer, gptq_desc_act_layer, w4a16_layer],
    ids=["awq", "gptq", "gptq desc_act", "w4a16"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_4_bit_format_runs_through_the_triton_gemm_on_cuda(fmt, dtype, monkeypatch):
    """Once loaded on CUDA (forced here: the interpreter runs on the CPU) a 4-bit layer of
    every format is handed to the Triton GEMM, and a decode's row and a prefill's 40
    equal the writer's weights' product: 72 outputs by 96 inputs (partial tiles), and a
    row-parallel rank 1 of 2 (its groups from the middle of the checkpoint's). GPTQ in
    activation order goes whole, its rows sorted by group (a row-parallel share of it
    holds scattered rows of every group and stays with its format)."""
    monkeypatch.setattr(int4_kernel, "runs_triton", lambda device: True)
    layers = [LinearLayer(96, 72, bias=False)]
    if fmt is not gptq_desc_act_layer:
        layers.append(RowParallelLinear(128, 40, bias=False, tp=TPShard(rank=1, size=2)))
    for layer in layers:
        weight = fmt(layer, dtype, seed=layer.in_features)
        weight = weight[:, -layer.in_features :]
        layer.method.process_after_loading(layer)
        assert isinstance(layer.method, int4_kernel.Int4TritonLinear), layer.method
        assert layer.int4_qweight.numel() * 4 == layer.in_features * layer.out_features // 2
        for rows in (1, 40):
            x = torch.randn(rows, layer.in_features, generator=_seeded(rows))
            got = layer.method.apply(layer, x.to(dtype), None)
            assert got.dtype == dtype
            assert_matches(got, F.linear(x, weight), dtype)


ROWS_PER_EXPERT = (5, 0, 28)  # a decode-sized group, an idle expert, one above a tile


def expert_rows(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """The reference: rows sorted by expert, each group times its expert's weight."""
    groups = x.split(list(ROWS_PER_EXPERT))
    return torch.cat([F.linear(rows, w) for rows, w in zip(groups, weights, strict=True)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [None, 1])
def test_the_grouped_block_fp8_gemm_multiplies_each_experts_rows_by_its_weights(dtype, rank):
    """Three experts' e4m3 weights, 200 outputs by 300 inputs each, with their grids
    expanded along the rows: the whole width, and rank 1 of 2 of the down projection (its
    columns 150..299, 22 into their first block); each expert's rows (one expert idle)
    get its own dequantized weights' product, in one launch."""
    generator = _seeded(7)
    held, codes, grids = [], [], []
    for _ in ROWS_PER_EXPERT:
        q, s = quantize(torch.randn(200, 300, generator=generator), torch.bfloat16)
        weight, grid = dequantize(q, s), s.float().repeat_interleave(128, 0)[:200]
        if rank is not None:
            q, weight, grid = q[:, 150:], weight[:, 150:], grid[:, 150 // 128 :]
        held.append(weight)
        codes.append(q)
        grids.append(grid)
    x = torch.randn(sum(ROWS_PER_EXPERT), held[0].shape[1], generator=generator)
    counts = torch.tensor(ROWS_PER_EXPERT)
    shift = 0 if rank is None else 150 % triton_quant.FP8_BLOCK
    got = triton_quant.grouped_block_fp8_linear(
        x.to(dtype), counts, torch.stack(codes).contiguous(), torch.stack(grids), shift
    )
    assert got.dtype == dtype and got.shape == (x.shape[0], 200)
    assert_matches(got, expert_rows(x, held), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_grouped_4_bit_gemm_multiplies_each_experts_rows_by_its_weights(dtype):
    """Three experts' 4-bit weights in the kernels' layout, 72 outputs (a partial tile)
    by 96 inputs in groups of 32: each expert's rows get `(q - z) · s` of its own."""
    generator = _seeded(8)
    held, words, scales, zeros = [], [], [], []
    for _ in ROWS_PER_EXPERT:
        values = torch.randint(0, 16, (72, 96), generator=generator)
        scale = torch.rand(96 // GROUP, 72, generator=generator) / 8 + 0.01
        zero = torch.randint(0, 16, (96 // GROUP, 72), generator=generator).float()
        per_input = (scale.repeat_interleave(GROUP, 0), zero.repeat_interleave(GROUP, 0))
        held.append(((values.t() - per_input[1]) * per_input[0]).t())
        words.append(triton_quant.pack_int4(values))
        scales.append(scale.to(dtype))
        zeros.append(zero.to(dtype))
    x = torch.randn(sum(ROWS_PER_EXPERT), 96, generator=generator)
    got = triton_quant.grouped_int4_linear(
        x.to(dtype), torch.tensor(ROWS_PER_EXPERT), torch.stack(words), torch.stack(scales),
        torch.stack(zeros), GROUP,
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == (x.shape[0], 72)
    assert_matches(got, expert_rows(x, held), dtype)


@pytest.mark.parametrize("rank", [None, 1])
def test_fp8_experts_as_loaded_run_through_the_grouped_gemm(rank):
    """Block-FP8 routed experts as the loader holds them (rank 1 of 2: its share of the
    width starts inside a block): on CUDA each projection of the sorted rows is one
    grouped launch (run here on the CPU), equal to each expert's dequantized product."""
    from iris_serve.scheduler.models import fp8_experts
    from iris_serve.scheduler.models.tensor_parallel import SINGLE
    from tests.test_quantized_experts import EXPERTS, loaded_experts, per_expert_checkpoint

    tp = SINGLE if rank is None else TPShard(rank=rank, size=2)
    experts = loaded_experts(tp, per_expert_checkpoint(seed=2)[0])
    counts = [3, 0, 17]  # one per expert, one idle
    for name in ("gate_up_proj", "down_proj"):
        held = [
            fp8_experts.dequantized(experts, name, e, torch.float32).clone() for e in range(EXPERTS)
        ]
        x = torch.randn(sum(counts), held[0].shape[1], generator=_seeded(3))
        expected = [F.linear(rows, w) for rows, w in zip(x.split(counts), held, strict=True)]
        got = fp8_experts.grouped_product(experts, name, x, torch.tensor(counts))
        assert_matches(got, torch.cat(expected), torch.float32)


@pytest.mark.parametrize(("fmt", "rank"), [("awq", 1), ("gptq", None)])
def test_4_bit_experts_on_cuda_are_stacked_for_the_grouped_gemm(fmt, rank, monkeypatch):
    """4-bit experts loaded on CUDA (forced here: the interpreter runs on the CPU) are
    stacked once loaded, every expert's rows of a projection one launch (the decode step
    stays capturable), and routed tokens get what the dense experts give them; rank 1 of
    2 holds its share of the width."""
    from iris_serve.scheduler.models.tensor_parallel import SINGLE
    from iris_serve.scheduler.step.graph_capture import why_decode_is_not_capturable
    from tests.test_quantized_experts import ROUTED, OneLayer, four_bit_experts

    monkeypatch.setattr(int4_kernel, "runs_triton", lambda device: True)
    tp = SINGLE if rank is None else TPShard(rank=rank, size=2)
    experts, dense = four_bit_experts(fmt, tp, torch.float32, width=128, hidden=64)
    experts.stack_for_grouped_kernel()
    assert experts.int4_group == GROUP and not experts.per_expert
    assert not list(experts.children())
    assert why_decode_is_not_capturable(OneLayer(experts)) is None  # type: ignore[arg-type]
    assert experts.quantization == fmt
    x, weights = torch.randn(7, 64, generator=_seeded(4)), torch.rand(7, 2)
    assert_matches(experts(x, ROUTED, weights), dense(x, ROUTED, weights), torch.float32)


def test_activations_quantize_per_row_and_weight_block():
    """Each row's inputs in one block of the weight (the first 106 wide where a slice starts
    22 into its block) share a scale that maps their largest magnitude to e4m3's 448, and
    dequantize to within e4m3's rounding (3 mantissa bits) of what they were."""
    x = torch.randn(5, 300, generator=_seeded(5)) * torch.arange(1, 6)[:, None]
    codes, scales = triton_quant.quantize_activations(x, k_shift=22)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (5, 3)
    starts = [0, 106, 234, 300]
    for block, (a, b) in enumerate(itertools.pairwise(starts)):
        group = x[:, a:b]
        torch.testing.assert_close(scales[:, block], group.abs().amax(dim=1) / 448)
        back = codes[:, a:b].float() * scales[:, block, None]
        assert (back - group).abs().max() <= group.abs().max() / 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "rank"), [(1, None), (33, 1)])
def test_the_fp8_activation_gemm_equals_the_dequantized_product(dtype, rows, rank):
    """e4m3 × e4m3 per block, 200 outputs by 300 inputs (partial blocks and tiles), the
    whole layer and a row-parallel rank 1 of 2 starting 22 into its first block: equal to
    the dequantized activations times the dequantized weights."""
    generator = _seeded(rows)
    q, s = quantize(torch.randn(200, 300, generator=generator), torch.bfloat16)
    weight, grid = dequantize(q, s), s.float().repeat_interleave(128, 0)[:200]
    shift = 0
    if rank is not None:
        q, weight, grid, shift = q[:, 150:], weight[:, 150:], grid[:, 1:], 150 % 128
    x = torch.randn(rows, weight.shape[1], generator=generator).to(dtype)
    got = triton_quant.block_fp8_linear_fp8_activations(x, q.contiguous(), grid, shift)
    codes, scales = triton_quant.quantize_activations(x, shift)
    blocks = torch.arange(x.shape[1]) + shift
    activations = codes.float() * scales[:, blocks // 128]
    assert got.dtype == dtype and got.shape == (rows, 200)
    assert_matches(got, F.linear(activations, weight), dtype)
