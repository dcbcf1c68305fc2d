"""Qwen3-VL-MoE: routed experts against transformers, and every expert layout a checkpoint
may use.

transformers' `Qwen3VLMoeTextSparseMoeBlock` (eager experts: a loop over the experts hit)
is the reference for the block; the tiny checkpoint (8 experts, top-2, routed in layer 0)
for loading. Greedy tokens through the engine are the per-arch suite's (`each_arch_dir`
includes Qwen3-VL-MoE: tests/test_engine_parity.py, test_prefix_cache_engine.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from iris_serve.scheduler.models import moe
from iris_serve.scheduler.models.config import VLModelConfig
from iris_serve.scheduler.models.registry import load_model
from tests.reference import SingleSequenceAttention, iter_safetensors

torch.set_num_threads(2)
TOL = dict(atol=1e-5, rtol=1e-5)


def _hf_block(model_dir: Path):
    """transformers' MoE block of the checkpoint's shape, random weights, eager experts."""
    from transformers import Qwen3VLMoeConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextSparseMoeBlock,
    )

    config = Qwen3VLMoeConfig.from_pretrained(model_dir).text_config
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Qwen3VLMoeTextSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    return block


def _our_block(hf_block, model_dir: Path) -> moe.SparseMoEBlock:
    config = VLModelConfig.from_pretrained(model_dir)
    assert config.moe is not None
    block = moe.SparseMoEBlock(config.hidden_size, config.moe)
    block.load_state_dict(hf_block.state_dict())
    return block.eval()


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "expert_loop"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
@torch.no_grad()
def test_block_matches_transformers(qwen3_vl_moe_tiny, monkeypatch, grouped_mm, tokens):
    """Decode-sized and prefill-sized inputs, experts with no token and with many, on both
    the grouped_mm path and the per-expert loop that stands in where grouped_mm cannot run."""
    if not grouped_mm:
        monkeypatch.setattr(moe, "_grouped_mm_works", lambda *_: False)
    hf = _hf_block(qwen3_vl_moe_tiny)
    ours = _our_block(hf, qwen3_vl_moe_tiny)
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hf.gate.hidden_dim, generator=generator)
    x[tokens // 8 :] = x[0] + 0.1 * x[tokens // 8 :]  # most tokens alike: they share experts

    _, hf_weights, hf_experts = hf.gate(x)
    weights, experts = moe.route(ours.gate(x), ours.top_k)
    torch.testing.assert_close(experts, hf_experts, rtol=0, atol=0)
    torch.testing.assert_close(weights, hf_weights, **TOL)
    if tokens == 40:  # the load is uneven: some experts idle, some take many rows
        load = torch.bincount(experts.flatten(), minlength=hf.gate.num_experts)
        assert load.min() == 0 < 10 < load.max(), load
    torch.testing.assert_close(ours(x), hf(x[None])[0], **TOL)


def _rewrite_experts(source: Path, target: Path, convert) -> Path:
    """A copy of the checkpoint with every fused expert tensor replaced by `convert`'s
    `(name, tensor)` pairs."""
    shutil.copytree(source, target)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors(source):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state.update(convert(name, tensor))
        else:
            state[name] = tensor
    for stale in target.glob("model*.safetensors*"):
        stale.unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))
    return target


def _hub_layout(name: str, tensor: torch.Tensor):
    """The Qwen hub's fused layout: `[E, H, 2I]` and `[E, I, H]`."""
    yield name, tensor.transpose(1, 2)


def _per_expert(name: str, tensor: torch.Tensor):
    """`experts.N.{gate,up,down}_proj.weight`, as quantized exports and Qwen3-MoE name them."""
    prefix = name.rpartition(".")[0]
    for expert, weight in enumerate(tensor):
        if name.endswith("down_proj"):
            yield f"{prefix}.{expert}.down_proj.weight", weight
        else:
            gate, up = weight.chunk(2)
            yield f"{prefix}.{expert}.gate_proj.weight", gate
            yield f"{prefix}.{expert}.up_proj.weight", up


def _logits(model_dir: Path) -> torch.Tensor:
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    tokens = torch.arange(60)
    with torch.no_grad():
        hidden = model(model.embed_tokens(tokens), tokens, SingleSequenceAttention())
        return model.compute_logits(hidden)


@pytest.mark.parametrize("layout", [_hub_layout, _per_expert], ids=["hub_fused", "per_expert"])
def test_every_expert_layout_loads_to_the_same_model(qwen3_vl_moe_tiny, tmp_path, layout):
    expected = _logits(qwen3_vl_moe_tiny)  # transformers 5's layout, what save_pretrained writes
    converted = _rewrite_experts(qwen3_vl_moe_tiny, tmp_path / "ckpt", layout)
    torch.testing.assert_close(_logits(converted), expected, rtol=0, atol=0)


def test_a_missing_expert_is_named(qwen3_vl_moe_tiny, tmp_path):
    def drop_expert_5(name: str, tensor: torch.Tensor):
        for item in _per_expert(name, tensor):
            if ".experts.5.up_proj" not in item[0]:
                yield item

    broken = _rewrite_experts(qwen3_vl_moe_tiny, tmp_path / "ckpt", drop_expert_5)
    with pytest.raises(
        ValueError, match=r"layers\.0\.mlp\.experts\.gate_up_proj \(up_proj: experts \[5\]"
    ):
        load_model(broken, torch.float32, torch.device("cpu"))


def test_an_ambiguous_fused_layout_is_refused_not_guessed():
    """With hidden == 2 * moe_intermediate the hub's `[E, H, 2I]` and ours `[E, 2I, H]` are
    one shape; loading it either way would give a silently wrong model."""
    tensor = torch.zeros(4, 32, 32)
    weights = [("model.language_model.layers.0.mlp.experts.gate_up_proj", tensor)]
    with pytest.raises(ValueError, match="cannot tell them apart"):
        list(
            moe.expert_weights_in_our_layout(
                weights, num_experts=4, hidden_size=32, intermediate_size=16
            )
        )


def test_config_reads_the_moe_rule_and_the_top_level_tie(qwen3_vl_moe_tiny):
    """Layer 1 is `mlp_only_layers`; transformers 5 writes `num_experts` as
    `num_local_experts` and unties through the top-level key although text_config says
    true."""
    raw = json.loads((qwen3_vl_moe_tiny / "config.json").read_text())
    assert raw["text_config"]["tie_word_embeddings"] and not raw["tie_word_embeddings"]
    config = VLModelConfig.from_pretrained(qwen3_vl_moe_tiny)
    assert config.moe is not None and config.moe.num_experts == 8
    assert [config.moe.is_moe_layer(i) for i in range(config.num_layers)] == [True, False]
    assert not config.tie_word_embeddings
    model = load_model(qwen3_vl_moe_tiny, torch.float32, torch.device("cpu"))
    assert isinstance(model.model.layers[0].mlp, moe.SparseMoEBlock)
    assert not isinstance(model.model.layers[1].mlp, moe.SparseMoEBlock)
