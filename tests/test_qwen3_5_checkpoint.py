"""Qwen3.5 tiny checkpoints (`iris tiny-model --arch qwen3_5|qwen3_5_moe`) load and generate in
transformers' own classes, with the tiny tokenizer and Qwen3-VL's processor; Iris's own
model code loads them too."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    ProcessorMixin,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)

from iris_serve.scheduler.models.registry import load_config, load_model
from iris_serve.tiny_checkpoint import main_tiny_model, reference_processor
from iris_serve.tiny_checkpoint.configs import SHAPES
from iris_serve.tiny_checkpoint.tokenizer import SPECIAL_TOKENS

torch.set_num_threads(2)

TinyCheckpoint = Callable[..., Path]
CLASSES = {
    "qwen3_5": Qwen3_5ForConditionalGeneration,
    "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
}
IRIS_CLASSES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


@pytest.fixture(scope="module", params=list(CLASSES))
def arch_dir(request: pytest.FixtureRequest, tiny_checkpoint: TinyCheckpoint) -> tuple[str, Path]:
    return request.param, tiny_checkpoint(request.param)


def processor(path: Path) -> ProcessorMixin:
    """`AutoProcessor` where torchvision is installed (its video processor needs it), else
    the same class built without video (`reference_processor`)."""
    if importlib.util.find_spec("torchvision"):
        return AutoProcessor.from_pretrained(path)
    return reference_processor(path)


def test_config_is_hybrid_and_names_the_tokenizers_ids(arch_dir: tuple[str, Path]) -> None:
    arch, path = arch_dir
    config = AutoConfig.from_pretrained(path)
    text, vision = config.text_config, config.vision_config
    assert config.model_type == arch and not config.tie_word_embeddings
    kinds = text.layer_types
    assert kinds == ["linear_attention", "full_attention"] * 2  # two of each, alternating
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (2, 4)
    assert (text.linear_key_head_dim, text.linear_value_head_dim) == (16, 32)
    rope = text.rope_parameters
    rotary = int(text.head_dim * rope["partial_rotary_factor"])
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) == rotary // 2
    assert (vision.patch_size, vision.spatial_merge_size, vision.out_hidden_size) == (16, 2, 64)
    raw = json.loads((path / "config.json").read_text())
    assert "deepstack_visual_indexes" not in raw["vision_config"]
    if arch == "qwen3_5_moe":
        assert (text.num_experts, text.num_experts_per_tok) == (8, 2)
        tiny = SHAPES["tiny"]
        widths = (text.moe_intermediate_size, text.shared_expert_intermediate_size)
        assert widths == (tiny.expert_intermediate, tiny.shared_expert_intermediate)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == text.vocab_size
    ids = [tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids), ids
    named = [config.vision_start_token_id, config.image_token_id, config.video_token_id]
    assert tok.convert_ids_to_tokens([*named, config.vision_end_token_id]) == [
        "<|vision_start|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<|vision_end|>",
    ]
    assert text.eos_token_id == tok.eos_token_id


def test_weights_are_in_the_hub_layout(arch_dir: tuple[str, Path]) -> None:
    arch, path = arch_dir
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    layers = "model.language_model.layers"
    linear = {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"}
    linear |= {"conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"}
    assert {f"{layers}.0.linear_attn.{k}" for k in linear} <= keys
    assert f"{layers}.1.self_attn.q_proj.weight" in keys
    assert not any(k.startswith(f"{layers}.1.linear_attn.") for k in keys)
    assert "model.visual.pos_embed.weight" in keys and "lm_head.weight" in keys
    assert not any("deepstack" in k for k in keys)
    if arch == "qwen3_5_moe":  # per-expert tensors, as the hub's Qwen3.5-MoE files
        mlp = f"{layers}.3.mlp"
        assert {f"{mlp}.experts.7.down_proj.weight", f"{mlp}.gate.weight"} <= keys
        assert {f"{mlp}.shared_expert.up_proj.weight", f"{mlp}.shared_expert_gate.weight"} <= keys


def test_loads_in_transformers_and_generates_with_an_image(arch_dir: tuple[str, Path]) -> None:
    arch, path = arch_dir
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert type(model) is CLASSES[arch]
    assert not any(info.values()), info
    model.eval()
    assert type(AutoImageProcessor.from_pretrained(path)).__name__.startswith(
        "Qwen2VLImageProcessor"
    )
    proc = processor(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    prompt = proc.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>Hi?" in prompt

    def answer(image: Image.Image) -> list[int]:
        enc = proc(text=[prompt], images=[image], return_tensors="pt")
        # 168x112 px rounds to 160x128: 10x8 patches of 16 px, 20 tokens after the 2x2 merge.
        assert enc["image_grid_thw"].tolist() == [[1, 8, 10]]
        assert int((enc["input_ids"] == model.config.image_token_id).sum()) == 20
        out = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        return out[0, enc["input_ids"].shape[1] :].tolist()

    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (112, 168, 3), np.uint8))
    first = answer(noise)
    assert answer(noise) == first  # greedy is deterministic
    assert len(set(first)) >= 5, first  # random weights, but not one repeated token
    assert answer(Image.new("RGB", (168, 112), (128, 128, 128))) != first  # the image counts


def test_cli_writes_byte_identical_files(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    """`iris tiny-model --arch qwen3_5_moe` reproduces the fixture's checkpoint exactly."""
    assert main_tiny_model(["--arch", "qwen3_5_moe", "--out", str(tmp_path)]) == 0

    def hashes(folder: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}

    assert hashes(tmp_path) == hashes(tiny_checkpoint("qwen3_5_moe"))


def test_iris_loads_qwen3_5(arch_dir: tuple[str, Path]) -> None:
    """Iris's own model code serves these checkpoints (its parity with transformers:
    tests/test_qwen3_5_model.py)."""
    arch, path = arch_dir
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    config = load_config(path)
    assert config.architecture == architecture and config.is_hybrid
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == IRIS_CLASSES[arch]
