"""The Qwen2 decoder with M-RoPE, as used by Qwen2-VL and Qwen2.5-VL.

Module names follow the checkpoint (`embed_tokens`, `layers.N.self_attn`, `mlp`,
`input_layernorm`, ...) except for two fused projections, `qkv_proj` and `gate_up_proj`,
which the loader fills from `q/k/v_proj` and `gate/up_proj`. Attention itself is an
`AttentionContext`'s job; this module only projects, rotates and mixes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from .attention_api import AttentionContext, kernel_decodes
from .config import VLModelConfig
from .layers import GatedMLP, MRotaryEmbedding, RMSNorm, apply_rotary
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from .fused_decode import FusedDecode


def qkv_projection(config: VLModelConfig, bias: bool, gated: bool = False) -> ColumnParallelLinear:
    """q, k and v fused into one layer, with this rank's heads of each. `gated` (Qwen3.5):
    each query head's rows are followed by as many rows of its output gate."""
    heads, head_dim = config.attention_heads, config.head_dim
    q_rows = 2 * head_dim if gated else head_dim
    return ColumnParallelLinear(
        config.hidden_size,
        (
            (heads.q_start * q_rows, heads.num_heads * q_rows),
            (heads.kv_start * head_dim, heads.num_kv_heads * head_dim),
            (heads.kv_start * head_dim, heads.num_kv_heads * head_dim),
        ),
        bias=bias,
    )


class Qwen2Attention(nn.Module):
    CPU_KERNELS: ClassVar[tuple[str, ...]] = ("rotary", "paged_attention")  # cpu_kernels.load_for

    def __init__(self, config: VLModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.qkv_proj = qkv_projection(config, bias=True)
        self.num_heads = config.attention_heads.num_heads
        self.num_kv_heads = config.attention_heads.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_heads * self.head_dim, config.hidden_size, bias=False, tp=config.tp
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionContext,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = attn.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals. Qwen3 passes its own attention (q/k norm)
    and MLP (dense or MoE); the default is Qwen2's."""

    def __init__(
        self,
        config: VLModelConfig,
        layer_idx: int,
        self_attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn or Qwen2Attention(config, layer_idx)
        self.mlp = mlp or GatedMLP(
            config.hidden_size, config.intermediate_size, bias=False, act="silu", tp=config.tp
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Checkpoint prefix `model.`: embeddings, decoder layers, final norm. A step of decodes
    only goes through `fused_decode` where the loader attached one (`fused_decode.py`)."""

    fused_decode: FusedDecode | None = None

    def __init__(self, config: VLModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.tp)
        self.layers = nn.ModuleList(
            [Qwen2DecoderLayer(config, i) for i in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        """inputs_embeds `[N, H]`, positions `[3, N]` (or `[N]` for text-only) -> `[N, H]`."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        cos, sin = self.rotary_emb(positions, inputs_embeds.dtype)
        decodes = None if self.fused_decode is None else kernel_decodes(attn)
        fused = None
        if self.fused_decode is not None and decodes is not None:
            fused = self.fused_decode.run(inputs_embeds, cos, sin, decodes)
        if fused is not None:
            return self.norm(fused)
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)
