"""Our Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE) model code against transformers, fp32 on the CPU.

The checkpoints are the project's tiny random-weight ones (`tests/conftest.py`), written by
transformers' `save_pretrained` in the hub key layout. Ours loads each folder through
`load_model`; transformers loads the same folder with `from_pretrained`. Vision features,
M-RoPE positions and logits must agree. Qwen2-VL's checkpoint ties lm_head, Qwen2.5-VL's
does not. Qwen3-VL's vision features include its DeepStack levels, compared level by level.
The MoE's expert layouts and routing have their own tests (tests/test_moe.py).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

from iris_serve.common.architectures import ARCHITECTURES
from iris_serve.scheduler.models.layers import SegmentPlan
from iris_serve.scheduler.models.mrope import mrope_positions
from iris_serve.scheduler.models.registry import load_model
from iris_serve.scheduler.models.vision_qwen2_5 import window_order
from tests.reference import SingleSequenceAttention, iter_safetensors

torch.set_num_threads(2)

# (height, width) in pixels: odd sizes; the first gives Qwen2.5-VL 3x5 windows
IMAGE_SIZES = [(333, 517), (97, 211), (250, 250)]
ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
# Measured max-abs-diff vs transformers is ~2e-5 on values up to ~14 (fp32 rounding: fused
# q/k/v and gate/up matmuls, the patch conv as a matmul); a real bug is off by O(1).
TOL = dict(atol=1e-4, rtol=1e-4)


def text_positions(start: int, count: int, rope_delta: int = 0) -> torch.Tensor:
    """M-RoPE positions `[3, count]` of text tokens `start ..` after the prompt's images:
    `index + rope_delta` on every axis."""
    return torch.arange(start + rope_delta, start + rope_delta + count).repeat(3, 1)


def _hf_model(model_dir: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=ARCHS)
def reference(request):
    """(arch, transformers model, checkpoint folder)."""
    folder = request.getfixturevalue(f"{request.param}_tiny")
    return request.param, _hf_model(folder), folder


@pytest.fixture(scope="module")
def ours(reference):
    return load_model(reference[2], torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def tokens(reference):
    """(image pad id, vision start id, vision end id); ids below `start` are plain text."""
    config = reference[1].config
    return config.image_token_id, config.vision_start_token_id, config.vision_end_token_id


@pytest.fixture(scope="module")
def images(reference):
    from transformers import AutoImageProcessor

    rng = np.random.default_rng(0)
    pil = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in IMAGE_SIZES]
    out = AutoImageProcessor.from_pretrained(reference[2])(images=pil, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _prompt(grid_thw: torch.Tensor, ids, seed: int = 1) -> tuple[list[int], list[tuple[int, int]]]:
    """Random text, then per image `<start> <pad>*n <end>` and more text."""
    image, start, end = ids
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    spans = []
    for t, h, w in grid_thw.tolist():
        tokens += [*torch.randint(0, start, (5,), generator=generator).tolist(), start]
        spans.append((len(tokens), t * h * w // 4))
        tokens += [image] * spans[-1][1] + [end]
    tokens += torch.randint(0, start, (7,), generator=generator).tolist()
    return tokens, spans


def _our_logits(model, tokens, spans, pixel_values=None, grid_thw=None) -> torch.Tensor:
    input_ids = torch.tensor(tokens)
    embeds = model.embed_tokens(input_ids)
    grids = [] if grid_thw is None else [tuple(g) for g in grid_thw.tolist()]
    deepstack = None
    if spans:
        is_image = input_ids == model.config.image_token_id
        main, levels = model.split_embeddings(model.encode_images(pixel_values, grid_thw))
        embeds[is_image] = main
        if model.deepstack_levels:
            deepstack = embeds.new_zeros(model.deepstack_levels, *embeds.shape)
            deepstack[:, is_image] = levels
    positions, _ = mrope_positions(len(tokens), spans, grids, model.config.spatial_merge_size)
    hidden = model(embeds, positions, SingleSequenceAttention(), deepstack)
    return model.compute_logits(hidden)


def _hf_logits(hf, tokens, pixel_values=None, grid_thw=None) -> torch.Tensor:
    input_ids = torch.tensor([tokens])
    kwargs = {}
    if pixel_values is not None:
        kwargs = dict(
            pixel_values=pixel_values,
            image_grid_thw=grid_thw,
            mm_token_type_ids=(input_ids == hf.config.image_token_id).int(),
        )
    return hf(input_ids=input_ids, **kwargs).logits[0]


@torch.no_grad()
def test_vision_tower_matches_transformers(reference, ours, images):
    arch, hf, _ = reference
    pixel_values, grid_thw = images
    features = hf.model.get_image_features(pixel_values, grid_thw)
    expected = torch.cat(features.pooler_output)
    got, got_levels = ours.split_embeddings(ours.encode_images(pixel_values, grid_thw))
    assert got.shape == (int(grid_thw.prod(-1).sum()) // 4, ours.config.hidden_size)
    torch.testing.assert_close(got, expected, **TOL)
    expected_levels = getattr(features, "deepstack_features", None) or []
    assert len(got_levels) == len(expected_levels) == ours.deepstack_levels
    for got_level, expected_level in zip(got_levels, expected_levels, strict=True):
        torch.testing.assert_close(got_level, torch.cat(expected_level), **TOL)
    if arch == "qwen2_5_vl":  # the test exercises several, partly filled windows
        _, cu = window_order([tuple(g) for g in grid_thw.tolist()], 2, 4)
        assert len(cu) - 1 > 2 * len(grid_thw)


@torch.no_grad()
def test_images_encode_the_same_alone_or_together(ours, images):
    """Chunk-aware encoding relies on an image's embedding not depending on its batch."""
    pixel_values, grid_thw = images
    together = ours.encode_images(pixel_values, grid_thw)
    parts = pixel_values.split(grid_thw.prod(-1).tolist())
    alone = torch.cat(
        [ours.encode_images(p, g[None]) for p, g in zip(parts, grid_thw, strict=True)]
    )
    torch.testing.assert_close(alone, together, **TOL)


@torch.no_grad()
def test_logits_with_images_match_transformers(reference, ours, images, tokens):
    _, hf, _ = reference
    pixel_values, grid_thw = images
    prompt, spans = _prompt(grid_thw, tokens)
    expected = _hf_logits(hf, prompt, pixel_values, grid_thw)
    got = _our_logits(ours, prompt, spans, pixel_values, grid_thw)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, **TOL)


@torch.no_grad()
def test_text_only_logits_match_transformers(reference, ours, tokens):
    _, hf, _ = reference
    prompt = torch.randint(0, tokens[1], (37,), generator=torch.Generator().manual_seed(3))
    prompt = prompt.tolist()
    torch.testing.assert_close(_our_logits(ours, prompt, []), _hf_logits(hf, prompt), **TOL)


@torch.no_grad()
def test_flat_batch_of_sequences_equals_separate_runs(ours):
    generator = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, 1000, (n,), generator=generator) for n in (11, 6))
    together = ours(
        ours.embed_tokens(torch.cat([a, b])),
        torch.cat([text_positions(0, 11), text_positions(0, 6)], dim=1),
        SingleSequenceAttention(seq_lens=[11, 6]),
    )
    alone = [
        ours(ours.embed_tokens(x), torch.arange(len(x)), SingleSequenceAttention()) for x in (a, b)
    ]
    torch.testing.assert_close(together, torch.cat(alone), **TOL)


def _layout(name: str, grid_thw: torch.Tensor, ids) -> list[int]:
    image, start, end = ids
    pads = [image] * (int(grid_thw[0].prod()) // 4)
    return {
        "middle": lambda: _prompt(grid_thw, ids)[0],
        "image_first": lambda: [start, *pads, end, 7, 8],
        "image_last": lambda: [1, 2, 3, start, *pads],
        "text_only": lambda: [5, 6, 7, 8],
    }[name]()


@pytest.mark.parametrize("layout", ["middle", "image_first", "image_last", "text_only"])
def test_mrope_positions_match_get_rope_index(reference, images, tokens, layout):
    _, hf, _ = reference
    grid_thw = images[1] if layout == "middle" else images[1][:1]
    prompt = _layout(layout, grid_thw, tokens)
    input_ids = torch.tensor([prompt])
    is_image = input_ids[0] == tokens[0]
    spans = _runs(is_image.tolist())
    grids = [tuple(g) for g in grid_thw.tolist()][: len(spans)]
    expected, expected_delta = hf.model.get_rope_index(
        input_ids, is_image[None].int(), image_grid_thw=grid_thw[: len(spans)]
    )
    positions, delta = mrope_positions(len(prompt), spans, grids, 2)
    assert positions.dtype == torch.int64
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(expected_delta)
    # the next token continues where transformers' decode step puts it
    assert torch.equal(
        text_positions(len(prompt), 1, delta)[:, 0],
        (len(prompt) + delta) * torch.ones(3, dtype=torch.long),
    )


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, value in enumerate([*mask, False]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            spans.append((start, i - start))
            start = None
    return spans


def test_mrope_positions_reject_mismatched_spans():
    with pytest.raises(ValueError, match="does not match grid"):
        mrope_positions(20, [(2, 5)], [(1, 4, 4)], 2)
    with pytest.raises(ValueError, match="overlaps"):
        mrope_positions(10, [(2, 4), (4, 4)], [(1, 4, 4), (1, 4, 4)], 2)


# ---------------------------------------------------------------- loading


def _logits_of(model_dir: Path) -> torch.Tensor:
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    tokens = list(range(40))
    with torch.no_grad():
        return _our_logits(model, tokens, [])


def _copy_config(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "config.json", target / "config.json")


# What each family's hub checkpoints name their weights (transformers' save_pretrained
# writes the same): Qwen2/2.5-VL the legacy flat layout, Qwen3-VL the nested one.
HUB_NAMES = {
    "qwen2_vl": ("model.embed_tokens.weight", "visual.merger.mlp.0.weight"),
    "qwen2_5_vl": ("model.embed_tokens.weight", "visual.merger.mlp.0.weight"),
    "qwen3_vl": (
        "model.language_model.embed_tokens.weight",
        "model.visual.merger.linear_fc1.weight",
    ),
    "qwen3_vl_moe": (
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        "model.language_model.layers.0.mlp.gate.weight",
    ),
}


def test_save_pretrained_writes_the_hub_layout(reference):
    arch, _, folder = reference
    names = {name for name, _ in iter_safetensors(folder)}
    assert set(HUB_NAMES[arch]) <= names


def _first_name(state: dict[str, torch.Tensor], part: str) -> str:
    return next(name for name in state if part in name)


@torch.no_grad()
def test_loads_transformers_state_dict_layout(reference, tmp_path):
    """The in-memory names (`model.language_model.*`, `model.visual.*`) load as well."""
    _, hf, folder = reference
    state = {
        k: v.contiguous()
        for k, v in hf.state_dict().items()
        if k != "lm_head.weight" or not hf.config.tie_word_embeddings
    }
    assert any(k.startswith("model.language_model.") for k in state)
    _copy_config(folder, tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    expected = _hf_logits(hf, list(range(40)))
    torch.testing.assert_close(_logits_of(tmp_path), expected, **TOL)


@torch.no_grad()
def test_loads_sharded_bf16_checkpoint(reference, tiny_checkpoint):
    arch, _, _ = reference
    sharded = tiny_checkpoint(arch, dtype="bfloat16", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert next(iter_safetensors(sharded))[1].dtype == torch.bfloat16
    expected = _hf_logits(_hf_model(sharded), list(range(40)))  # upcast by transformers too
    torch.testing.assert_close(_logits_of(sharded), expected, **TOL)


def test_tied_checkpoint_has_no_lm_head_and_reuses_embeddings(reference, ours):
    _, hf, folder = reference
    names = {name for name, _ in iter_safetensors(folder)}
    assert ("lm_head.weight" in names) == (not hf.config.tie_word_embeddings)
    assert (ours.lm_head is None) == hf.config.tie_word_embeddings


def test_missing_weight_is_named(reference, tmp_path):
    _, _, folder = reference
    _copy_config(folder, tmp_path)
    state = dict(iter_safetensors(folder))
    missing = [
        _first_name(state, "layers.1.self_attn.k_proj"),
        _first_name(state, "blocks.0.attn.qkv"),
    ]
    for name in missing:
        del state[name]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights") as error:
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert "layers.1.self_attn.k_proj" in str(error.value)
    assert "blocks.0.attn.qkv" in str(error.value)


def test_unexpected_weight_is_named(reference, tmp_path):
    _, _, folder = reference
    _copy_config(folder, tmp_path)
    state = dict(iter_safetensors(folder))
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected weights: model\.layers\.9\.mlp\.up_proj"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_untied_checkpoint_without_lm_head_fails(reference, tmp_path):
    _, _, folder = reference
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    state = {k: v for k, v in iter_safetensors(folder) if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights: lm_head\.weight"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_unknown_architecture_names_the_supported_ones(reference, tmp_path):
    _, _, folder = reference
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LlavaForConditionalGeneration"]
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration") as error:
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert all(name in str(error.value) for name in ARCHITECTURES)


def test_dummy_weights_build_without_a_checkpoint_file(reference, tmp_path):
    _, _, folder = reference
    _copy_config(folder, tmp_path)
    model = load_model(tmp_path, torch.bfloat16, "cpu", dummy_weights=True)
    assert model.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        hidden = model(
            model.embed_tokens(torch.arange(5)), torch.arange(5), SingleSequenceAttention()
        )
    assert hidden.shape == (5, 64) and torch.isfinite(hidden).all()


@pytest.mark.parametrize("max_scores", [1, 60, 1 << 24])
def test_segment_attention_equals_a_loop_over_segments(max_scores):
    """Empty and repeated-length segments, batched or one per call."""
    cu = [0, 5, 10, 15, 19, 19, 30]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, 2, 8, generator=generator) for _ in range(3))

    def one(a: int, b: int) -> torch.Tensor:
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        return F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)

    expected = torch.cat([one(a, b) for a, b in itertools.pairwise(cu) if b > a])
    plan = SegmentPlan(cu, torch.device("cpu"), max_scores=max_scores)
    torch.testing.assert_close(plan.attend(q, k, v), expected, **TOL)


def test_loading_reports_its_progress(qwen2_5_vl_tiny, monkeypatch, caplog):
    """A long load logs how far it is (here every tensor: the interval is set to 0)."""
    import logging

    from iris_serve.scheduler.models import loader
    from iris_serve.scheduler.models.registry import load_model

    monkeypatch.setattr(loader, "PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="iris.loader"):
        load_model(qwen2_5_vl_tiny, torch.float32, "cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "iris.loader"]
    percents = [float(line.split()[2].rstrip("%")) for line in lines[:-1]]
    assert len(percents) > 10 and percents == sorted(percents) and percents[-1] == 100.0
    assert lines[-1].startswith("loaded ") and "GiB of weights in" in lines[-1]
