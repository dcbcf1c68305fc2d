"""`iris tiny-model --like NAME`: published configs, random weights, both loaders agree.

No real-size weights are written here: the full configs are checked on the meta device
(names, shapes, parameter counts), and weights are written for Qwen2-VL-2B at its real
widths but one text layer and one vision block (~670 MB of bf16, the smallest honest
real-width checkpoint: the 151936 x 1536 embedding is most of it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.models.config import VLModelConfig
from iris_serve.scheduler.models.registry import model_class
from iris_serve.tiny_checkpoint import ARCHS, main_tiny_model
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


def family(*model_types: str) -> list[str]:
    return [name for name, config in KNOWN_CONFIGS.items() if config["model_type"] in model_types]


QWEN2 = family("qwen2_vl", "qwen2_5_vl")
QWEN3 = family("qwen3_vl", "qwen3_vl_moe")
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


@pytest.mark.parametrize("name", list(KNOWN_CONFIGS))
def test_full_size_tensors_fit_iris_model(name: str, tmp_path: Path) -> None:
    """Every tensor the generator would write, at full depth, on the meta device: Iris's
    loader finds each parameter it needs, nothing extra, every shape right; the total is
    the parameter count the hub shows."""
    folder = write_config(name, tmp_path)
    specs = tensor_specs(folder)
    billions = PUBLISHED[name][-1]
    assert round(sum(s.numel for s in specs) / 1e9, 2 if billions < 30 else 1) == billions
    assert ("lm_head.weight" in {s.name for s in specs}) != KNOWN_CONFIGS[name][
        "tie_word_embeddings"
    ]
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
