"""Model configs of the generated checkpoints, built with transformers' own config classes.

Shapes keep the structure of the real models (GQA, bias on q/k/v, M-RoPE, 14-px patches,
2x2 spatial merge, 2-frame temporal patches, Qwen2.5's windowed ViT; for Qwen3-VL q/k norm
without bias, interleaved M-RoPE, 16-px patches, learned ViT positions and DeepStack
levels; for Qwen3-VL-MoE routed experts in most layers; for Qwen3.5 Qwen3-VL's ViT without
DeepStack and a hybrid decoder, Gated DeltaNet linear-attention layers between gated
full-attention ones, with partial interleaved M-RoPE; for Qwen3.5-MoE routed experts plus a
shared expert in every layer) at toy widths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedConfig

from ..common.architectures import Architecture, by_model_type
from . import ARCHS, SIZES
from .tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, VOCAB_SIZE, token_id


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vit_width: int
    vit_depth: int
    vit_heads: int
    vit_intermediate: int  # Qwen2.5 MLP width; Qwen2-VL uses mlp_ratio = this / vit_width
    fullatt_blocks: tuple[int, ...]  # Qwen2.5 only: the others use window attention
    deepstack_blocks: tuple[int, ...]  # Qwen3 only: ViT blocks whose output feeds DeepStack
    vit_position_grid: int  # Qwen3 only: side of the learned ViT position table
    # Qwen3-MoE only. Expert width must differ from hidden/2 and hidden, or a fused expert
    # tensor's hub and transformers layouts would have one shape.
    experts: int
    experts_per_token: int
    expert_intermediate: int
    dense_layers: tuple[int, ...]  # `mlp_only_layers`
    # Qwen3.5 only. Its decoder has `hybrid_layers` layers, every `full_attention_interval`-th
    # one full attention and the others linear attention, at least two of each kind so that
    # a state or KV cache indexed by the wrong layer shows. Linear attention has (key, value)
    # head counts and head sizes of its own: twice as many value heads as key heads, as the
    # real models; in tiny also different key and value head sizes, so a swap shows.
    hybrid_layers: int
    full_attention_interval: int
    linear_heads: tuple[int, int]
    linear_head_dims: tuple[int, int]
    shared_expert_intermediate: int  # Qwen3.5-MoE's shared expert
    # Init std of every linear/embedding weight (transformers' default is 0.02). At 0.02 a
    # random model's logits are nearly flat and greedy decoding repeats one token (the tied
    # Qwen2-VL tiny model emits a single token 30 times for every prompt), so a parity test
    # would prove little. std * sqrt(hidden) ~= 1.6 gives varied greedy continuations
    # (26-30 distinct tokens out of 30, different per prompt and per image) with top-1/top-2
    # logit gaps of median ~0.3 and 5th percentile ~0.03, while keeping activations moderate
    # (small: max |hidden state| ~50; it is ~1000 at std 0.2).
    init_std: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES: dict[str, Shape] = {
    # 0.30M parameters (qwen2_vl, tied) / 0.41M (qwen2_5_vl): fast to build, for tests.
    "tiny": Shape(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=192,
        vit_width=32,
        vit_depth=3,
        vit_heads=2,
        vit_intermediate=128,
        fullatt_blocks=(1,),
        deepstack_blocks=(0, 1),
        vit_position_grid=8,
        experts=8,
        experts_per_token=2,
        expert_intermediate=96,
        dense_layers=(1,),
        hybrid_layers=4,
        full_attention_interval=2,
        linear_heads=(2, 4),
        linear_head_dims=(16, 32),
        shared_expert_intermediate=128,
        init_std=0.2,
    ),
    # 38.5M / 42.6M parameters. Real head sizes: text head_dim 128
    # (mrope_section [16, 24, 24], as Qwen2-VL), ViT head_dim 80.
    "small": Shape(
        hidden=512,
        layers=8,
        heads=4,
        kv_heads=2,
        intermediate=1536,
        vit_width=320,
        vit_depth=8,
        vit_heads=4,
        vit_intermediate=1280,
        fullatt_blocks=(3, 7),
        deepstack_blocks=(1, 3, 5),
        vit_position_grid=24,
        experts=16,
        experts_per_token=4,
        expert_intermediate=384,
        dense_layers=(),
        hybrid_layers=8,
        full_attention_interval=4,
        linear_heads=(4, 8),
        linear_head_dims=(128, 128),
        shared_expert_intermediate=768,
        init_std=0.07,
    ),
}


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies into (temporal, height, width) like Qwen (1:1.5:1.5);
    transformers does not check that they sum to head_dim/2, and a wrong sum silently
    rotates the wrong channels."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def interleaved_mrope_section(head_dim: int) -> list[int]:
    """(temporal, height, width) counts for Qwen3-VL's interleaved layout, in its 24:20:20
    ratio ([24, 20, 20] at head_dim 128). Height takes slots 1, 4, ... below 3 * height and
    width slots 2, 5, ... below 3 * width, so both fit in head_dim/2 slots."""
    half = head_dim // 2
    spatial = half * 5 // 16
    return [half - 2 * spatial, spatial, spatial]


def even_mrope_section(rotary_dims: int) -> list[int]:
    """(temporal, height, width) counts for Qwen3.5's interleaved layout: the rotary_dims/2
    frequencies split as evenly as possible, leading sections larger ([11, 11, 10] for the
    64 rotary dims of a 256-wide head with `partial_rotary_factor` 0.25)."""
    half = rotary_dims // 2
    base, extra = divmod(half, 3)
    return [base + (i < extra) for i in range(3)]


def build_config(arch: str, size: str) -> PreTrainedConfig:
    """The config of the tiny checkpoint of `arch` (a row's `model_type`) at `size`, in
    transformers' config class of the row's model class; its text and vision parts follow
    the row's `decoder`, `experts`, `hybrid`, `tower` and `deepstack`."""
    import transformers

    row = by_model_type(arch)
    if row is None:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    s = SHAPES[size]
    config_class: Callable[..., PreTrainedConfig] = getattr(transformers, row.name).config_class
    return config_class(
        text_config=_text_config(row, s),
        vision_config=_vision_config(row, s),
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
        tie_word_embeddings=row.tiny_ties_embeddings,
    )


def _text_config(row: Architecture, s: Shape) -> dict[str, object]:
    text: dict[str, object] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "max_position_embeddings": 32768,
        "max_window_layers": s.layers,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": mrope_section(s.head_dim),
        },
        "initializer_range": s.init_std,
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": token_id(EOS_TOKEN),
        "pad_token_id": token_id(PAD_TOKEN),
    }
    if row.decoder == "qwen3":
        # Qwen3-VL: explicit head_dim, q/k norm and no q/k/v bias in the decoder.
        text = {
            **text,
            "head_dim": s.head_dim,
            "attention_bias": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": interleaved_mrope_section(s.head_dim),
                "mrope_interleaved": True,
            },
        }
        del text["max_window_layers"]
    if row.experts is not None:
        # Qwen3-VL-30B-A3B's structure: routed experts, no shared one, top-k renormalised
        # (Qwen3.5-MoE adds its shared expert below).
        text = {
            **text,
            "num_experts": s.experts,
            "num_experts_per_tok": s.experts_per_token,
            "moe_intermediate_size": s.expert_intermediate,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(s.dense_layers),
        }
    if row.hybrid:
        text = _qwen3_5_text(text, s, moe=row.experts == "routed_shared")
    return text


def _vision_config(row: Architecture, s: Shape) -> dict[str, object]:
    common = {
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "depth": s.vit_depth,
        "num_heads": s.vit_heads,
        "initializer_range": s.init_std,
    }
    if row.tower == "qwen2":
        # Qwen2-VL: ViT width is `embed_dim`; `hidden_size` is the merger's output width.
        return {
            **common,
            "embed_dim": s.vit_width,
            "hidden_size": s.hidden,
            "mlp_ratio": s.vit_intermediate // s.vit_width,
            "hidden_act": "quick_gelu",
        }
    if row.tower == "qwen2.5":
        # Qwen2.5-VL: ViT width is `hidden_size`; `out_hidden_size` is the merger's output.
        return {
            **common,
            "hidden_size": s.vit_width,
            "intermediate_size": s.vit_intermediate,
            "out_hidden_size": s.hidden,
            "hidden_act": "silu",
            "window_size": 112,
            "fullatt_block_indexes": list(s.fullatt_blocks),
            "tokens_per_second": 2,
        }
    # Qwen3-VL: 16-px patches, a learned position table and (not Qwen3.5's) DeepStack mergers.
    vision = {
        **common,
        "patch_size": 16,
        "hidden_size": s.vit_width,
        "intermediate_size": s.vit_intermediate,
        "out_hidden_size": s.hidden,
        "hidden_act": "gelu_pytorch_tanh",
        "num_position_embeddings": s.vit_position_grid**2,
    }
    if row.deepstack:
        vision["deepstack_visual_indexes"] = list(s.deepstack_blocks)
    return vision


def _qwen3_5_text(qwen3_vl: dict[str, object], s: Shape, moe: bool) -> dict[str, object]:
    """Qwen3.5's text config from Qwen3-VL's: hybrid layers, heads twice as wide (256 in the
    real models, gated: q_proj also yields the gate) of which a quarter rotates, theta 1e7;
    the MoE variant routes every layer and adds a shared expert."""
    head_dim = 2 * s.head_dim
    partial = 0.25
    text = {
        **qwen3_vl,
        "num_hidden_layers": s.hybrid_layers,
        "head_dim": head_dim,
        "full_attention_interval": s.full_attention_interval,
        "linear_num_key_heads": s.linear_heads[0],
        "linear_num_value_heads": s.linear_heads[1],
        "linear_key_head_dim": s.linear_head_dims[0],
        "linear_value_head_dim": s.linear_head_dims[1],
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": partial,
            "mrope_section": even_mrope_section(int(head_dim * partial)),
            "mrope_interleaved": True,
        },
    }
    if moe:
        for key in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
            text.pop(key)
        text["shared_expert_intermediate_size"] = s.shared_expert_intermediate
    return text
