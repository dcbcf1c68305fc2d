"""MoE experts in block FP8, as Qwen's `-FP8` MoE releases store them (each expert's
gate/up/down with its own scale grid): a rank holds its share of the expert width with the
blocks its columns fall in, computes what the dequantized experts compute, and a
checkpoint answers as transformers does on its dequantized twin, for Qwen3-VL-MoE and
Qwen3.5-MoE. Experts in the other formats are refused, naming the tensor."""

from __future__ import annotations

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.load import methods_used
from iris_serve.scheduler.models import fp8_experts
from iris_serve.scheduler.models.linear_method import DENSE
from iris_serve.scheduler.models.moe import RoutedExperts, expert_weights_in_our_layout
from iris_serve.scheduler.models.tensor_parallel import SINGLE, TPShard
from iris_serve.tiny_checkpoint import awq
from iris_serve.tiny_checkpoint.fp8 import dequantize, quantize, write_fp8, write_fp8_twin
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, cpu_engine, hf_generate, make_image

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
    torch.testing.assert_close(experts(x, chosen, weights), dense(x, chosen, weights))


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_an_fp8_moe_checkpoint_answers_as_transformers_on_its_dequantized_twin(
    arch, request, tmp_path
):
    """Qwen3-VL-MoE (experts fused in the source) and Qwen3.5-MoE (per expert, a shared
    expert beside them): the FP8 checkpoint stores every expert's projections apart with
    their grids, Iris holds them in e4m3, and greedy tokens with an image, prefill chunked,
    equal transformers' on the dequantized twin and differ from the source's."""
    from safetensors import safe_open

    source = request.getfixturevalue(f"{arch}_tiny")
    checkpoint = write_fp8(source, tmp_path / "fp8")
    twin = write_fp8_twin(checkpoint, tmp_path / "twin")
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as stored:
        names = set(stored.keys())
    expert = "model.language_model.layers.0.mlp.experts.1.up_proj.weight"
    assert {expert, expert + "_scale_inv"} <= names
    prompt = chat_prompt(PromptBuilder(checkpoint), "Describe it.", [make_image(64, 48, seed=3)])
    greedy = Sampling(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = cpu_engine(checkpoint, max_num_batched_tokens=48)
    [ours] = engine.generate([prompt], greedy)
    assert ours == hf_generate(twin, prompt, 10)
    assert ours != cpu_engine(source).generate([prompt], greedy)[0]
    routed = [m for m in engine.model.modules() if isinstance(m, RoutedExperts)]
    assert routed and all(m.gate_up_proj.dtype == torch.float8_e4m3fn for m in routed)
    said = methods_used(engine.model, DENSE)  # the start-up line's
    assert said.endswith(f", the routed experts of {len(routed)} layers"), said


def test_awq_moe_experts_are_refused_naming_the_tensor(qwen3_vl_moe_tiny, tmp_path):
    """Routed experts are held quantized in block FP8 only: an AWQ checkpoint whose experts
    are stored quantized is refused before anything loads, naming the tensor, instead of
    loading wrong weights."""
    from safetensors.torch import load_file, save_file

    from iris_serve.scheduler.models.registry import load_model

    checkpoint = awq.write_awq(qwen3_vl_moe_tiny, tmp_path / "awq")
    tensors = load_file(checkpoint / "model.safetensors")
    expert = "model.language_model.layers.0.mlp.experts.0.gate_proj"
    qweight, qzeros, scales = awq.quantize(torch.randn(64, 24), awq.GROUP_SIZE)
    tensors |= {f"{expert}.qweight": qweight, f"{expert}.qzeros": qzeros,
                f"{expert}.scales": scales}  # fmt: skip
    save_file(tensors, checkpoint / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match=f"{expert}.qweight: awq weights of this kind"):
        load_model(checkpoint, torch.float32, "cpu")
