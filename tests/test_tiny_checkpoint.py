"""The generated checkpoints load through transformers exactly like hub checkpoints."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
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
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

from iris_serve.tiny_checkpoint import (
    builtin_checkpoint,
    generate_checkpoint,
    main_tiny_model,
    reference_processor,
)
from iris_serve.tiny_checkpoint.tokenizer import SPECIAL_TOKENS
from tests.reference import make_image

TinyCheckpoint = Callable[..., Path]
REPO_ROOT = Path(__file__).resolve().parents[1]
ARCH_CLASSES = {
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
}


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl"])
def arch_dir(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(f"{request.param}_tiny")


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def every_arch_dir(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """Qwen3-VL's own config, weights and processor are checked in their own test below."""
    return request.param, request.getfixturevalue(f"{request.param}_tiny")


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def chat(tokenizer: PreTrainedTokenizerBase, content: str | list[dict]) -> str:
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_layout_is_the_hub_layout(every_arch_dir: tuple[str, Path]) -> None:
    arch, path = every_arch_dir
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
    } <= names
    pre = json.loads((path / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor"
    patch = 16 if arch.startswith("qwen3") else 14
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (patch, 2, 2)


def test_tokenizer_special_tokens_are_single_ids(arch_dir: tuple[str, Path]) -> None:
    _, path = arch_dir
    tok = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert len(tok) == config.text_config.vocab_size
    ids = [tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids), ids
    flat = [i[0] for i in ids]
    assert flat == list(range(flat[0], flat[0] + len(SPECIAL_TOKENS)))  # Qwen order, contiguous
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert config.text_config.eos_token_id == tok.eos_token_id
    assert config.text_config.pad_token_id == tok.pad_token_id
    # Inside text, special tokens stay whole; any other text (all of UTF-8) round-trips.
    text = "Hi<|im_start|>user\nNaïve café 你好 🎉 def f(x): return x**2<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    im_start = ids.index(tok.convert_tokens_to_ids("<|im_start|>"))
    assert tok.decode(ids[:im_start]) == "Hi"
    assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
    assert tok.decode(ids) == text


def test_chat_template_renders_images(arch_dir: tuple[str, Path]) -> None:
    _, path = arch_dir
    tok = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    content = [
        {"type": "image"},
        {"type": "text", "text": "Compare with"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    text = chat(tok, content)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Compare with"
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat(tok, "plain").endswith("<|im_start|>user\nplain<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    triple = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    starts = [i for i in range(len(ids)) if ids[i : i + 3] == triple]
    assert len(starts) == 2
    assert ids.count(config.image_token_id) == 2


def test_reference_processor_expands_image_tokens(arch_dir: tuple[str, Path]) -> None:
    _, path = arch_dir
    proc = reference_processor(path)
    # Without torchvision, transformers falls back to the PIL backend from the same file.
    backend = "" if importlib.util.find_spec("torchvision") else "Pil"
    assert (
        type(AutoImageProcessor.from_pretrained(path)).__name__ == f"Qwen2VLImageProcessor{backend}"
    )
    image = Image.new("RGB", (1280, 720), (200, 30, 30))
    text = chat(proc.tokenizer, [{"type": "image"}, {"type": "text", "text": "What is it?"}])
    out = proc(text=[text], images=[image], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 52, 92]]
    assert tuple(out["pixel_values"].shape) == (52 * 92, 3 * 2 * 14 * 14)
    assert int((out["input_ids"] == AutoConfig.from_pretrained(path).image_token_id).sum()) == 1196


def test_config_round_trips_with_our_values(arch_dir: tuple[str, Path]) -> None:
    arch, path = arch_dir
    config = AutoConfig.from_pretrained(path)
    text, vision = config.text_config, config.vision_config
    assert config.model_type == arch
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (64, 4, 2)
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    merger_out = vision.hidden_size if arch == "qwen2_vl" else vision.out_hidden_size
    assert merger_out == text.hidden_size
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (14, 2, 2)
    if arch == "qwen2_5_vl":
        assert vision.window_size == 112
        assert 0 < len(vision.fullatt_block_indexes) < vision.depth  # both attention kinds
    tok = AutoTokenizer.from_pretrained(path)
    for name, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert getattr(config, name) == tok.convert_tokens_to_ids(token), name
    # The written json nests the text parameters (transformers 5 layout).
    raw = json.loads((path / "config.json").read_text())
    assert raw["text_config"]["hidden_size"] == 64 and "hidden_size" not in raw


def test_model_loads_every_weight(arch_dir: tuple[str, Path]) -> None:
    arch, path = arch_dir
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert type(model) is ARCH_CLASSES[arch]
    assert not any(info.values()), info
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # Hub names (as real Qwen2-VL checkpoints): `model.*` text, `visual.*` ViT.
    assert "model.embed_tokens.weight" in keys and "visual.patch_embed.proj.weight" in keys
    tied = arch == "qwen2_vl"
    assert ("lm_head.weight" in keys) is not tied
    embed = model.get_input_embeddings().weight
    assert (model.lm_head.weight.data_ptr() == embed.data_ptr()) is tied


def test_sharded_bf16_checkpoint_loads(
    tiny_checkpoint: TinyCheckpoint, qwen2_5_vl_tiny: Path
) -> None:
    path = tiny_checkpoint("qwen2_5_vl", dtype="bfloat16", max_shard_size="200KB")
    assert not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((path / s).exists() for s in shards)
    model, info = ARCH_CLASSES["qwen2_5_vl"].from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    assert model.dtype == torch.bfloat16
    # Same seed: the bf16 weights are the fp32 weights rounded.
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(path / index["weight_map"][name]), "pt") as f:
        bf16 = f.get_tensor(name)
    with safe_open(str(qwen2_5_vl_tiny / "model.safetensors"), "pt") as f:
        fp32 = f.get_tensor(name)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.to(torch.bfloat16))


def test_generation_is_deterministic_across_processes(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """The CLI, run in a fresh process (BPE retrained), writes byte-identical files."""
    pythonpath = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in pythonpath if p)}
    cmd = "import sys; from iris_serve.tiny_checkpoint import main_tiny_model as m; sys.exit(m())"
    out = tmp_path / "again"
    run = subprocess.run(
        [sys.executable, "-c", cmd, "--arch", "qwen2_vl", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(out)
    assert file_hashes(out) == file_hashes(qwen2_vl_tiny)


def test_seed_changes_weights_only(tiny_checkpoint: TinyCheckpoint, qwen2_vl_tiny: Path) -> None:
    other = file_hashes(tiny_checkpoint("qwen2_vl", seed=1))
    base = file_hashes(qwen2_vl_tiny)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


def test_regenerating_into_a_folder_replaces_the_weight_layout(tmp_path: Path) -> None:
    generate_checkpoint("qwen2_5_vl", tmp_path, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    generate_checkpoint("qwen2_5_vl", tmp_path, dtype="float16")
    weights = sorted(p.name for p in tmp_path.glob("model*"))
    assert weights == ["model.safetensors"]  # no stale shards or index left to mislead loaders
    model = AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert model.dtype == torch.float16


def test_leaves_the_callers_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    generate_checkpoint("qwen2_vl", tmp_path, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_greedy_generation_is_varied(every_arch_dir: tuple[str, Path]) -> None:
    """Random weights must not make greedy parity tests trivial (one repeated token)."""
    _, path = every_arch_dir
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    proc = reference_processor(path)
    outputs, gaps = [], []
    for prompt in ["Describe a cat.", "What is 17 x 23?"]:
        enc = proc(text=[chat(proc.tokenizer, prompt)], return_tensors="pt")
        gen = model.generate(
            **enc,
            max_new_tokens=30,
            min_new_tokens=30,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = gen.sequences[0, enc["input_ids"].shape[1] :].tolist()
        assert len(set(new)) >= 10, new
        outputs.append(new)
        gaps += [float(s[0].topk(2).values.diff().abs()) for s in gen.scores]
    assert outputs[0] != outputs[1]
    # top-1/top-2 logit gaps: clear on typical steps, near-ties rare.
    assert float(np.median(gaps)) > 1e-2
    assert float(np.mean(np.array(gaps) < 1e-3)) <= 0.05

    def first_tokens(image: Image.Image) -> list[int]:
        content = [{"type": "image"}, {"type": "text", "text": "Describe."}]
        enc = proc(text=[chat(proc.tokenizer, content)], images=[image], return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=5, do_sample=False)
        return out[0, enc["input_ids"].shape[1] :].tolist()

    noise = np.random.default_rng(0).integers(0, 256, (112, 168, 3), dtype=np.uint8)
    gray = Image.new("RGB", (168, 112), (128, 128, 128))
    assert first_tokens(Image.fromarray(noise)) != first_tokens(gray)


def test_builtin_checkpoint_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IRIS_CACHE_DIR", str(tmp_path))
    said: list[str] = []
    path = builtin_checkpoint("qwen2_vl", "tiny", progress=said.append)
    assert path == tmp_path / "models" / "qwen2_vl-tiny-seed0"
    assert (path / "model.safetensors").exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]  # no temp left
    assert (
        len(said) == 2
        and f"into {path} " in said[0]
        and said[1].startswith(f"generated {path.name}")
    )
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert builtin_checkpoint("qwen2_vl", "tiny", progress=said.append) == path
    assert len(said) == 2  # a cached checkpoint is found silently
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    # A cache from another generator version is rebuilt in place.
    stamp = path / "iris_tiny_checkpoint.json"
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "generator_version": -1}))
    assert builtin_checkpoint("qwen2_vl", "tiny") == path
    assert json.loads(stamp.read_text())["generator_version"] != -1
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]


def test_rejects_unknown_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="arch"):
        generate_checkpoint("llama", tmp_path)
    with pytest.raises(ValueError, match="size"):
        generate_checkpoint("qwen2_vl", tmp_path, size="huge")
    with pytest.raises(ValueError, match="dtype"):
        generate_checkpoint("qwen2_vl", tmp_path, dtype="int8")
    with pytest.raises(SystemExit) as exc:
        main_tiny_model(["--arch", "llama", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_qwen3_vl_checkpoint_has_deepstack_interleaved_mrope_and_its_processor(
    qwen3_vl_tiny: Path,
) -> None:
    config = AutoConfig.from_pretrained(qwen3_vl_tiny)
    text, vision = config.text_config, config.vision_config
    assert config.model_type == "qwen3_vl" and config.tie_word_embeddings
    assert (text.head_dim, text.attention_bias) == (16, False)
    rope = text.rope_parameters
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) == text.head_dim // 2
    assert (vision.patch_size, vision.spatial_merge_size, vision.out_hidden_size) == (16, 2, 64)
    assert 2 <= len(vision.deepstack_visual_indexes) <= text.num_hidden_layers
    assert max(vision.deepstack_visual_indexes) < vision.depth
    pre = json.loads((qwen3_vl_tiny / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["image_mean"], pre["image_std"]) == (16, [0.5] * 3, [0.5] * 3)
    model, info = AutoModelForImageTextToText.from_pretrained(
        qwen3_vl_tiny, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert not any(info.values()), info
    proc = reference_processor(qwen3_vl_tiny)
    image = make_image(1280, 720)
    prompt = chat(proc.tokenizer, [{"type": "image"}, {"type": "text", "text": "What is it?"}])
    enc = proc(text=[prompt], images=[image], return_tensors="pt")
    grid = enc["image_grid_thw"].tolist()[0]  # 1280x720 scaled to the 1024x1024 px budget
    assert grid[0] == 1 and grid[1] * grid[2] * 256 <= 1024 * 1024
    assert tuple(enc["pixel_values"].shape) == (grid[1] * grid[2], 3 * 2 * 16 * 16)
    assert int((enc["input_ids"] == config.image_token_id).sum()) == grid[1] * grid[2] // 4
    # Greedy answers must vary for parity tests to mean something. A random model's answer
    # flattens as image tokens grow (at 1280x720, 880 of them, one token repeats), so the
    # check uses the size the parity tests use (300 image tokens at most).
    enc = proc(text=[prompt], images=[make_image(320, 240)], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    assert len(set(out[0, enc["input_ids"].shape[1] :].tolist())) >= 8
