"""A bf16 Qwen2 decoder's decode steps through every layer in one C++ call
(`models/fused_decode.py`): the hidden states equal the module path's to the bit, one
sequence or several at once, a context over several page runs included; a step with a
prefill row takes the layers one by one; float32 keeps the module path; a bad slot is
refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.models.attention_api import KernelDecodes, kernel_decodes
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, cpu_engine, make_image


def _compare_every_step(decoder) -> dict[str, int]:
    """Wraps `decoder.forward`: each step of decodes only runs the fused path, then the
    module path, on the same inputs, and they must agree to the bit. Both write the step's
    K/V to the same slots; fused first, so it attends to what it wrote itself."""
    fused, forward = decoder.fused_decode, decoder.forward
    seen = {"fused": 0, "batched": 0, "runs": 0, "module": 0}

    def both(inputs_embeds, positions, attn):
        decodes = kernel_decodes(attn)
        if decodes is None:
            seen["module"] += 1
            return forward(inputs_embeds, positions, attn)
        got = forward(inputs_embeds, positions, attn)
        decoder.fused_decode = None
        expected = forward(inputs_embeds, positions, attn)
        decoder.fused_decode = fused
        assert torch.equal(got, expected), "the fused decode step moved a hidden state"
        seen["fused"] += 1
        seen["batched"] += inputs_embeds.shape[0] > 1
        seen["runs"] += decodes.spans.shape[0] > inputs_embeds.shape[0]
        return got

    decoder.forward = both
    return seen


def test_bf16_decode_steps_fused_equal_the_module_path_to_the_bit(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen2_5_vl")
    engine = cpu_engine(model_dir, dtype="bfloat16", cpu_linear="pairs", page_size=16)
    decoder = engine.model.model
    assert decoder.fused_decode is not None, "a bf16 Qwen2 decoder in pairs gets the fused step"
    seen = _compare_every_step(decoder)
    builder = PromptBuilder(model_dir)
    shared = "a long shared question about numbers " * 6
    greedy = Sampling(temperature=0.0, max_tokens=10)
    # text only, so both prefill in one step and decode side by side (an image's encoding
    # would run beside the other's decodes, for as long as this machine takes)
    engine.generate(
        [chat_prompt(builder, shared + "first", []), chat_prompt(builder, "hi", [])], greedy
    )
    # the prefix cache shares the first prompt's pages: the next context spans several runs
    engine.generate([chat_prompt(builder, shared + "second", [])], greedy)
    image = chat_prompt(builder, "Describe.", [make_image(84, 56, seed=3)])
    engine.generate([image], greedy)
    assert seen["fused"] >= 27 and seen["batched"] > 0 and seen["runs"] > 0, seen
    assert seen["module"] >= 3, "prefill steps take the layers one by one"


def test_float32_keeps_the_module_path(tiny_checkpoint):
    engine = cpu_engine(tiny_checkpoint("qwen2_5_vl"))
    assert engine.model.model.fused_decode is None


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written(tiny_checkpoint):
    engine = cpu_engine(tiny_checkpoint("qwen2_5_vl"), dtype="bfloat16", cpu_linear="pairs")
    fused = engine.model.model.fused_decode
    assert fused is not None
    cache = engine.kv_cache.slots
    before = cache.clone()
    hidden = engine.model.config.hidden_size
    x = torch.randn(1, hidden).to(torch.bfloat16)
    cos = torch.ones(1, fused.shape[2], dtype=torch.bfloat16)
    spans = torch.tensor([[0, 1]])
    outside = torch.tensor([cache.shape[3]])
    decodes = KernelDecodes(cache, outside, spans, torch.tensor([0, 1]), 16)
    with pytest.raises(RuntimeError, match="a slot outside the cache"):
        fused.run(x, cos, torch.zeros_like(cos), decodes)
    assert torch.equal(cache, before)
