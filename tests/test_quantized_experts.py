"""Quantized MoE experts, stored per expert as the releases store them: in block FP8 (each
expert's gate/up/down with its own scale grid, Qwen's `-FP8` MoE releases) a rank holds its
share of the expert width with the blocks its columns fall in; in a 4-bit format (AWQ,
GPTQ, W4A16) each expert is an MLP of the format's linear layers. Either computes what the
dequantized experts compute, and a checkpoint answers as transformers does on its
dequantized twin, for Qwen3-VL-MoE and Qwen3.5-MoE."""

from __future__ import annotations

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.load import methods_used
from iris_serve.scheduler.models import fp8_experts, int4_cpu
from iris_serve.scheduler.models.layers import PACKED_SHARDS
from iris_serve.scheduler.models.linear_method import (
    DENSE,
    linear_layers,
    process_linears_after_loading,
)
from iris_serve.scheduler.models.loader import load_named_weights
from iris_serve.scheduler.models.moe import RoutedExperts, expert_weights_in_our_layout
from iris_serve.scheduler.models.tensor_parallel import SINGLE, TPShard
from iris_serve.scheduler.step.graph_capture import why_decode_is_not_capturable
from iris_serve.tiny_checkpoint import awq
from iris_serve.tiny_checkpoint import compressed_tensors as w4a16
from iris_serve.tiny_checkpoint.fp8 import dequantize, quantize, write_fp8, write_fp8_twin
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, cpu_engine, hf_generate, make_image
from tests.test_quantized_checkpoints import PACKED

torch.set_num_threads(2)
EXPERTS, HIDDEN, WIDTH = 3, 160, 200  # partial blocks both ways; rank 1's share starts at 100


def per_expert_checkpoint(seed: int) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """Qwen's per-expert FP8 tensors of a layer, and the float32 weights they hold."""
    generator = torch.Generator().manual_seed(seed)
    tensors, held = [], {}
    for e in range(EXPERTS):
        for kind, shape in (("gate_proj", (WIDTH, HIDDEN)), ("up_proj", (WIDTH, HIDDEN)),
                            ("down_proj", (HIDDEN, WIDTH))):  # fmt: skip
            q, s = quantize(torch.randn(*shape, generator=generator), torch.bfloat16)
            name = f"layers.0.mlp.experts.{e}.{kind}.weight"
            tensors += [(name, q), (name + "_scale_inv", s)]
            held[(e, kind)] = dequantize(q, s)
    return tensors, held


def loaded_experts(tp: TPShard, tensors: list[tuple[str, torch.Tensor]]) -> RoutedExperts:
    experts = RoutedExperts(EXPERTS, HIDDEN, WIDTH, tp)
    experts.use_block_fp8()
    stacked = expert_weights_in_our_layout(
        tensors, num_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=WIDTH
    )
    for name, tensor in stacked:
        experts.load_weight(name.rpartition(".")[2], tensor, None)
    return experts


@pytest.mark.parametrize("rank", [None, 1])
def test_a_ranks_fp8_experts_hold_its_share_and_compute_as_the_dequantized_ones(rank):
    """The whole layer, and rank 1 of 2 (its share of the width starts inside a block):
    each expert dequantizes to exactly the writer's weights, and routed tokens get what
    the same experts in float32 give them."""
    tp = SINGLE if rank is None else TPShard(rank=rank, size=2)
    start, width = tp.split(WIDTH, "width")
    tensors, held = per_expert_checkpoint(seed=1)
    experts = loaded_experts(tp, tensors)
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    dense = RoutedExperts(EXPERTS, HIDDEN, WIDTH, tp)
    for e in range(EXPERTS):
        share = slice(start, start + width)
        gate_up = torch.cat([held[(e, "gate_proj")][share], held[(e, "up_proj")][share]])
        down = held[(e, "down_proj")][:, share]
        assert torch.equal(
            fp8_experts.dequantized(experts, "gate_up_proj", e, torch.float32), gate_up
        )
        assert torch.equal(fp8_experts.dequantized(experts, "down_proj", e, torch.float32), down)
        dense.gate_up_proj.data[e], dense.down_proj.data[e] = gate_up, down
    x = torch.randn(7, HIDDEN)
    chosen = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 2], [0, 0], [2, 0], [0, 2]])  # 1 idle
    weights = torch.rand(7, 2)
    got, expected = experts(x, chosen, weights), dense(x, chosen, weights)
    scale = expected.abs().max()  # the CPU kernel sums in its own order: float32's rounding
    torch.testing.assert_close(got / scale, expected / scale, rtol=0, atol=1e-6)


class OneLayer(torch.nn.Module):
    """What the loader sees of a MoE layer: `experts.{e}.{gate,up,down}_proj.<tensor>`."""

    def __init__(self, experts: RoutedExperts) -> None:
        super().__init__()
        self.experts = experts


def four_bit_experts(fmt: str, tp: TPShard, dtype: torch.dtype, width: int, hidden: int):
    """Routed experts in 4-bit format `fmt` loaded from per-expert tensors as its writer
    stores them, and the same experts dense in float32 with the weights they hold."""
    method, make = PACKED[fmt]
    experts = RoutedExperts(EXPERTS, hidden, width, tp)
    experts.use_linear_method(method(dtype))
    tensors, dense = [], RoutedExperts(EXPERTS, hidden, width, tp)
    start, share = tp.split(width, "width")
    shapes = {
        "gate_proj": (width, hidden),
        "up_proj": (width, hidden),
        "down_proj": (hidden, width),
    }
    for e in range(EXPERTS):
        held = {}
        for seed, (kind, (rows, cols)) in enumerate(shapes.items()):
            stored, held[kind] = make(rows, cols, 10 * e + seed)
            tensors += [(f"experts.{e}.{kind}.{leaf}", t) for leaf, t in stored.items()]
        part = slice(start, start + share)
        dense.gate_up_proj.data[e] = torch.cat([held["gate_proj"][part], held["up_proj"][part]])
        dense.down_proj.data[e] = held["down_proj"][:, part]
    layer = OneLayer(experts)
    load_named_weights(layer, tensors, rename=lambda name: name, packed=PACKED_SHARDS)
    process_linears_after_loading(layer)
    return experts, dense


ROUTED = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 2], [0, 0], [2, 0], [0, 2]])  # 1 idle


@pytest.mark.parametrize(("fmt", "rank"), [("awq", 1), ("gptq", None), ("w4a16", 1)])
def test_4_bit_experts_are_the_formats_layers_and_compute_as_the_dequantized_ones(fmt, rank):
    """Each expert's gate/up/down, loaded by the names a 4-bit MoE release stores, is an
    MLP of the format's layers holding this rank's share of the width (rank 1 of 2: its
    half of gate/up's rows and of down's packed inputs); routed tokens get what the same
    experts dense in float32 give them."""
    tp = SINGLE if rank is None else TPShard(rank=rank, size=2)
    experts, dense = four_bit_experts(fmt, tp, torch.float32, width=128, hidden=64)
    assert experts.quantization == fmt.split()[0]
    layers = list(linear_layers(experts))
    assert len(layers) == 2 * EXPERTS and all(layer.method.name == fmt for layer in layers)
    assert experts.stacked_weights() == 0
    x, weights = torch.randn(7, 64), torch.rand(7, 2)
    expected = dense(x, ROUTED, weights)  # the same sums, in another order
    scale = expected.abs().max()
    torch.testing.assert_close(experts(x, ROUTED, weights) / scale, expected / scale)


def test_in_bfloat16_4_bit_experts_run_through_torchs_int4_kernel():
    """AWQ experts in bfloat16: every expert's layers are handed to PyTorch's int4 kernel,
    and routed tokens get the dequantized experts' answer within bfloat16's rounding."""
    experts, dense = four_bit_experts("awq", SINGLE, torch.bfloat16, width=64, hidden=128)
    assert all(isinstance(m.method, int4_cpu.Int4PackedCpuLinear) for m in linear_layers(experts))
    assert experts.quantization == "awq"
    x, weights = torch.randn(7, 128), torch.rand(7, 2)
    expected = dense(x, ROUTED, weights)
    got = experts(x.bfloat16(), ROUTED, weights.bfloat16()).float()
    scale = expected.abs().max()
    torch.testing.assert_close(got / scale, expected / scale, rtol=0, atol=3e-2)


QUANTIZED_MOE = {  # --quant: (writer, its twin's writer, what an expert's gate/up holds)
    "fp8": (write_fp8, write_fp8_twin, ".up_proj.weight"),
    "awq": (awq.write_awq, awq.write_awq_twin, ".up_proj.qweight"),
    "w4a16": (w4a16.write_w4a16, w4a16.write_w4a16_twin, ".up_proj.weight_packed"),
}


@pytest.mark.parametrize(
    ("quant", "arch"),
    [
        ("fp8", "qwen3_vl_moe"),
        ("fp8", "qwen3_5_moe"),
        ("awq", "qwen3_vl_moe"),
        ("w4a16", "qwen3_5_moe"),
    ],
)
def test_a_quantized_moe_checkpoint_answers_as_transformers_on_its_dequantized_twin(
    quant, arch, request, tmp_path
):
    """Qwen3-VL-MoE (experts fused in the source) and Qwen3.5-MoE (per expert, a shared
    expert beside them): the quantized checkpoint stores every expert's projections apart
    (FP8 with their grids, 4-bit packed), Iris holds them quantized, and greedy tokens with
    an image, prefill chunked, equal transformers' on the dequantized twin and differ from
    the source's."""
    from safetensors import safe_open

    write, write_twin, held_tensor = QUANTIZED_MOE[quant]
    source = request.getfixturevalue(f"{arch}_tiny")
    checkpoint = write(source, tmp_path / quant)
    twin = write_twin(checkpoint, tmp_path / "twin")
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as stored:
        names = set(stored.keys())
    assert "model.language_model.layers.0.mlp.experts.1" + held_tensor in names
    prompt = chat_prompt(PromptBuilder(checkpoint), "Describe it.", [make_image(64, 48, seed=3)])
    greedy = Sampling(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = cpu_engine(checkpoint, max_num_batched_tokens=48)
    [ours] = engine.generate([prompt], greedy)
    assert ours == hf_generate(twin, prompt, 10)
    assert ours != cpu_engine(source).generate([prompt], greedy)[0]
    routed = [m for m in engine.model.modules() if isinstance(m, RoutedExperts)]
    assert routed and all(m.quantization == engine.model.quantization for m in routed)
    said = methods_used(engine.model, DENSE)  # the start-up line's
    assert said.endswith(f", the routed experts of {len(routed)} layers"), said
    # 4-bit experts run one by one, reading the counts back: no CUDA graph is attempted
    uncapturable = why_decode_is_not_capturable(engine.model)
    assert (uncapturable is None) == (quant == "fp8"), uncapturable
