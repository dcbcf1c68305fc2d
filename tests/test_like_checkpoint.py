"""`iris tiny-model --like NAME`: published configs, random weights, both loaders agree.

No real-size weights are written here: the full configs are checked on the meta device
(names, shapes, parameter counts), and weights are written for Qwen2-VL-2B at its real
widths but one text layer and one vision block (~670 MB of bf16, the smallest honest
real-width checkpoint: the 151936 x 1536 embedding is most of it). Qwen3.5's embedding
alone is 248320 wide, so its checkpoints are written with the published table entry
narrowed (`narrowed`) and its real vocabulary and token ids, and read by transformers,
which Iris's model code does not load yet.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from iris_serve.common.architectures import ARCHITECTURES
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.models.config import VLModelConfig
from iris_serve.scheduler.models.registry import model_class
from iris_serve.tiny_checkpoint import ARCHS, main_tiny_model, reference_processor
from iris_serve.tiny_checkpoint.known_configs import KNOWN_CONFIGS
from iris_serve.tiny_checkpoint.like import like_config, resolve_name, tensor_specs
from iris_serve.tiny_checkpoint.shards import TensorSpec, write_sharded
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import assert_parity, chat_prompt, cpu_engine, make_image

TinyCheckpoint = Callable[..., Path]

torch.set_num_threads(2)

# Written down a second time, apart from the table, so a typo in either fails: (hidden,
# layers, heads, kv heads, intermediate, vocab, tied, vision out width, parameters in
# billions as the hub shows them).
PUBLISHED = {
    "Qwen2-VL-2B-Instruct": (1536, 28, 12, 2, 8960, 151936, True, 1536, 2.21),
    "Qwen2-VL-7B-Instruct": (3584, 28, 28, 4, 18944, 152064, False, 3584, 8.29),
    "Qwen2.5-VL-3B-Instruct": (2048, 36, 16, 2, 11008, 151936, True, 2048, 3.75),
    "Qwen2.5-VL-7B-Instruct": (3584, 28, 28, 4, 18944, 152064, False, 3584, 8.29),
    "Qwen2.5-VL-32B-Instruct": (5120, 64, 40, 8, 27648, 152064, False, 5120, 33.5),
    "Qwen3-VL-8B-Instruct": (4096, 36, 32, 8, 12288, 151936, False, 4096, 8.77),
    "Qwen3-VL-30B-A3B-Instruct": (2048, 48, 32, 4, 6144, 151936, False, 2048, 31.1),
}
# Qwen3.5's, apart: (hidden, layers, heads, kv heads, linear-attention key / value heads,
# MLP width (an expert's for MoE), experts, top-k, shared expert width, parameters in
# billions without the multi-token-prediction layer, which the generator leaves out: the
# 9B's hub total is 9.65).
PUBLISHED_QWEN3_5 = {
    "Qwen3.5-9B": (4096, 32, 16, 4, 16, 32, 12288, None, None, None, 9.41),
    "Qwen3.5-35B-A3B": (2048, 40, 16, 2, 16, 32, 512, 256, 8, 512, 35.1),
}
PUBLISHED_QWEN3_5_IDS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}
# Where Qwen3.5's tokenizer has them.
QWEN3_5_TOKENS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<|vision_start|>": 248053,
    "<|vision_end|>": 248054,
    "<|vision_pad|>": 248055,
    "<|image_pad|>": 248056,
    "<|video_pad|>": 248057,
}


def family(*model_types: str) -> list[str]:
    return [name for name, config in KNOWN_CONFIGS.items() if config["model_type"] in model_types]


QWEN2 = family("qwen2_vl", "qwen2_5_vl")
QWEN3 = family("qwen3_vl", "qwen3_vl_moe")
QWEN3_5 = family("qwen3_5", "qwen3_5_moe")
# The known configs whose architecture Iris's own model code loads.
IRIS_LOADS = [name for name, c in KNOWN_CONFIGS.items() if c["architectures"][0] in ARCHITECTURES]
SPECIAL_IDS = {
    "bos_token_id": "<|endoftext|>",
    "eos_token_id": "<|im_end|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}


def write_config(name: str, folder: Path, **kwargs: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(like_config(name, **kwargs)))  # type: ignore[arg-type]
    return folder


def _read_as_published(name: str, folder: Path):
    """transformers' and Iris's reading of `folder`'s config.json, both checked against
    PUBLISHED[name]; returns (transformers config, Iris config)."""
    hidden, layers, heads, kv_heads, intermediate, vocab, tied, vision_out, _ = PUBLISHED[name]
    config = AutoConfig.from_pretrained(folder)
    text = config.text_config
    assert (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.intermediate_size,
        text.vocab_size,
        config.tie_word_embeddings,
    ) == (hidden, layers, heads, kv_heads, intermediate, vocab, tied)
    assert vision_out == hidden  # the merger feeds the LM
    assert config.image_token_id == 151655 and config.vision_start_token_id == 151652
    assert heads % kv_heads == 0
    assert vocab >= 151657  # the tokenizer's specials fit in the embedding
    ours = VLModelConfig.from_pretrained(folder)
    assert (ours.hidden_size, ours.num_layers, ours.num_kv_heads) == (hidden, layers, kv_heads)
    assert (ours.vision.out_hidden_size, ours.tie_word_embeddings) == (hidden, tied)
    assert ours.dtype == "bfloat16"
    return config, ours


@pytest.mark.parametrize("name", QWEN2)
def test_config_parses_and_matches_the_published_numbers(name: str, tmp_path: Path) -> None:
    config, _ = _read_as_published(name, write_config(name, tmp_path))
    hidden, _, heads, _, _, _, _, vision_out, _ = PUBLISHED[name]
    text, vision = config.text_config, config.vision_config
    assert text.rope_parameters["rope_theta"] == KNOWN_CONFIGS[name]["rope_theta"] == 1e6
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    # cross-checks that catch a typo in one field
    head_dim = hidden // heads
    assert head_dim * heads == hidden and head_dim == 128
    assert 2 * sum(text.rope_parameters["mrope_section"]) == head_dim
    assert (vision.depth, vision.num_heads, vision.patch_size) == (32, 16, 14)
    assert (vision.spatial_merge_size, vision.temporal_patch_size) == (2, 2)
    if config.model_type == "qwen2_5_vl":
        assert (vision.hidden_size, vision.out_hidden_size) == (1280, vision_out)
        assert vision.intermediate_size == (3456 if "32B" in name else 3420)
        assert vision.window_size == 112 and vision.fullatt_block_indexes == [7, 15, 23, 31]
    else:
        assert (vision.embed_dim, vision.mlp_ratio, vision.hidden_size) == (1280, 4, vision_out)


@pytest.mark.parametrize("name", QWEN3)
def test_qwen3_config_parses_and_matches_the_published_numbers(name: str, tmp_path: Path) -> None:
    """The nested layout, read by transformers and by Iris to the same shape."""
    config, ours = _read_as_published(name, write_config(name, tmp_path))
    text, vision = config.text_config, config.vision_config
    assert text.head_dim == 128 and text.rope_parameters["rope_theta"] == 5e6
    assert text.rope_parameters["mrope_section"] == [24, 20, 20]
    assert (vision.depth, vision.hidden_size, vision.patch_size) == (27, 1152, 16)
    assert vision.deepstack_visual_indexes == [8, 16, 24]
    assert (ours.head_dim, ours.mrope_section, ours.mrope_interleaved) == (128, (24, 20, 20), True)
    assert (ours.rope_theta, ours.deepstack_levels) == (5e6, 3)
    if "A3B" in name:
        assert ours.moe is not None
        assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.intermediate_size) == (128, 8, 768)
        assert all(ours.moe.is_moe_layer(i) for i in range(ours.num_layers))
    else:
        assert ours.moe is None
    shrunk = like_config(name, num_layers=2, vision_depth=9)
    assert shrunk["vision_config"]["deepstack_visual_indexes"] == [8]
    assert like_config(name, num_layers=2)["vision_config"]["deepstack_visual_indexes"] == [8, 16]


def test_every_known_config_is_tested_with_its_family() -> None:
    assert sorted(QWEN2 + QWEN3 + QWEN3_5) == sorted(KNOWN_CONFIGS)
    assert sorted([*PUBLISHED, *PUBLISHED_QWEN3_5]) == sorted(KNOWN_CONFIGS)


@pytest.mark.parametrize("name", QWEN3_5)
def test_qwen3_5_config_parses_and_matches_the_published_numbers(name: str, tmp_path: Path):
    """transformers' Qwen3.5 classes read the config.json the generator writes to the
    published shape: hybrid layers, gated attention's heads, Gated DeltaNet's, the ViT
    without DeepStack, the ids of Qwen3.5's tokenizer."""
    published = PUBLISHED_QWEN3_5[name]
    hidden, layers, heads, kv_heads, hk, hv, mlp, experts, top_k, shared, _ = published
    config = AutoConfig.from_pretrained(write_config(name, tmp_path))
    text, vision = config.text_config, config.vision_config
    assert config.model_type == KNOWN_CONFIGS[name]["model_type"]
    assert (text.hidden_size, text.num_hidden_layers) == (hidden, layers)
    assert (text.num_attention_heads, text.num_key_value_heads) == (heads, kv_heads)
    assert text.head_dim == 256
    assert text.layer_types == [
        "full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)
    ]
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (hk, hv)
    assert (text.linear_key_head_dim, text.linear_value_head_dim) == (128, 128)
    assert text.linear_conv_kernel_dim == 4
    rope = text.rope_parameters
    assert (rope["rope_theta"], rope["partial_rotary_factor"]) == (1e7, 0.25)
    assert rope["mrope_section"] == [11, 11, 10] and rope["mrope_interleaved"]
    assert 2 * sum(rope["mrope_section"]) == text.head_dim * rope["partial_rotary_factor"]
    assert (text.vocab_size, text.eos_token_id) == (248320, 248044)
    assert not config.tie_word_embeddings
    assert {key: getattr(config, key) for key in PUBLISHED_QWEN3_5_IDS} == PUBLISHED_QWEN3_5_IDS
    assert (vision.depth, vision.hidden_size, vision.patch_size) == (27, 1152, 16)
    assert (vision.spatial_merge_size, vision.temporal_patch_size) == (2, 2)
    assert vision.out_hidden_size == hidden
    assert KNOWN_CONFIGS[name]["vision_config"]["deepstack_visual_indexes"] == []
    if experts is None:
        assert text.intermediate_size == mlp and not hasattr(text, "num_experts")
    else:
        assert (text.num_experts, text.num_experts_per_tok) == (experts, top_k)
        assert (text.moe_intermediate_size, text.shared_expert_intermediate_size) == (mlp, shared)
    shrunk = like_config(name, num_layers=6)["text_config"]
    assert shrunk["layer_types"] == text.layer_types[:6] and shrunk["num_hidden_layers"] == 6


@pytest.mark.parametrize("name", list(KNOWN_CONFIGS))
def test_full_size_tensors_are_the_published_count(name: str, tmp_path: Path) -> None:
    """Every tensor the generator would write, at full depth, on the meta device: the total
    is the parameter count the hub shows, lm_head is there unless tied."""
    specs = tensor_specs(write_config(name, tmp_path))
    billions = (PUBLISHED.get(name) or PUBLISHED_QWEN3_5[name])[-1]
    assert round(sum(s.numel for s in specs) / 1e9, 2 if billions < 30 else 1) == billions
    assert ("lm_head.weight" in {s.name for s in specs}) != KNOWN_CONFIGS[name][
        "tie_word_embeddings"
    ]


@pytest.mark.parametrize("name", IRIS_LOADS)
def test_full_size_tensors_fit_iris_model(name: str, tmp_path: Path) -> None:
    """Iris's loader finds each parameter it needs among the tensors the generator would
    write, nothing extra, every shape right (on the meta device)."""
    folder = write_config(name, tmp_path)
    specs = tensor_specs(folder)
    config = VLModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
        model.load_weights((s.name, torch.empty(s.shape)) for s in specs)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensors_are_the_ones_transformers_saves(arch: str, tiny_checkpoint: TinyCheckpoint):
    """For each family's tiny checkpoint, written by transformers' `save_pretrained`: the
    tensors the generator would write for its config.json have the same names and shapes
    (Qwen2's renaming, Qwen3-VL-MoE's fused experts, Qwen3.5-MoE's per-expert ones), and
    every vector it fills with a constant holds that constant after transformers' own init
    (Qwen3.5's zero-centred norms). `A_log`, which transformers draws, is 0 here."""
    folder = tiny_checkpoint(arch)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    shapes = {name: tuple(tensor.shape) for name, tensor in saved.items()}
    if arch == "qwen3_vl_moe":  # transformers 5 saves fused experts as it holds them, [E,
        # out, in]; the hub's files, and so the generator, have them [E, in, out]
        shapes = {k: (s[0], s[2], s[1]) if ".experts." in k else s for k, s in shapes.items()}
    specs = tensor_specs(folder)
    assert {spec.name: spec.shape for spec in specs} == shapes
    for spec in specs:
        if spec.init != "normal" and not spec.name.endswith(".A_log"):
            fill = 1.0 if spec.init == "ones" else 0.0
            assert torch.all(saved[spec.name] == fill), spec


def test_names_resolve_with_or_without_prefix_and_suffix() -> None:
    for alias in ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL-7B", "qwen/qwen2.5-vl-7b"):
        assert resolve_name(alias) == "Qwen2.5-VL-7B-Instruct"
    with pytest.raises(ValueError, match="unknown model"):
        resolve_name("Qwen2-VL-72B")
    shrunk = like_config("Qwen2.5-VL-3B", num_layers=2, vision_depth=9, dtype="float16")
    assert (shrunk["num_hidden_layers"], shrunk["vision_config"]["depth"]) == (2, 9)
    assert shrunk["vision_config"]["fullatt_block_indexes"] == [7]
    assert shrunk["torch_dtype"] == "float16"
    assert KNOWN_CONFIGS["Qwen2.5-VL-3B-Instruct"]["num_hidden_layers"] == 36  # not mutated
    with pytest.raises(ValueError, match="between 1 and 28"):
        like_config("Qwen2-VL-2B", num_layers=29)


def test_shards_are_seeded_per_tensor_and_bounded(tmp_path: Path) -> None:
    specs = [
        TensorSpec("a.weight", (64, 32), "normal", 0.5),
        TensorSpec("a.bias", (64,), "zeros"),
        TensorSpec("norm.weight", (32,), "ones"),
        TensorSpec("b.weight", (300, 40), "normal", 0.1),
    ]
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    write_sharded(specs, tmp_path / "x", torch.bfloat16, 7, 4100)
    write_sharded(specs[::-1], tmp_path / "y", torch.bfloat16, 7, 1 << 30)
    index = json.loads((tmp_path / "x" / "model.safetensors.index.json").read_text())
    # a.weight (4096 B) fills shard 1; b.weight (24000 B > 4100) gets a shard of its own
    assert {k: v[9:11] for k, v in index["weight_map"].items()} == {
        "a.weight": "01",
        "a.bias": "02",
        "norm.weight": "02",
        "b.weight": "03",
    }
    tensors = {}
    for folder in ("x", "y"):
        for shard in sorted((tmp_path / folder).glob("model-*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                tensors.update({(folder, k): f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    for spec in specs:  # same values whatever the order and the sharding
        assert torch.equal(tensors[("x", spec.name)], tensors[("y", spec.name)])
        assert tensors[("x", spec.name)].shape == spec.shape
    assert tensors[("x", "b.weight")].float().std().item() == pytest.approx(0.1, rel=0.05)
    assert torch.all(tensors[("x", "norm.weight")] == 1) and torch.all(
        tensors[("x", "a.bias")] == 0
    )
    assert not torch.equal(tensors[("x", "a.weight")][:32], tensors[("x", "a.weight")][32:])


@pytest.fixture(scope="module")
def shrunk_2b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-VL-2B's widths, one text layer, one vision block, bf16, through the CLI."""
    out = tmp_path_factory.mktemp("like") / "qwen2-vl-2b-l1"
    args = ["--like", "Qwen/Qwen2-VL-2B-Instruct", "--out", str(out), "--num-layers", "1"]
    assert main_tiny_model([*args, "--vision-depth", "1", "--max-shard-size", "400MB"]) == 0
    return out


def test_shrunk_checkpoint_is_hub_shaped(shrunk_2b: Path) -> None:
    stamp = json.loads((shrunk_2b / "iris_tiny_checkpoint.json").read_text())
    assert stamp["like"] == "Qwen2-VL-2B-Instruct" and stamp["exact"] is False
    index = json.loads((shrunk_2b / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    # vision tower | the 466 MB embedding alone (over the 400 MB limit) | the decoder layer
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    stored: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(shrunk_2b / shard), "pt") as f:
            names = list(f.keys())
            stored.update({name: shard for name in names})
            assert len(names) == 1 or (shrunk_2b / shard).stat().st_size <= 400e6
            assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(
        (shrunk_2b / s).stat().st_size for s in shards
    ) - sum(_header_bytes(shrunk_2b / s) for s in shards)
    # the tokenizer's specials are where config.json says
    config = json.loads((shrunk_2b / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(shrunk_2b)
    for key, token in SPECIAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == config[key], key
    assert len(tokenizer) == 151657 <= config["vocab_size"]
    assert tokenizer.decode([5000]).startswith(" ")  # a filler word, not an error


def _header_bytes(path: Path) -> int:
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_shrunk_checkpoint_greedy_parity_with_transformers(shrunk_2b: Path) -> None:
    """Transformers loads every weight (none missing, none unexpected) and its greedy tokens
    equal Iris's, fp32 on both sides, for a text prompt and an image prompt."""
    _, info = AutoModelForImageTextToText.from_pretrained(
        shrunk_2b, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    builder = PromptBuilder(shrunk_2b)
    prompts = [
        chat_prompt(builder, "Write a short poem about the sea."),
        chat_prompt(builder, "What is here?", [make_image(56, 56, seed=1)]),
    ]
    outputs = cpu_engine(shrunk_2b).generate(prompts, Sampling(temperature=0.0, max_tokens=6))
    assert len(set(outputs[0])) > 1  # not a constant model
    assert_parity(shrunk_2b, prompts, outputs, 6)


def narrowed(name: str) -> dict[str, Any]:
    """`name`'s table entry at toy widths and depth (its first full-attention layer and the
    linear ones before it; a few experts), keeping the published vocabulary, token ids and
    partial interleaved M-RoPE, so that the checkpoint costs megabytes."""
    config = copy.deepcopy(KNOWN_CONFIGS[name])
    text, vision = config["text_config"], config["vision_config"]
    text.update(
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=text["layer_types"][:4],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
    )
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 1, 1]}
    if "num_experts" in text:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        text.update(shared_expert_intermediate_size=48)
    else:
        text["intermediate_size"] = 96
    vision.update(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)
    vision.update(out_hidden_size=64, num_position_embeddings=64)
    return config


@pytest.mark.parametrize("name", QWEN3_5)
def test_narrowed_qwen3_5_checkpoint_loads_and_runs_in_transformers(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI writes a narrowed Qwen3.5 table entry with the published vocabulary: the
    tokenizer has its specials at Qwen3.5's ids, transformers loads every weight (Qwen3.5-MoE's
    per-expert tensors included), and its forward on a text and an image prompt is finite
    and not constant."""
    monkeypatch.setitem(KNOWN_CONFIGS, name, narrowed(name))
    out = tmp_path / "narrow"
    assert main_tiny_model(["--like", name, "--out", str(out), "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config == like_config(name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN3_5_TOKENS} == (
        QWEN3_5_TOKENS
    )
    assert len(tokenizer) == 248058 <= config["text_config"]["vocab_size"]

    model, info = AutoModelForImageTextToText.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    proc = reference_processor(out)
    answers = []
    for images in ([], [make_image(64, 48, seed=1)]):
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Hi?"}]
        messages = [{"role": "user", "content": content}]
        prompt = proc.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        enc = proc(text=[prompt], images=images or None, return_tensors="pt")
        with torch.no_grad():
            logits = model(**enc).logits
        assert torch.isfinite(logits).all()
        generated = model.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        answers.append(generated[0, enc["input_ids"].shape[1] :].tolist())
    assert len(set(answers[0])) > 1 and answers[0] != answers[1], answers
