"""The architectures Iris serves: one row each, read by every package that needs to know.

The scheduler picks a row by `config.json`'s `architectures[0]` (`name`) to build its model
and to read the config; the tokenizer worker by `model_type` for the video rules; the
tiny-checkpoint generator by `model_type` (its `--arch`) for transformers' classes and the
layout of the files it writes. A row holds facts, not code: each field is one axis on which
architectures differ (the decoder, the vision tower, the experts, the video processor's
rules, ...), and the code that acts on an axis branches on the field's value, never on an
architecture's name, so a new architecture is its model file plus one row here.

This module imports nothing of Iris (every package may import it, `tiny_checkpoint`
included) and nothing heavy: the model class is a "module:Class" string, imported by
the scheduler's registry only when picked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Decoder",
    "Experts",
    "Tower",
    "VideoRules",
    "by_model_type",
    "by_name",
    "model_types",
]

# The decoder's basics: Qwen2's (head_dim = hidden_size / heads whatever the file says, bias
# on q/k/v, M-RoPE in three blocks) or Qwen3's (explicit head_dim, q/k norm without bias,
# interleaved M-RoPE).
Decoder = Literal["qwen2", "qwen3"]
# The vision tower's config layout and defaults: Qwen2-VL's (width `embed_dim`, `mlp_ratio`,
# QuickGELU), Qwen2.5-VL's (windowed attention, SwiGLU) or Qwen3-VL's (16-px patches, a
# learned position table).
Tower = Literal["qwen2", "qwen2.5", "qwen3"]
# Routed experts: "routed" as Qwen3-VL-MoE (every `decoder_sparse_step`-th layer not in
# `mlp_only_layers`; hub files fuse each projection over the experts, transposed),
# "routed_shared" as Qwen3.5-MoE (every layer, plus a shared expert; hub files hold one
# matrix per expert and projection).
Experts = Literal["routed", "routed_shared"]
# The video processor's rules (`tokenizer_worker/video/rules.py`): Qwen2-VL's processor with
# a temporal patch's M-RoPE time its index ("qwen2"), the same processor with Qwen2.5-VL's
# `tokens_per_second` times ("qwen2.5"), or Qwen3-VL's processor with timestamps ("qwen3").
VideoRules = Literal["qwen2", "qwen2.5", "qwen3"]

# Where the real tokenizers put their first special token (<|endoftext|>).
_QWEN2_FIRST_SPECIAL_ID = 151643  # Qwen2's tokenizer, Qwen2-VL to Qwen3-VL
_QWEN3_5_FIRST_SPECIAL_ID = 248044  # Qwen3.5's larger one


@dataclass(frozen=True)
class Architecture:
    """One architecture: how checkpoints name it and every fact that differs by it."""

    name: str  # transformers' model class: config.json's `architectures[0]`
    model_type: str  # config.json's `model_type`; also the tiny checkpoint's `--arch`
    model_class: str  # Iris's model, "module:Class", imported only when picked
    processor: str  # transformers' processor class (tokenizer, image and video processors)
    decoder: Decoder
    tower: Tower
    video: VideoRules
    # Gated DeltaNet linear-attention layers between gated full-attention ones that rotate
    # part of each head (Qwen3.5); the defaults then are `Qwen3_5TextConfig`'s
    hybrid: bool = False
    experts: Experts | None = None  # None: a dense MLP in every layer
    deepstack: bool = False  # the Qwen3 tower feeds DeepStack levels to the decoder
    # the hub's config.json nests `text_config` and its weights keep transformers'
    # in-memory names (`model.language_model.*`); otherwise flat, `model.*` and `visual.*`
    hub_nested: bool = False
    first_special_token_id: int = _QWEN2_FIRST_SPECIAL_ID  # the real tokenizer's
    # whether the tiny checkpoints tie lm_head to the embeddings (both loading paths tested)
    tiny_ties_embeddings: bool = False


_MODELS = "iris_serve.scheduler.models"

_ROWS = (
    Architecture(
        name="Qwen2VLForConditionalGeneration",
        model_type="qwen2_vl",
        model_class=f"{_MODELS}.qwen2_vl:Qwen2VLForCausalLM",
        processor="Qwen2VLProcessor",
        decoder="qwen2",
        tower="qwen2",
        video="qwen2",
        tiny_ties_embeddings=True,  # as Qwen2-VL-2B
    ),
    Architecture(
        name="Qwen2_5_VLForConditionalGeneration",
        model_type="qwen2_5_vl",
        model_class=f"{_MODELS}.qwen2_5_vl:Qwen2_5_VLForCausalLM",
        processor="Qwen2_5_VLProcessor",
        decoder="qwen2",
        tower="qwen2.5",
        video="qwen2.5",
    ),
    Architecture(
        name="Qwen3VLForConditionalGeneration",
        model_type="qwen3_vl",
        model_class=f"{_MODELS}.qwen3_vl:Qwen3VLForCausalLM",
        processor="Qwen3VLProcessor",
        decoder="qwen3",
        tower="qwen3",
        video="qwen3",
        deepstack=True,
        hub_nested=True,
        tiny_ties_embeddings=True,
    ),
    Architecture(
        name="Qwen3VLMoeForConditionalGeneration",
        model_type="qwen3_vl_moe",
        model_class=f"{_MODELS}.qwen3_vl_moe:Qwen3VLMoeForCausalLM",
        processor="Qwen3VLProcessor",
        decoder="qwen3",
        tower="qwen3",
        video="qwen3",
        experts="routed",
        deepstack=True,
        hub_nested=True,
    ),
    Architecture(
        name="Qwen3_5ForConditionalGeneration",
        model_type="qwen3_5",
        model_class=f"{_MODELS}.qwen3_5:Qwen3_5ForCausalLM",
        processor="Qwen3VLProcessor",  # transformers maps Qwen3.5 to Qwen3-VL's processor
        decoder="qwen3",
        tower="qwen3",
        video="qwen3",
        hybrid=True,
        hub_nested=True,
        first_special_token_id=_QWEN3_5_FIRST_SPECIAL_ID,
    ),
    Architecture(
        name="Qwen3_5MoeForConditionalGeneration",
        model_type="qwen3_5_moe",
        model_class=f"{_MODELS}.qwen3_5:Qwen3_5MoeForCausalLM",
        processor="Qwen3VLProcessor",
        decoder="qwen3",
        tower="qwen3",
        video="qwen3",
        hybrid=True,
        experts="routed_shared",
        hub_nested=True,
        first_special_token_id=_QWEN3_5_FIRST_SPECIAL_ID,
    ),
)

# name -> row, in the order above: the table every lookup below reads
ARCHITECTURES: dict[str, Architecture] = {row.name: row for row in _ROWS}


def by_name(name: str) -> Architecture:
    """The row of `name` (config.json's `architectures[0]`); ValueError for one Iris does
    not serve, naming those it does."""
    row = ARCHITECTURES.get(name)
    if row is None:
        raise ValueError(
            f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return row


def by_model_type(model_type: str) -> Architecture | None:
    """The row whose `model_type` (or tiny-checkpoint `--arch`) is `model_type`; None if none."""
    return next((row for row in ARCHITECTURES.values() if row.model_type == model_type), None)


def model_types() -> tuple[str, ...]:
    """Every row's `model_type`, in the table's order: the tiny checkpoints' `--arch` names."""
    return tuple(row.model_type for row in ARCHITECTURES.values())
