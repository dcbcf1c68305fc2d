"""`--cpu-linear onednn` (what `auto` takes on a CPU in float32): every linear layer but the
LM head computes through oneDNN with a prepacked weight and gives what PyTorch's own linear
gives, to float rounding; once loaded, a layer holds only the packed copy, so the model's
linear weights take what they take dense (1.0x, not 2x); `--cpu-linear aten` keeps the
dense method, and both give the same greedy tokens (parity with transformers runs on the
default everywhere else). `--cpu-linear pairs` (what `auto` takes in bfloat16 on AVX512-BF16
without AMX): our kernel over weights packed in pairs gives the float32 product of the bf16
values, rounded once, for every row count and ragged shape, and holds only the packed copy."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.auto_dtype import native_bf16_cpu
from iris_serve.scheduler.models.cpu_linear import OneDNNPackedLinear, dense_product
from iris_serve.scheduler.models.gated_deltanet import GatedDeltaNet
from iris_serve.scheduler.models.linear_method import (
    DENSE,
    LinearLayer,
    LinearMethod,
    building_with,
    fused_rows,
    linear_layers,
    linear_weight_bytes,
    process_linears_after_loading,
)
from iris_serve.scheduler.models.pair_linear import PairPackedLinear
from iris_serve.scheduler.models.quantization import select_linear_method
from iris_serve.scheduler.models.tensor_parallel import ReplicatedLinear
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, cpu_engine, make_image

torch.set_num_threads(2)
CPU = torch.device("cpu")


def _packed_layers(shapes, dtype: torch.dtype, method: LinearMethod | None = None) -> nn.ModuleList:
    """Layers built with `method` (the oneDNN one unless told), random weights loaded (not
    processed yet)."""
    torch.manual_seed(0)
    with building_with(method or OneDNNPackedLinear()):
        layers = nn.ModuleList([ReplicatedLinear(i, o, bias=bias) for i, o, bias in shapes]).to(
            dtype
        )
    with torch.no_grad():
        for param in layers.parameters():
            param.normal_(0.0, 0.1)
    return layers


def _held_bytes(layer: LinearLayer) -> int:
    """What a layer holds, counted apart from the methods' own counting: its parameters and
    buffers, and every other tensor it references (a packed oneDNN weight by its shape and
    dtype, the size a dense copy of it would take)."""
    tensors = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
    owned = {id(t) for t in tensors}
    tensors += [v for v in vars(layer).values() if torch.is_tensor(v) and id(v) not in owned]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_layer_computes_what_pytorchs_linear_does(dtype):
    layers = _packed_layers([(64, 96, True), (96, 32, False)], dtype)
    dense = [(layer.weight.detach().clone(), layer.bias) for layer in layers]
    process_linears_after_loading(layers)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in ([1, 64], [7, 64], [2, 5, 64], [0, 64]):  # decode, prefill, batched, empty
        x = torch.randn(*rows, dtype=dtype)
        y = layers[1](layers[0](x))
        (w0, b0), (w1, _) = dense
        expected = F.linear(F.linear(x, w0, b0), w1)
        assert y.shape == expected.shape
        torch.testing.assert_close(y, expected, rtol=tolerance, atol=tolerance)


@torch.no_grad()
def test_after_loading_only_the_packed_copy_remains():
    """The dense weight is released (nothing references it) and the packed copy does not
    share its memory: overwriting the old weight changes nothing."""
    layers = _packed_layers([(64, 96, True)], torch.float32)
    layer = layers[0]
    x = torch.randn(3, 64)
    with torch.no_grad():  # no autograd graph of the test's own holding the weight
        expected = F.linear(x, layer.weight, layer.bias)
    released = weakref.ref(layer.weight)
    process_linears_after_loading(layers)
    gc.collect()
    assert released() is None
    assert "weight" not in dict(layer.named_parameters()) and not hasattr(layer, "weight")
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)

    kept = _packed_layers([(64, 96, False)], torch.float32)
    old_weight = kept[0].weight
    before = F.linear(x, old_weight)
    process_linears_after_loading(kept)
    old_weight.data.fill_(float("nan"))
    torch.testing.assert_close(kept[0](x), before, rtol=1e-5, atol=1e-5)


def test_block_sized_layers_allocate_what_they_take_dense():
    """Widths in whole oneDNN blocks (as a real model's are): the packed allocation is the
    dense weight's size, bias included (`resident_bytes` reads oneDNN's own size)."""
    layers = _packed_layers([(256, 512, True), (512, 256, False)], torch.bfloat16)
    dense = sum(p.numel() * p.element_size() for p in layers.parameters())
    process_linears_after_loading(layers)
    assert linear_weight_bytes(layers) == (dense, dense)


def test_the_method_is_picked_in_one_place():
    bf16, fp16 = torch.bfloat16, torch.float16
    assert select_linear_method(CPU, bf16, "onednn").name == "onednn"
    assert select_linear_method(CPU, bf16, "aten") is DENSE
    assert select_linear_method(CPU, fp16, "onednn") is DENSE  # oneDNN packs fp32 and bf16
    assert select_linear_method(torch.device("meta"), bf16, "onednn") is DENSE
    assert select_linear_method(CPU, bf16, "pairs").name == "pairs"
    with pytest.raises(ValueError, match="pairs computes bfloat16"):
        select_linear_method(CPU, torch.float32, "pairs")
    assert select_linear_method(CPU, torch.float32, "auto").name == "onednn"
    native_pairs = native_bf16_cpu() == "AVX512-BF16"  # AMX: oneDNN's tiles compute faster
    assert select_linear_method(CPU, bf16, "auto").name == ("pairs" if native_pairs else "onednn")
    assert select_linear_method(torch.device("meta"), bf16, "auto") is DENSE


def test_a_layer_packed_in_pairs_gives_the_float32_product_of_its_bf16_values_rounded_once():
    """Ragged shapes (outputs not whole blocks of 64, inputs not whole vectors), with and
    without a bias, rows 1 (a decode step's own path), tiles of 6 and their remainders,
    more rows than a task's, batched and empty; once processed only the packed copy is
    held, and it counts as the dense weight it replaced."""
    layers = _packed_layers([(96, 203, True), (34, 64, False)], torch.bfloat16, PairPackedLinear())
    dense = [(layer.weight.detach().clone(), layer.bias) for layer in layers]
    dense_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
    process_linears_after_loading(layers)
    assert not [layer for layer in layers if hasattr(layer, "weight")]
    assert linear_weight_bytes(layers)[1] == dense_bytes
    for layer, (weight, bias) in zip(layers, dense, strict=True):
        for rows in ([1], [2], [5], [6], [7], [13], [100], [2, 5], [0]):
            x = torch.randn(*rows, layer.in_features).to(torch.bfloat16)
            expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            got = layer(x)
            assert got.dtype == torch.bfloat16 and got.shape == expected.shape
            # bf16's half unit in the last place, 2^-9 of the value, with room for the sums' order
            torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-4)
    with pytest.raises(TypeError, match="packed as bfloat16 pairs"):
        layers[0](torch.randn(1, 96))


def test_the_pairs_and_onednn_give_a_bf16_model_the_same_greedy_tokens(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen2_5_vl")
    prompt = chat_prompt(PromptBuilder(model_dir), "Describe.", [make_image(84, 56, seed=3)])
    greedy = Sampling(temperature=0.0, max_tokens=8)
    tokens = {}
    for kind in ("pairs", "onednn"):
        engine = cpu_engine(model_dir, dtype="bfloat16", cpu_linear=kind)
        assert {layer.method.name for layer in linear_layers(engine.model.model)} == {kind}
        tokens[kind] = engine.generate([prompt], greedy)
    assert tokens["pairs"] == tokens["onednn"]


def test_the_engine_packs_by_default_holds_1x_and_aten_gives_the_same_tokens(
    tiny_checkpoint, caplog
):
    model_dir = tiny_checkpoint("qwen2_5_vl")
    prompt = chat_prompt(PromptBuilder(model_dir), "Describe.", [make_image(84, 56, seed=3)])
    greedy = Sampling(temperature=0.0, max_tokens=8)
    with caplog.at_level(logging.INFO, logger="iris_serve.scheduler.device_state"):
        engines = {kind: cpu_engine(model_dir, cpu_linear=kind) for kind in ("onednn", "aten")}
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("linear weights")]
    assert len(said) == 2 and "(onednn method)" in said[0] and "(dense method)" in said[1]
    assert "1.00x" in said[1]

    methods = {
        kind: {layer.method.name for layer in linear_layers(engine.model.model)}
        for kind, engine in engines.items()
    }
    assert methods == {"onednn": {"onednn"}, "aten": {"dense"}}
    packed, dense = (list(linear_layers(engines[kind].model)) for kind in ("onednn", "aten"))
    assert len(packed) == len(dense) > 0
    # the dense weights are gone from every packed layer, and what the layers hold is what
    # the dense layers hold, to the byte
    onednn = [layer for layer in packed if layer.method.name == "onednn"]
    assert onednn and not [layer for layer in onednn if hasattr(layer, "weight")]
    assert sum(map(_held_bytes, packed)) == sum(map(_held_bytes, dense))
    assert linear_weight_bytes(engines["onednn"].model)[1] == sum(map(_held_bytes, dense))

    tokens = {kind: engine.generate([prompt], greedy) for kind, engine in engines.items()}
    assert tokens["onednn"] == tokens["aten"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_unpacked_weights_product_is_pytorchs_linear(dtype):
    """The path of dequantized copies and the LM head: rows of any leading shape, a bias,
    and a transposed view (AWQ's and GPTQ's buffers hold the weight as `[in, out]`)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 96, generator=generator).to(dtype)
    weight_t = torch.randn(96, 40, generator=generator).to(dtype)
    bias = torch.randn(40, generator=generator).to(dtype)
    expected = F.linear(x.float(), weight_t.t().float(), bias.float())
    got = dense_product(x, weight_t.t(), bias)
    assert got.dtype == dtype and got.shape == (2, 5, 40)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    assert dense_product(x[:0], weight_t.t()).shape == (0, 5, 40)


def test_layers_reading_one_input_fuse_into_one_that_gives_their_outputs_side_by_side():
    layers = _packed_layers([(64, 40, False), (64, 8, False), (64, 24, False)], torch.float32)
    x = torch.randn(3, 64)
    apart = torch.cat([F.linear(x, layer.weight) for layer in layers], dim=-1)
    fused = fused_rows(list(layers))
    assert fused is not None and fused.shard_sizes == (40, 8, 24)
    process_linears_after_loading(fused)  # packed as the model's own layers are
    torch.testing.assert_close(fused(x), apart)
    biased = _packed_layers([(64, 8, True), (64, 8, False)], torch.float32)
    other_input = _packed_layers([(64, 8, False), (32, 8, False)], torch.float32)
    with building_with(DENSE):
        dense = ReplicatedLinear(64, 8, bias=False)
    assert fused_rows(list(biased)) is None and fused_rows(list(other_input)) is None
    assert fused_rows([layers[0], dense]) is None  # another method


def test_gated_deltanets_input_projections_are_one_layer_once_loaded(qwen3_5_tiny):
    """One call for the four in a decode step; what they compute, the parity suite pins."""
    model = cpu_engine(qwen3_5_tiny).model
    linear_attention = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert linear_attention
    for layer in linear_attention:
        assert layer.in_proj is not None and not hasattr(layer, "in_proj_qkv")
        assert layer.in_proj.method.name == "onednn" and len(layer.in_proj.shard_sizes or ()) == 4
