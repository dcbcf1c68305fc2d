"""Our Qwen3.5 (dense and MoE) against transformers, fp32 on the CPU, on the tiny hybrid
checkpoints (`iris tiny-model --arch qwen3_5|qwen3_5_moe`: linear, full, linear, full
layers; Hv ≠ Hk and dk ≠ dv in the linear ones).

Ours runs as the scheduler will drive it: a `LinearStates` pool for the linear layers'
state, paged KV through the `sdpa` backend for the full ones, one `LinearStepContext` per
step. Logits of one call equal transformers'; a prompt prefilled in chunks (ends at a
multiple of the delta rule's 64-token chunk, at an unaligned token, a one-token chunk, one
inside the image) ends with the same logits and states; batched decode steps of two
sequences continue as transformers' greedy `generate`; a capture inside a chunk holds the
state of exactly that many tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from iris_serve.scheduler.attention import SequenceChunk
from iris_serve.scheduler.attention.sdpa import SdpaBackend
from iris_serve.scheduler.hybrid.linear_state import (
    LinearStates,
    LinearStepContext,
    SequenceStates,
)
from iris_serve.scheduler.kv.kv_cache import KVCache, KVLayout
from iris_serve.scheduler.models.config import VLModelConfig
from iris_serve.scheduler.models.mrope import mrope_positions
from iris_serve.scheduler.models.qwen3_5 import Qwen3_5ForCausalLM
from iris_serve.scheduler.models.registry import load_model
from tests.reference import SingleSequenceAttention, iter_safetensors

torch.set_num_threads(2)

TinyCheckpoint = Callable[..., Path]
# As tests/test_models.py: fp32 rounding of fused projections, far below a real bug's O(1).
TOL = dict(atol=1e-4, rtol=1e-4)
# Other chunkings than one call: chunk ends off the delta rule's 64-token grid, attention
# over cached KV and expert batches of other sizes round differently (~1e-7 relative), and
# these random weights amplify that: a 1e-7 relative change of the MoE model's input
# embeddings moves its logits by ~1.5e-4. Still far below a real bug's O(1).
CHUNKED_TOL = dict(atol=1e-3, rtol=1e-4)
# A capture against a run of exactly that many tokens: only the prefix's attention and
# expert batches round differently.
CAPTURE_TOL = dict(atol=1e-5, rtol=1e-5)
IMAGE_SIZE = (256, 320)  # (height, width) px: a 16 x 20 patch grid, 80 tokens after merging
PAGE_SIZE = 16


@dataclass
class Prompt:
    """Token ids with, for the image prompt, the image's embeddings already spliced in."""

    tokens: list[int]
    embeds: torch.Tensor  # [T, H]
    positions: torch.Tensor  # [3, T]
    rope_delta: int
    hf_inputs: dict[str, torch.Tensor]  # what transformers' forward needs beside input_ids


@dataclass
class Sequence:
    """A sequence in the runner: its state slot, KV pages and tokens run so far."""

    slot: int
    pages: list[int]
    done: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # last row of each step


class Runner:
    """Drives the model like the scheduler: paged KV (sdpa) and a `LinearStates` pool."""

    def __init__(self, model: Qwen3_5ForCausalLM, num_slots: int = 8) -> None:
        config, dtype, cpu = model.config, model.dtype, torch.device("cpu")
        self.model = model
        self.kv = KVCache(KVLayout.of(config, PAGE_SIZE, dtype), 64, cpu)
        self.backend = SdpaBackend(self.kv, cpu)
        self.states = LinearStates(config.linear_state_layout(dtype), num_slots, cpu)

    def sequence(self, slot: int, max_tokens: int = 200) -> Sequence:
        self.states.clear(slot)
        return Sequence(slot, self.kv.pool.allocate(-(-max_tokens // PAGE_SIZE)))

    @torch.no_grad()
    def step(
        self,
        parts: list[tuple[Sequence, torch.Tensor, torch.Tensor]],
        captures: dict[int, tuple[tuple[int, int], ...]] | None = None,
    ) -> list[torch.Tensor]:
        """One forward over `(sequence, embeds [n, H], positions [3, n])` parts, flat in
        that order; `captures` by slot. Returns each part's logits `[n, vocab]`."""
        captures = captures or {}
        chunks = [SequenceChunk.of(s.pages, s.done, len(e)) for s, e, _ in parts]
        sequences = [SequenceStates(s.slot, len(e), captures.get(s.slot, ())) for s, e, _ in parts]
        hidden = self.model(
            torch.cat([e for _, e, _ in parts]),
            torch.cat([p for _, _, p in parts], dim=1),
            self.backend.prepare(chunks),
            states=LinearStepContext.of(self.states, sequences),
        )
        logits = self.model.compute_logits(hidden).split([len(e) for _, e, _ in parts])
        for (sequence, embeds, _), rows in zip(parts, logits, strict=True):
            sequence.done += len(embeds)
            sequence.logits.append(rows[-1])
        return list(logits)

    def prefill(self, sequence: Sequence, prompt: Prompt, chunk_sizes: list[int]) -> None:
        for size in chunk_sizes:
            rows = slice(sequence.done, sequence.done + size)
            self.step([(sequence, prompt.embeds[rows], prompt.positions[:, rows])])

    def slot_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states.conv[:, slot].clone(), self.states.recurrent[:, slot].clone()


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def checkpoint(request: pytest.FixtureRequest, tiny_checkpoint: TinyCheckpoint) -> Path:
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def hf(checkpoint: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(checkpoint: Path) -> Qwen3_5ForCausalLM:
    model = load_model(checkpoint, torch.float32, torch.device("cpu"))
    assert isinstance(model, Qwen3_5ForCausalLM)
    return model


def text_prompt(ours: Qwen3_5ForCausalLM, length: int, seed: int) -> Prompt:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ours.config.vision_start_token_id, (length,), generator=generator)
    positions = torch.arange(length).expand(3, -1)
    return Prompt(tokens.tolist(), ours.embed_tokens(tokens), positions, 0, {})


@pytest.fixture(scope="module")
def image(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's (pixel_values, image_grid_thw) of one noise image."""
    from transformers import AutoImageProcessor

    rng = np.random.default_rng(0)
    pil = Image.fromarray(rng.integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8))
    processed = AutoImageProcessor.from_pretrained(checkpoint)(images=[pil], return_tensors="pt")
    return processed["pixel_values"], processed["image_grid_thw"]


@pytest.fixture(scope="module")
def image_prompt(ours: Qwen3_5ForCausalLM, hf, image) -> Prompt:
    """30 text tokens, the image (tokens 31..110), 40 text tokens: 152 in all. The image's
    embeddings are transformers' (ours equal them to rounding: the test below), so that
    the decoder is compared on identical inputs: at the tiny model's weight scale a 1e-5
    change of the image features moves the logits by ~3e-4."""
    config = ours.config
    pixel_values, grid = image
    image_tokens = int(grid.prod()) // config.spatial_merge_size**2
    text = text_prompt(ours, 70, seed=1).tokens
    tokens = [
        *text[:30],
        config.vision_start_token_id,
        *[config.image_token_id] * image_tokens,
        config.vision_end_token_id,
        *text[30:],
    ]
    input_ids = torch.tensor(tokens)
    is_image = input_ids == config.image_token_id
    with torch.no_grad():
        embeds = ours.embed_tokens(input_ids)
        embeds[is_image] = torch.cat(hf.model.get_image_features(pixel_values, grid).pooler_output)
    spans = [(31, image_tokens)]
    positions, delta = mrope_positions(len(tokens), spans, [tuple(grid[0].tolist())], 2)
    hf_inputs = {
        "pixel_values": pixel_values,
        "image_grid_thw": grid,
        "mm_token_type_ids": is_image.int()[None],
    }
    return Prompt(tokens, embeds, positions, delta, hf_inputs)


@torch.no_grad()
def hf_logits(hf, prompt: Prompt) -> torch.Tensor:
    return hf(input_ids=torch.tensor([prompt.tokens]), **prompt.hf_inputs).logits[0]


# ------------------------------------------------------------------ config and loading


def test_config_reads_the_hybrid_layout(checkpoint: Path, hf) -> None:
    text = hf.config.text_config
    config = VLModelConfig.from_pretrained(checkpoint)
    assert config.is_hybrid and config.linear is not None
    assert config.linear.layer_types == tuple(text.layer_types)
    assert config.attention_layers == (1, 3) and config.linear_layers == (0, 2)
    assert KVLayout.of(config, PAGE_SIZE, torch.float32).num_layers == config.num_kv_layers == 2
    assert config.rotary_dim == int(text.head_dim * text.rope_parameters["partial_rotary_factor"])
    assert config.deepstack_levels == 0
    layout = config.linear_state_layout(torch.bfloat16)
    dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
    assert layout.conv_shape == (2 * text.linear_num_key_heads * dk + 4 * dv, 3)
    assert layout.recurrent_shape == (text.linear_num_value_heads, dk, dv)
    if config.moe is not None:
        assert config.moe.shared_expert_intermediate_size == text.shared_expert_intermediate_size
    # without layer_types, every full_attention_interval-th layer is full attention
    raw = json.loads((checkpoint / "config.json").read_text())
    del raw["text_config"]["layer_types"]
    raw["text_config"]["full_attention_interval"] = 2
    assert VLModelConfig.from_dict(raw).linear == config.linear


def test_a_missing_linear_weight_is_named_and_mtp_is_skipped(checkpoint: Path, tmp_path):
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    state = dict(iter_safetensors(checkpoint))
    layers = "model.language_model.layers"
    missing = [f"{layers}.0.linear_attn.A_log", f"{layers}.2.linear_attn.in_proj_qkv.weight"]
    for name in missing:
        del state[name]
    state["mtp.fc.weight"] = torch.zeros(2, 2)  # the speculative head: skipped, as by HF
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights") as error:
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    message = str(error.value)
    assert "layers.0.linear_attn.A_log" in message
    assert "layers.2.linear_attn.in_proj_qkv.weight" in message
    assert "unexpected" not in message


def test_forward_without_states_is_refused(ours: Qwen3_5ForCausalLM) -> None:
    with pytest.raises(ValueError, match="needs states=LinearStepContext"):
        ours(ours.embed_tokens(torch.arange(3)), torch.arange(3), SingleSequenceAttention())


def test_dummy_weights_run_finite_in_bf16(checkpoint: Path, tmp_path) -> None:
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    model = load_model(tmp_path, torch.bfloat16, "cpu", dummy_weights=True)
    assert isinstance(model, Qwen3_5ForCausalLM)
    runner = Runner(model)
    sequence = runner.sequence(0)
    embeds = model.embed_tokens(torch.arange(70))
    (logits,) = runner.step([(sequence, embeds, torch.arange(70).expand(3, -1))])
    assert torch.isfinite(logits).all() and torch.isfinite(runner.states.recurrent).all()


# ------------------------------------------------------------------------- parity


@torch.no_grad()
def test_vision_tower_matches_transformers(ours, hf, image) -> None:
    """Qwen3-VL's tower without DeepStack: one embedding per merged patch, no levels."""
    expected = torch.cat(hf.model.get_image_features(*image).pooler_output)
    main, levels = ours.split_embeddings(ours.encode_images(*image))
    assert levels.shape[0] == 0
    torch.testing.assert_close(main, expected, **TOL)


@pytest.mark.parametrize("kind", ["text", "image"])
def test_one_call_matches_transformers(ours, hf, image_prompt, kind) -> None:
    prompt = image_prompt if kind == "image" else text_prompt(ours, 100, seed=3)
    runner = Runner(ours)
    (logits,) = runner.step([(runner.sequence(0), prompt.embeds, prompt.positions)])
    torch.testing.assert_close(logits, hf_logits(hf, prompt), **TOL)


def test_chunked_prefill_carries_the_state(ours, hf, image_prompt) -> None:
    """Chunk ends at 64 (inside the image, and a multiple of the delta rule's chunk), at
    114 (unaligned), then a one-token chunk (the recurrent form) and the rest."""
    runner = Runner(ours)
    whole, chunked = runner.sequence(0), runner.sequence(1)
    runner.prefill(whole, image_prompt, [len(image_prompt.tokens)])
    runner.prefill(chunked, image_prompt, [64, 50, 1, len(image_prompt.tokens) - 115])
    expected = hf_logits(hf, image_prompt)
    torch.testing.assert_close(chunked.logits[0], expected[63], **TOL)
    torch.testing.assert_close(chunked.logits[-1], expected[-1], **CHUNKED_TOL)
    for got, want in zip(runner.slot_state(1), runner.slot_state(0), strict=True):
        torch.testing.assert_close(got, want, **CHUNKED_TOL)


def test_batched_decode_continues_as_transformers_generate(ours, hf, image_prompt) -> None:
    """Both prompts prefilled in one step, then decode steps of both (one token each);
    one decode step also captures a snapshot, which must equal the slot it copies."""
    new_tokens = 4
    prompts = [text_prompt(ours, 37, seed=5), image_prompt]
    runner = Runner(ours)
    sequences = [runner.sequence(slot) for slot in (3, 1)]
    runner.step([(s, p.embeds, p.positions) for s, p in zip(sequences, prompts, strict=True)])
    generated: list[list[int]] = [[], []]
    for step in range(new_tokens):
        parts = []
        for sequence, prompt, tokens in zip(sequences, prompts, generated, strict=True):
            tokens.append(int(sequence.logits[-1].argmax()))
            position = sequence.done + prompt.rope_delta
            parts.append((sequence, ours.embed_tokens(torch.tensor(tokens[-1:])),
                          torch.full((3, 1), position)))  # fmt: skip
        if step < new_tokens - 1:
            runner.step(parts, captures={1: ((1, 7),)} if step == 1 else None)
        if step == 1:
            for got, want in zip(runner.slot_state(7), runner.slot_state(1), strict=True):
                assert torch.equal(got, want)
    for prompt, tokens in zip(prompts, generated, strict=True):
        input_ids = torch.tensor([prompt.tokens])
        with torch.no_grad():
            output = hf.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                **prompt.hf_inputs,
                max_new_tokens=new_tokens,
                do_sample=False,
            )
        assert tokens == output[0, input_ids.shape[1] :].tolist()


def test_a_capture_inside_a_chunk_holds_the_state_after_that_many_tokens(ours) -> None:
    """Captures at 40 (inside the delta rule's first chunk) and 100 (inside its second) of
    a 130-token chunk, against runs of exactly 40 and 100 tokens; capturing changes
    nothing else."""
    prompt = text_prompt(ours, 130, seed=7)
    runner = Runner(ours)
    captured, plain = runner.sequence(0), runner.sequence(1)
    runner.step([(captured, prompt.embeds, prompt.positions)], captures={0: ((40, 4), (100, 5))})
    runner.prefill(plain, prompt, [130])
    assert torch.equal(captured.logits[-1], plain.logits[-1])
    for got, want in zip(runner.slot_state(0), runner.slot_state(1), strict=True):
        assert torch.equal(got, want)
    for count, snapshot_slot in ((40, 4), (100, 5)):
        exact = runner.sequence(2 + count // 100)
        runner.prefill(exact, prompt, [count])
        for got, want in zip(
            runner.slot_state(snapshot_slot), runner.slot_state(exact.slot), strict=True
        ):
            torch.testing.assert_close(got, want, **CAPTURE_TOL)
