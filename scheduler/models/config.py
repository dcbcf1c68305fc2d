"""`VLModelConfig`: the model shape read straight from a checkpoint's config.json, in
either layout: the hub's flat one (text parameters at the top level, `rope_theta` beside
them, `rope_scaling: {"type": "mrope", ...}`) or the transformers-5 nested one
(`text_config`, rope under `text_config.rope_parameters`).

The vision tower differs per architecture: Qwen2-VL names its width `embed_dim` and uses
`hidden_size` for the merger's output (the LM width) with `mlp_ratio`; Qwen2.5-VL uses
`hidden_size`, `intermediate_size` and `out_hidden_size`; Qwen3-VL adds a learned position
table (`num_position_embeddings`) and `deepstack_visual_indexes`, and its decoder has an
explicit `head_dim`, q/k norm and interleaved M-RoPE; Qwen3-VL-MoE swaps the MLP of its
decoder layers for routed experts (`MoEConfig`). Qwen3.5 keeps Qwen3-VL's tower without
DeepStack and makes the decoder hybrid: Gated DeltaNet linear-attention layers
(`LinearAttentionConfig`) between gated full-attention ones that rotate only part of each
head; its MoE variant routes every layer and adds a shared expert. Defaults are
transformers' defaults, so a file that leaves a key out means the same thing to us as to
transformers. Which of these an architecture has is its row's (`common/architectures.py`):
its `decoder`, `tower`, `deepstack`, `hybrid` and `experts`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ...common.architectures import Architecture, Experts, by_model_type, by_name
from ..hybrid.linear_state import LinearStateLayout
from .tensor_parallel import (
    SINGLE,
    AttentionHeads,
    LinearAttentionHeads,
    TPShard,
)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a Qwen3-MoE decoder. The router's top-k probabilities are always
    renormalised to sum 1 (transformers ignores `norm_topk_prob`: every released checkpoint
    sets it). Qwen3.5-MoE adds a shared expert that every token runs, scaled by
    σ(`shared_expert_gate`(x))."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert (`moe_intermediate_size`)
    sparse_step: int  # `decoder_sparse_step`: every step-th layer is MoE
    dense_layers: tuple[int, ...]  # `mlp_only_layers`: dense SwiGLU whatever the step says
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3-VL-MoE)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule: not listed as dense, and (i + 1) divisible by the step."""
        return (
            layer_idx not in self.dense_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.sparse_step == 0
        )


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid decoder (Qwen3.5) and which layers they are.

    q and k have `num_key_heads` heads of `key_head_dim`, v and the output `num_value_heads`
    of `value_head_dim`; each key head serves `num_value_heads // num_key_heads`
    consecutive value heads. The raw q/k/v projections go through a causal depthwise conv of
    width `conv_kernel` before the delta rule."""

    layer_types: tuple[str, ...]  # per decoder layer: LINEAR_ATTENTION or FULL_ATTENTION
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        unknown = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)} in layer_types")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) is not a multiple of "
                f"linear_num_key_heads ({self.num_key_heads})"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim {self.conv_kernel} must be at least 2")

    def is_linear(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == LINEAR_ATTENTION

    def heads(self, tp: TPShard) -> LinearAttentionHeads:
        """The key and value heads of this rank's shard."""
        return LinearAttentionHeads.of(self.num_key_heads, self.num_value_heads, tp)


@dataclass(frozen=True)
class VisionConfig:
    """The ViT. `window_size == 0` means no window attention (Qwen2-VL)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    rope_theta: float
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    tokens_per_second: int
    num_position_embeddings: int = 0  # Qwen3-VL: a square learned table, 0 = none
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks feeding DeepStack

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one row of `pixel_values`: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class VLModelConfig:
    architecture: str
    # language model
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool  # Qwen3-VL: T,H,W,T,H,W,... frequency slots, not three blocks
    rotary_dim: int  # the leading dims of each head that rotate: head_dim, but for Qwen3.5
    attention_bias: bool  # bias on q/k/v (Qwen2); Qwen3 has none and normalises q/k instead
    tie_word_embeddings: bool
    max_position_embeddings: int
    # token ids
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    # dtype the weights were saved in ("bfloat16", ...); None when the file does not say
    dtype: str | None
    vision: VisionConfig
    moe: MoEConfig | None = None  # Qwen3-VL-MoE; None: every layer has a dense MLP
    # Qwen3.5: linear-attention layers, and full attention gated (q_proj also yields a gate
    # per head); None: every layer is plain full attention
    linear: LinearAttentionConfig | None = None
    # the tensor-parallel shard the model is built as (not in config.json: `load_model`)
    tp: TPShard = SINGLE

    @property
    def attention_heads(self) -> AttentionHeads:
        """The query and KV heads of this rank's shard (all of them on one rank)."""
        return AttentionHeads.of(self.num_heads, self.num_kv_heads, self.tp)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention: the model then keeps a fixed-size state
        per sequence outside the KV cache (`linear_state_layout`) and its `forward` needs a
        `LinearStepContext`."""
        return self.linear is not None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Decoder layers with full attention, in order; the i-th of them is KV layer i."""
        if self.linear is None:
            return tuple(range(self.num_layers))
        return tuple(i for i in range(self.num_layers) if not self.linear.is_linear(i))

    @property
    def num_kv_layers(self) -> int:
        """Layers the KV cache holds: the full-attention ones (every layer unless hybrid)."""
        return len(self.attention_layers)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Decoder layers with linear attention, in order; the i-th of them is state layer i."""
        if self.linear is None:
            return ()
        return tuple(i for i in range(self.num_layers) if self.linear.is_linear(i))

    @property
    def linear_heads(self) -> LinearAttentionHeads:
        """This rank's linear-attention key and value heads; raises unless hybrid."""
        if self.linear is None:
            raise ValueError(f"{self.architecture} has no linear-attention layers")
        return self.linear.heads(self.tp)

    def linear_state_layout(self, dtype: torch.dtype) -> LinearStateLayout:
        """One sequence's linear-attention state on this rank, conv columns in `dtype` (the
        model's); raises unless hybrid."""
        heads = self.linear_heads
        linear = self.linear
        assert linear is not None  # linear_heads raised otherwise
        return LinearStateLayout(
            num_layers=len(self.linear_layers),
            conv_channels=2 * heads.num_key_heads * linear.key_head_dim
            + heads.num_value_heads * linear.value_head_dim,
            conv_kernel=linear.conv_kernel,
            value_heads=heads.num_value_heads,
            key_head_dim=linear.key_head_dim,
            value_head_dim=linear.value_head_dim,
            conv_dtype=dtype,
        )

    @property
    def spatial_merge_size(self) -> int:
        return self.vision.spatial_merge_size

    @property
    def deepstack_levels(self) -> int:
        """Vision features added to the first decoder layers' outputs (Qwen3-VL), 0 if none."""
        return len(self.vision.deepstack_visual_indexes)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> VLModelConfig:
        """Reads `config.json`; EOS ids follow `generate` (see `generation_eos_token_ids`)."""
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        config = cls.from_dict(raw)
        eos = generation_eos_token_ids(model_dir, config.eos_token_ids)
        return replace(config, eos_token_ids=eos)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VLModelConfig:
        architecture = architecture_of(raw)
        row = by_name(architecture)  # ValueError for one without a row
        text = raw.get("text_config") or {}

        def get(key: str, default: Any) -> Any:
            """Text keys: nested `text_config` first, then the flat top level."""
            if key in text and text[key] is not None:
                return text[key]
            value = raw.get(key)
            return default if value is None else value

        hidden_size = int(get("hidden_size", 8192))
        num_layers = int(get("num_hidden_layers", 80))
        num_heads = int(get("num_attention_heads", 64))
        num_kv_heads = int(get("num_key_value_heads", None) or num_heads)
        qwen3 = row.decoder == "qwen3"
        # transformers' Qwen2-VL attention uses hidden_size // heads whatever head_dim says;
        # Qwen3's reads head_dim.
        head_dim = int(get("head_dim", 128)) if qwen3 else hidden_size // num_heads
        if not qwen3 and head_dim * num_heads != hidden_size:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by {num_heads} heads")

        hybrid = row.hybrid
        rope = dict(get("rope_parameters", None) or get("rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise NotImplementedError(f"rope type {rope_type!r} is not supported (only mrope)")
        # Qwen3.5 rotates only a leading part of each head (a quarter by default)
        partial = float(rope.get("partial_rotary_factor") or get("partial_rotary_factor", 0.25))
        rotary_dim = int(head_dim * partial) if hybrid else head_dim
        default_section = (11, 11, 10) if hybrid else (24, 20, 20) if qwen3 else (16, 24, 24)
        mrope_section = tuple(int(s) for s in rope.get("mrope_section", default_section))
        if len(mrope_section) != 3 or 2 * sum(mrope_section) != rotary_dim:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must have 3 parts summing to half the "
                f"rotary dims ({rotary_dim // 2})"
            )
        default_theta = 10_000.0 if hybrid else 1_000_000.0
        rope_theta = float(rope.get("rope_theta") or get("rope_theta", default_theta))
        if get("use_sliding_window", False):
            raise NotImplementedError("use_sliding_window=true is not supported")
        if get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"text hidden_act {get('hidden_act', '')!r} is not supported")

        # The top level governs where it says (transformers 5 saves Qwen3-VL-MoE with a
        # top-level false beside text_config's default true, and unties); pre-v5 saves put
        # the key only inside text_config.
        tie = bool(
            raw["tie_word_embeddings"]
            if raw.get("tie_word_embeddings") is not None
            else text.get("tie_word_embeddings", False)
        )
        eos = _as_id_tuple(get("eos_token_id", 151645))
        return cls(
            architecture=architecture,
            vocab_size=int(get("vocab_size", 152064)),
            hidden_size=hidden_size,
            intermediate_size=int(get("intermediate_size", 29568)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            mrope_section=mrope_section,
            # transformers' Qwen3-VL always interleaves, whatever `mrope_interleaved` says
            mrope_interleaved=qwen3,
            rotary_dim=rotary_dim,
            attention_bias=bool(get("attention_bias", False)) if qwen3 else True,
            tie_word_embeddings=tie,
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            image_token_id=int(raw.get("image_token_id", 151655)),
            video_token_id=int(raw.get("video_token_id", 151656)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
            eos_token_ids=eos,
            bos_token_id=get("bos_token_id", None),
            pad_token_id=get("pad_token_id", None),
            dtype=raw.get("dtype") or raw.get("torch_dtype") or get("dtype", None),
            vision=_vision_config(row, raw.get("vision_config") or {}),
            moe=_moe_config(row.experts, get) if row.experts else None,
            linear=_linear_config(get, num_layers) if hybrid else None,
        )


def _moe_config(experts: Experts, get: Any) -> MoEConfig:
    """`get` reads a text key (nested first); defaults are `Qwen3VLMoeTextConfig`'s
    ("routed"), or `Qwen3_5MoeTextConfig`'s ("routed_shared"), which routes every layer
    whatever the file says and adds a shared expert. transformers 5 saves `num_experts` as
    `num_local_experts`."""
    shared = experts == "routed_shared"
    num_experts = int(get("num_experts", None) or get("num_local_experts", 256 if shared else 60))
    top_k = int(get("num_experts_per_tok", 8 if shared else 4))
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
    if shared:
        return MoEConfig(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=int(get("moe_intermediate_size", 512)),
            sparse_step=1,
            dense_layers=(),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 512)),
        )
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(get("moe_intermediate_size", 1408)),
        sparse_step=int(get("decoder_sparse_step", 1)),
        dense_layers=tuple(int(i) for i in get("mlp_only_layers", ())),
    )


def _linear_config(get: Any, num_layers: int) -> LinearAttentionConfig:
    """`get` reads a text key; defaults are `Qwen3_5TextConfig`'s. Without `layer_types`,
    every `full_attention_interval`-th layer is full attention, as transformers decides."""
    layer_types = get("layer_types", None)
    if layer_types is None:
        interval = int(get("full_attention_interval", 4))
        layer_types = [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ValueError(f"{len(layer_types)} layer_types for {num_layers} layers")
    return LinearAttentionConfig(
        layer_types=tuple(str(kind) for kind in layer_types),
        num_key_heads=int(get("linear_num_key_heads", 16)),
        num_value_heads=int(get("linear_num_value_heads", 32)),
        key_head_dim=int(get("linear_key_head_dim", 128)),
        value_head_dim=int(get("linear_value_head_dim", 128)),
        conv_kernel=int(get("linear_conv_kernel_dim", 4)),
    )


def architecture_of(raw: dict[str, Any]) -> str:
    """`architectures[0]`, or the architecture implied by `model_type` when that is absent."""
    architectures = raw.get("architectures") or []
    if architectures:
        return str(architectures[0])
    model_type = raw.get("model_type", "")
    row = by_model_type(model_type)
    if row is not None:
        return row.name
    raise ValueError(f"config.json names no architecture (model_type={model_type!r})")


def _vision_config(row: Architecture, v: dict[str, Any]) -> VisionConfig:
    def get(key: str, default: Any) -> Any:
        value = v.get(key)
        return default if value is None else value

    qwen3 = row.tower == "qwen3"
    common: dict[str, Any] = dict(  # VisionConfig's shared fields, of mixed types
        depth=int(get("depth", 27 if qwen3 else 32)),
        num_heads=int(get("num_heads", 16)),
        patch_size=_scalar(get("patch_size", 16 if qwen3 else 14)),
        temporal_patch_size=_scalar(get("temporal_patch_size", 2)),
        spatial_merge_size=int(get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels") or v.get("in_chans") or 3),
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        tokens_per_second=int(get("tokens_per_second", 4)),
    )
    if row.tower == "qwen2":
        embed_dim = int(get("embed_dim", 1280))
        return VisionConfig(
            hidden_size=embed_dim,
            intermediate_size=int(embed_dim * get("mlp_ratio", 4)),
            out_hidden_size=int(get("hidden_size", 3584)),
            hidden_act=str(get("hidden_act", "quick_gelu")),
            window_size=0,
            fullatt_block_indexes=(),
            **common,
        )
    if row.tower == "qwen2.5":
        return VisionConfig(
            hidden_size=int(get("hidden_size", 3584)),
            intermediate_size=int(get("intermediate_size", 3420)),
            out_hidden_size=int(get("out_hidden_size", 3584)),
            hidden_act=str(get("hidden_act", "silu")),
            window_size=int(get("window_size", 112)),
            fullatt_block_indexes=tuple(
                int(i) for i in get("fullatt_block_indexes", (7, 15, 23, 31))
            ),
            **common,
        )
    deepstack = (
        tuple(int(i) for i in get("deepstack_visual_indexes", (8, 16, 24)))
        if row.deepstack
        else ()  # a tower without DeepStack mergers (Qwen3.5's), whatever the file says
    )
    if any(not 0 <= i < common["depth"] for i in deepstack):
        raise ValueError(f"deepstack_visual_indexes {list(deepstack)} outside the ViT depth")
    return VisionConfig(
        hidden_size=int(get("hidden_size", 1152)),
        intermediate_size=int(get("intermediate_size", 4304)),
        out_hidden_size=int(get("out_hidden_size", 3584)),
        hidden_act=str(get("hidden_act", "gelu_pytorch_tanh")),
        window_size=0,
        fullatt_block_indexes=(),
        num_position_embeddings=int(get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=deepstack,
        **common,
    )


def _scalar(value: Any) -> int:
    """transformers allows `patch_size` as [p, p]; only square patches exist for Qwen."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise NotImplementedError(f"non-square patch size {value}")
        value = value[0]
    return int(value)


def generation_eos_token_ids(model_dir: str | Path, fallback: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids as transformers' `generate` uses them: `generation_config.json`'s when it
    names any, else `fallback` (config.json's). The one place Iris reads them."""
    generation = Path(model_dir) / "generation_config.json"
    if generation.exists():
        ids = _as_id_tuple(json.loads(generation.read_text()).get("eos_token_id"))
        if ids:
            return ids
    return fallback


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
