"""Our Triton GEMMs for quantized weights (`scheduler/models/triton_quant.py`), run here
under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no
GPU): each equals the dequantized weights' product within the dtype's rounding, on
ragged shapes (rows below and above a tile, outputs and inputs not whole tiles or blocks)
and on tensor-parallel shards (a row-parallel slice starting inside an FP8 block, a
4-bit rank's groups from the middle of the checkpoint's)."""

from __future__ import annotations

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


def gptq_layer(layer: LinearLayer, dtype: torch.dtype, seed: int) -> torch.Tensor:
    weight = torch.randn(layer.out_features, _inputs(layer), generator=_seeded(seed))
    g_idx = gptq.row_groups(weight.shape[1], GROUP, False, seed=seed)
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


@pytest.mark.parametrize("fmt", [awq_layer, gptq_layer, w4a16_layer], ids=["awq", "gptq", "w4a16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_4_bit_format_runs_through_the_triton_gemm_on_cuda(fmt, dtype, monkeypatch):
    """Once loaded on CUDA (forced here: the interpreter runs on the CPU) a 4-bit layer of
    every format is handed to the Triton GEMM, and a decode's row and a prefill's 40
    equal the writer's weights' product: 72 outputs by 96 inputs (partial tiles), and a
    row-parallel rank 1 of 2 (its groups from the middle of the checkpoint's)."""
    monkeypatch.setattr(int4_kernel, "runs_triton", lambda device: True)
    for layer in (LinearLayer(96, 72, bias=False),
                  RowParallelLinear(128, 40, bias=False, tp=TPShard(rank=1, size=2))):  # fmt: skip
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
