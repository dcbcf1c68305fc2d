"""Quantized checkpoints, block FP8 (Qwen's `-FP8` layout), AWQ (`-AWQ`), GPTQ and
compressed-tensors W4A16: the loader reads the writers' tensors in every slice a layer can
hold, and a checkpoint answers exactly as transformers does on its dequantized twin, with
its weights held at a fraction of float32's bytes (FP8 ~1/4, the 4-bit ones ~1/6)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.load import methods_used
from iris_serve.scheduler.models import int4_cpu
from iris_serve.scheduler.models.awq import AwqLinear
from iris_serve.scheduler.models.block_fp8 import BlockFp8Linear
from iris_serve.scheduler.models.compressed_tensors import PackedW4A16Linear
from iris_serve.scheduler.models.gptq import GptqLinear
from iris_serve.scheduler.models.linear_method import (
    DENSE,
    LinearLayer,
    LinearMethod,
    linear_layers,
    linear_weight_bytes,
    use_method,
)
from iris_serve.scheduler.models.quantization import checkpoint_format
from iris_serve.scheduler.models.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPShard,
)
from iris_serve.tiny_checkpoint import STAMP_FILE, awq, gptq, main_tiny_model
from iris_serve.tiny_checkpoint import compressed_tensors as w4a16
from iris_serve.tiny_checkpoint.fp8 import dequantize, quantize, write_fp8, write_fp8_twin
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import (
    chat_prompt,
    cpu_engine,
    hf_generate,
    hf_generate_with_margins,
    make_image,
)

torch.set_num_threads(2)
MAX_NEW = 12
GROUP = awq.GROUP_SIZE


def stored(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, bf16 scale grid, the float32 weight they hold) of a random layer."""
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    quantized, scale = quantize(weight * (1 + seed), torch.bfloat16)
    return quantized, scale, dequantize(quantized, scale)


def fp8_layer(layer: LinearLayer) -> LinearLayer:
    use_method(layer, BlockFp8Linear())
    return layer


def held(layer: LinearLayer) -> torch.Tensor:
    method = layer.method
    assert isinstance(method, BlockFp8Linear)
    method.process_after_loading(layer)
    return method.dequantized(layer, torch.float32).clone()


def test_a_whole_layer_holds_the_writers_weights_and_computes_with_them():
    """300 x 200: partial blocks in both directions; bias in the model's dtype."""
    q, s, w = stored(300, 200, seed=0)
    layer = fp8_layer(LinearLayer(200, 300, bias=True))
    bias = torch.randn(300)
    for leaf, tensor in (("weight_scale_inv", s), ("weight", q), ("bias", bias)):
        layer.load_weight(leaf, tensor, None)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(held(layer), w)
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(1))
    # 5 rows go through the C++ kernel on a CPU, whose sums run in another order than
    # F.linear's: float32 rounding apart, over 200 products
    reference = torch.nn.functional.linear(x, w, bias)
    torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_e4m3_code_dequantizes_as_torch_converts_it(dtype):
    """All 254 finite codes (subnormals, both zeros, the largest) in 128x128 blocks, each
    block's scale its own: the bit moves (bf16, fp32) and the table (others) give torch's
    own value times the scale, rounded once in the model's dtype."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    weight = finite.repeat(128 * 256 // finite.numel() + 1)[: 128 * 256].view(128, 256)
    scale = torch.tensor([[0.75, 3e-3]], dtype=torch.bfloat16)
    layer = fp8_layer(LinearLayer(256, 128, bias=False))
    layer.load_weight("weight", weight, None)
    layer.load_weight("weight_scale_inv", scale, None)
    layer.method.process_after_loading(layer)
    expected = weight.float() * scale.float().repeat_interleave(128, dim=1)
    assert torch.equal(layer.method.dequantized(layer, dtype), expected.to(dtype))


def test_a_fused_layers_parts_keep_their_own_grids_in_a_column_slice():
    """q, k, v of 192, 130 and 130 rows, rank 1 of 2: each part's rows from its own
    checkpoint tensor and grid, at offsets that are not multiples of 128."""
    parts = [stored(rows, 96, seed=i) for i, rows in enumerate((192, 130, 130))]
    pieces = [(96, 96), (65, 65), (65, 65)]  # rank 1's rows of each part
    layer = fp8_layer(ColumnParallelLinear(96, pieces, bias=False))
    for shard, (q, s, _) in enumerate(parts):
        layer.load_weight("weight", q, shard)
        layer.load_weight("weight_scale_inv", s, shard)
    expected = torch.cat(
        [w[start : start + n] for (_, _, w), (start, n) in zip(parts, pieces, strict=True)]
    )
    assert torch.equal(held(layer), expected)


def test_a_row_parallel_slice_reads_the_blocks_its_columns_fall_in():
    """Columns 150..299 of 300 on rank 1 of 2: they start inside block 1."""
    q, s, w = stored(64, 300, seed=3)
    layer = fp8_layer(RowParallelLinear(300, 64, bias=False, tp=TPShard(rank=1, size=2)))
    layer.load_weight("weight", q, None)
    layer.load_weight("weight_scale_inv", s, None)
    assert layer.weight_scale_inv.shape == (64, 2)  # blocks 1 and 2 only
    assert torch.equal(held(layer), w[:, 150:])


Stored = tuple[dict[str, torch.Tensor], torch.Tensor]  # a layer's tensors; the W they hold


def awq_stored(rows: int, cols: int, seed: int) -> Stored:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    qweight, qzeros, scales = awq.quantize(weight.t(), GROUP)
    stored = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    return stored, awq.dequantize(qweight, qzeros, scales, GROUP).t()


def gptq_stored(rows: int, cols: int, seed: int, desc_act: bool) -> Stored:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    g_idx = gptq.row_groups(cols, GROUP, desc_act, seed=7)
    qweight, qzeros, scales = gptq.quantize(weight.t(), g_idx, GROUP)
    stored = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    return stored, gptq.dequantize(qweight, qzeros, scales, g_idx, 1).t()


def test_symmetric_gptq_keeps_every_zero_at_8_and_rounds_to_the_nearest_step():
    """`iris tiny-model --quant gptq --sym`: what Qwen's GPTQ-Int4 releases hold."""
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    g_idx = gptq.row_groups(96, GROUP, False, seed=7)
    qweight, qzeros, scales = gptq.quantize(weight.t(), g_idx, GROUP, symmetric=True)
    restored = gptq.dequantize(qweight, qzeros, scales, g_idx, 1).t()
    zeros = gptq.dequantize(torch.zeros_like(qweight), qzeros, torch.ones_like(scales), g_idx, 1)
    assert torch.equal(zeros, torch.full_like(zeros, -8.0))  # every zero point 8
    step = scales.float()[g_idx.long()].t()  # [N, K], 2 max|w| / 15 per group and column
    assert torch.all((restored - weight).abs() <= step * 0.51)  # half a step, fp16 scales


def w4a16_stored(rows: int, cols: int, seed: int) -> Stored:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    packed, scale = w4a16.quantize(weight, GROUP)
    shape = torch.tensor([rows, cols], dtype=torch.int32)
    stored = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
    return stored, w4a16.dequantize(packed, scale)


FP32 = torch.float32
PACKED = {  # a 4-bit format: its method in a dtype, and a layer's tensors as its writer stores
    "awq": (lambda dtype=FP32: AwqLinear(GROUP, dtype), awq_stored),
    "gptq": (
        lambda dtype=FP32: GptqLinear(GROUP, 1, dtype),
        lambda r, c, s: gptq_stored(r, c, s, False),
    ),
    "gptq desc_act": (
        lambda dtype=FP32: GptqLinear(GROUP, 1, dtype),
        lambda r, c, s: gptq_stored(r, c, s, True),
    ),
    "w4a16": (lambda dtype=FP32: PackedW4A16Linear(GROUP, dtype), w4a16_stored),
}


def packed_held(layer: LinearLayer) -> torch.Tensor:
    """The weight `[N, K]` a 4-bit layer dequantizes to, once its loading is processed."""
    method = layer.method
    method.process_after_loading(layer)
    if isinstance(method, PackedW4A16Linear):
        return method.dequantized(layer, torch.float32).clone()
    assert isinstance(method, AwqLinear | GptqLinear)
    return method.dequantized_t(layer, torch.float32).t().clone()


def loaded(layer: LinearLayer, method: LinearMethod, parts: list[Stored]) -> LinearLayer:
    use_method(layer, method)
    for shard, (tensors, _) in enumerate(parts):
        for leaf, tensor in tensors.items():
            layer.load_weight(leaf, tensor, shard if len(parts) > 1 else None)
    return layer


@pytest.mark.parametrize("fmt", PACKED)
def test_4_bit_layers_and_slices_hold_the_writers_weights(fmt):
    """A whole layer (with a bias, computing), a fused q/k/v on rank 1 of 2 (each part's
    columns from its own tensors, in words of 8) and a row-parallel rank 1 of 2 (its
    inputs in words and groups); GPTQ in input order (a broadcast per group) and in an
    order of its own (`desc_act`, a gather)."""
    method, make = PACKED[fmt]
    (tensors, w) = make(40, 96, 1)
    layer = loaded(LinearLayer(96, 40, bias=True), method(), [(tensors, w)])
    bias = torch.randn(40)
    layer.load_weight("bias", bias, None)
    assert torch.equal(packed_held(layer), w)
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, bias))

    parts = [make(rows, 64, i) for i, rows in enumerate((64, 32, 32))]
    pieces = [(32, 32), (16, 16), (16, 16)]
    fused = loaded(ColumnParallelLinear(64, pieces, bias=False), method(), parts)
    expected = torch.cat([w[a : a + n] for (_, w), (a, n) in zip(parts, pieces, strict=True)])
    assert torch.equal(packed_held(fused), expected)

    (tensors, w) = make(24, 128, 4)
    row = RowParallelLinear(128, 24, bias=False, tp=TPShard(rank=1, size=2))
    assert torch.equal(packed_held(loaded(row, method(), [(tensors, w)])), w[:, 64:])


def test_this_torch_packs_4_bit_weights_as_iris_reads_them_back():
    """Iris dequantizes a prefill's weights from PyTorch's CPU int4 packing; a torch that
    packs otherwise would leave every bfloat16 4-bit layer on the slow path unseen."""
    assert int4_cpu.packing_is_known()


@pytest.mark.parametrize("fmt", PACKED)
def test_in_bfloat16_a_4_bit_layer_runs_through_torchs_int4_kernel(fmt):
    """A whole layer with a bias and a row-parallel rank 1 of 2 (its groups from the
    middle of the checkpoint's): handed to `int4_cpu` holding half a byte per weight, a
    decode's rows through the fused kernel and a prefill's through the dequantized weight
    both equal the writer's weights' product within bfloat16's rounding. GPTQ in an order
    of its own goes too, its rows sorted by group and each input gathered to match; a
    row-parallel share of it (scattered rows of every group) stays with its format."""
    method, make = PACKED[fmt]
    bf16 = torch.bfloat16
    for layer, w in (
        (LinearLayer(96, 128, bias=True), make(128, 96, 1)),
        (RowParallelLinear(128, 64, bias=False, tp=TPShard(rank=1, size=2)), make(64, 128, 2)),
    ):
        (tensors, weight) = w
        loaded(layer, method(bf16), [(tensors, weight)])
        weight = weight[:, -layer.in_features :]
        bias = None
        if layer.has_bias:
            bias = torch.randn(layer.out_features)
            layer.load_weight("bias", bias.to(bf16), None)
            layer.bias = torch.nn.Parameter(layer.bias.to(bf16), False)
        layer.method.process_after_loading(layer)
        if fmt == "gptq desc_act" and isinstance(layer, RowParallelLinear):
            assert layer.method.name == "gptq"
            continue
        assert isinstance(layer.method, int4_cpu.Int4PackedCpuLinear), layer.method
        assert layer.int4_weight.numel() == layer.in_features * layer.out_features // 2
        for rows in (3, int4_cpu.FUSED_ROWS + 9):
            x = torch.randn(rows, layer.in_features)
            expected = torch.nn.functional.linear(x, weight, bias)
            got = layer.method.apply(layer, x.to(bf16), layer.bias).float()  # this rank's part
            scale = expected.abs().max()
            torch.testing.assert_close(got / scale, expected / scale, rtol=0, atol=2e-2)


def test_an_awq_slice_cutting_a_word_is_refused():
    cut = ColumnParallelLinear(64, [(4, 8)], bias=False)
    use_method(cut, AwqLinear(GROUP))
    with pytest.raises(ValueError, match="units of 8"):
        cut.load_weight("qweight", awq_stored(64, 64, 0)[0]["qweight"], None)


def test_fused_gptq_parts_ordering_their_rows_apart_are_refused():
    """q, k and v share their input, so a real checkpoint's g_idx agree; one that does not
    cannot be held as one layer, and is refused rather than dequantized wrong."""
    fused = ColumnParallelLinear(64, [(0, 32), (0, 32)], bias=False)
    use_method(fused, GptqLinear(GROUP, zero_offset=1))
    for shard in range(2):
        stored, _ = gptq_stored(32, 64, seed=shard, desc_act=True)
        stored["g_idx"] = gptq.row_groups(64, GROUP, True, seed=shard)
        for leaf, tensor in stored.items():
            fused.load_weight(leaf, tensor, shard)
    with pytest.raises(ValueError, match="order their input rows differently"):
        fused.method.process_after_loading(fused)


def test_a_w4a16_weight_shape_naming_other_inputs_is_refused():
    row = RowParallelLinear(128, 24, bias=False, tp=TPShard(rank=1, size=2))
    use_method(row, PackedW4A16Linear(GROUP))
    with pytest.raises(ValueError, match="weight_shape"):
        row.load_weight("weight_shape", torch.tensor([24, 64]), None)


def write_gptq_in_activation_order(src: Path, out: Path) -> Path:
    return gptq.write_gptq(src, out, desc_act=True)


FORMATS = {  # --quant: (writer, its twin's writer, the format's name, what a layer holds)
    "fp8": (write_fp8, write_fp8_twin, "block-fp8", "weight"),
    "awq": (awq.write_awq, awq.write_awq_twin, "awq", "qweight"),
    "gptq": (write_gptq_in_activation_order, gptq.write_gptq_twin, "gptq", "qweight"),
    "w4a16": (w4a16.write_w4a16, w4a16.write_w4a16_twin, "w4a16", "weight_packed"),
}


@pytest.mark.parametrize(
    ("quant", "arch"),
    [
        ("fp8", "qwen2_5_vl"),
        ("fp8", "qwen3_5"),
        ("awq", "qwen2_5_vl"),
        ("gptq", "qwen3_5"),
        ("w4a16", "qwen2_5_vl"),
    ],
)
def test_a_quantized_checkpoint_answers_as_transformers_on_its_dequantized_twin(
    quant, arch, request, tmp_path
):
    """Qwen2.5-VL (biased q/k/v, untied head) and Qwen3.5 (Gated DeltaNet projections
    beside full attention): greedy tokens with an image equal transformers' on the same
    weights dequantized; the decoder's projections are held quantized (the vision tower,
    the head and Gated DeltaNet's in_proj_a/b stay dense); the answer is not the full-
    precision checkpoint's, so the quantized weights were the ones used."""
    write, write_twin, name, held_tensor = FORMATS[quant]
    source = request.getfixturevalue(f"{arch}_tiny")
    checkpoint = write(source, tmp_path / quant)
    twin = write_twin(checkpoint, tmp_path / "twin")
    assert checkpoint_format(checkpoint) is not None and checkpoint_format(twin) is None
    prompt = chat_prompt(PromptBuilder(checkpoint), "Describe it.", [make_image(64, 48, seed=3)])
    greedy = Sampling(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    engine = cpu_engine(checkpoint)
    [ours] = engine.generate([prompt], greedy)
    assert ours == list(hf_generate(twin, prompt, MAX_NEW))
    assert ours != cpu_engine(source).generate([prompt], greedy)[0]

    model = engine.model
    assert model.quantization == name
    quantized = [layer for layer in linear_layers(model) if layer.method.name == name]
    small = (torch.float8_e4m3fn, torch.int32)
    assert all(getattr(layer, held_tensor).dtype in small for layer in quantized)
    assert not any(layer.method.name == name for layer in linear_layers(model.visual))
    held_bytes = sum(layer.method.resident_bytes(layer) for layer in quantized)
    dense_bytes = sum(layer.method.dense_bytes(layer) for layer in quantized)  # in fp32
    assert held_bytes < 0.3 * dense_bytes, (held_bytes, dense_bytes)
    said = methods_used(model, DENSE)  # the start-up line's, with the settings' method
    share = f"{held_bytes / dense_bytes:.2f}x"
    assert said == f"dense method; {name} for {len(quantized)} layers at {share}", said
    resident, dense = linear_weight_bytes(model)
    assert resident < dense


def test_a_4_bit_checkpoint_in_bf16_answers_through_the_int4_kernel(qwen2_5_vl_tiny, tmp_path):
    """AWQ in bfloat16: every quantized layer runs through PyTorch's int4 kernel (the
    start-up line says so), a prefill chunk's rows through the weights dequantized from
    its packing, and the greedy answer with an image equals transformers' in bf16 on the
    dequantized twin wherever transformers' choice is clear of bf16's rounding."""
    checkpoint = awq.write_awq(qwen2_5_vl_tiny, tmp_path / "awq")
    twin = awq.write_awq_twin(checkpoint, tmp_path / "twin")
    prompt = chat_prompt(PromptBuilder(checkpoint), "Describe it.", [make_image(64, 48, seed=3)])
    engine = cpu_engine(checkpoint, dtype="bfloat16", max_num_batched_tokens=96)
    kernel = [layer for layer in linear_layers(engine.model) if layer.method.name == "int4-cpu"]
    said = methods_used(engine.model, DENSE)
    # the kernel's packing: half a byte per weight, a bf16 scale and offset per group of 32
    share = (0.5 + 4 / 32) / 2  # of bf16's 2 bytes: 0.31x (groups of 128: 0.27x)
    assert kernel and said == (
        f"dense method; awq for {len(kernel)} layers at {share:.2f}x, through int4-cpu"
    ), said
    greedy = Sampling(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    [ours] = engine.generate([prompt], greedy)
    theirs, margins = hf_generate_with_margins(twin, prompt, MAX_NEW, torch.bfloat16)
    clear = next((i for i, m in enumerate(margins) if m < 0.05), len(margins))
    assert clear >= 3 and ours[:clear] == theirs[:clear], (ours, theirs, margins)


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "marlin"}, "'marlin' is not supported yet"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "float-quantized"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "symmetric": False,
                            "strategy": "group",
                            "group_size": 128,
                        }
                    }
                },
            },
            "'symmetric': False",
        ),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits 8"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits 8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
    ],
)
def test_a_format_iris_does_not_read_is_refused_naming_it(tmp_path, quantization, named):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization}))
    with pytest.raises(ValueError, match=named):
        checkpoint_format(tmp_path)


def test_iris_tiny_model_writes_4_bit_groups_of_the_size_asked_for(tmp_path):
    out = tmp_path / "awq"
    assert main_tiny_model(["--arch", "qwen2_vl", "--quant", "awq", "--group-size", "64",
                            "--out", str(out)]) == 0  # fmt: skip
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64
    with pytest.raises(SystemExit):  # not a 4-bit format
        main_tiny_model(["--arch", "qwen2_vl", "--quant", "fp8", "--group-size", "64",
                         "--out", str(tmp_path / "fp8")])  # fmt: skip


def test_iris_tiny_model_writes_the_fp8_layout_sharded_too(tmp_path):
    """`iris tiny-model --quant fp8`: Qwen's config fields, e4m3 decoder projections with
    their bf16 grids, the vision tower and head as they were, the stamp saying so; across
    shards, the index names every tensor."""
    from safetensors import safe_open

    out = tmp_path / "fp8"
    args = ["--arch", "qwen2_vl", "--quant", "fp8", "--max-shard-size", "200KB", "--out", str(out)]
    assert main_tiny_model(args) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    assert "visual.blocks.0.attn.qkv" in config["modules_to_not_convert"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    dtypes = {}
    for name, file in index.items():
        with safe_open(str(out / file), "pt") as f:
            dtypes[name] = f.get_tensor(name).dtype
    q = "model.layers.0.self_attn.q_proj.weight"
    assert dtypes[q] == torch.float8_e4m3fn and dtypes[q + "_scale_inv"] == torch.bfloat16
    assert dtypes["visual.blocks.0.attn.qkv.weight"] == torch.float32
    assert json.loads((out / STAMP_FILE).read_text())["quant"] == "fp8"


def test_served_fp8_says_its_format_and_answers_as_transformers(qwen2_5_vl_tiny, tmp_path):
    """`iris serve` on a block-FP8 checkpoint: `/v1/models` and the start-up lines name the
    format, and a chat answer with an image is transformers' on the dequantized twin."""
    import httpx

    from tests.server_harness import iris_server
    from tests.test_tokenizer_worker import data_url

    fp8 = write_fp8(qwen2_5_vl_tiny, tmp_path / "fp8")
    twin = write_fp8_twin(fp8, tmp_path / "twin")
    image = make_image(64, 48, seed=4)
    builder = PromptBuilder(fp8)
    expected = builder.tokenizer.decode(
        hf_generate(twin, chat_prompt(builder, "Describe it.", [image]), MAX_NEW),
        skip_special_tokens=True,
    )
    (tmp_path / "server").mkdir()
    with iris_server(fp8, "--served-model-name", "fp8", tmp_path=tmp_path / "server") as server:
        [card] = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
        assert card["quantization"] == "block-fp8"
        content = [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": "Describe it."},
        ]
        body = {
            "model": "fp8", "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
        }  # fmt: skip
        answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == expected
        log = server.log
    assert "(Qwen2_5_VLForConditionalGeneration, block-fp8 weights, float32 on cpu)" in log
    # 2 layers: qkv, o, gate_up, down; a byte per weight and a float32 scale per 128x128 block
    assert re.search(r"\(onednn method; block-fp8 for 8 layers at 0\.2\dx\)", log), log
