"""The Qwen3.5 decoder: Gated DeltaNet layers between gated full-attention ones.

Which layer is which comes from `LinearAttentionConfig.layer_types`. A full-attention
layer differs from Qwen3's in three ways: `q_proj` yields, per head, the query and then
as many rows of an output gate, and the attention's output is scaled by σ(gate) before
`o_proj`; only the first `rotary_dim` dims of each head rotate (interleaved M-RoPE on
those); and it hands its KV to the cache as KV layer i, its index among the
full-attention layers, since the cache holds only those. A linear-attention layer keeps
its state in the step's `LinearStepContext` instead (`gated_deltanet`).

Every RMSNorm of the decoder, q/k norms and the final one included, scales by `1 + w`
(`ZeroCenteredRMSNorm`); only the linear attention's gated output norm uses a plain `w`.
The MLP is Qwen3's (dense, or routed experts plus Qwen3.5-MoE's shared expert).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..hybrid.linear_state import LinearStepContext
from .attention_api import AttentionContext
from .config import VLModelConfig
from .gated_deltanet import GatedDeltaNet
from .layers import MRotaryEmbedding, ZeroCenteredRMSNorm, apply_rotary
from .qwen2_lm import qkv_projection
from .qwen3_lm import Qwen3Model
from .tensor_parallel import RowParallelLinear, VocabParallelEmbedding


class GatedAttention(nn.Module):
    """`kv_layer`: this layer's index among the full-attention layers (its KV cache layer)."""

    CPU_KERNELS: ClassVar[tuple[str, ...]] = ("rotary", "paged_attention")  # cpu_kernels.load_for

    def __init__(self, config: VLModelConfig, kv_layer: int) -> None:
        super().__init__()
        self.kv_layer = kv_layer
        self.head_dim = config.head_dim
        self.num_heads = config.attention_heads.num_heads
        self.num_kv_heads = config.attention_heads.num_kv_heads
        bias = config.attention_bias
        self.qkv_proj = qkv_projection(config, bias=bias, gated=True)
        self.o_proj = RowParallelLinear(
            config.num_heads * self.head_dim, config.hidden_size, bias=bias, tp=config.tp
        )
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        n = x.shape[0]
        q_and_gate, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q, gate = q_and_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = attn.attend(self.kv_layer, q, k, v).reshape(n, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm token mixer (`linear_attn` or `self_attn`, as the checkpoint names it) and
    MLP, with residuals."""

    def __init__(self, config: VLModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if layer_idx in config.linear_layers:
            self.linear_attn = GatedDeltaNet(config, config.linear_layers.index(layer_idx))
        else:
            self.self_attn = GatedAttention(config, config.attention_layers.index(layer_idx))
        self.mlp = Qwen3Model.build_mlp(config, layer_idx)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionContext,
        states: LinearStepContext,
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        if self.linear_attn is not None:
            x = x + self.linear_attn(normed, states)
        else:
            assert self.self_attn is not None
            x = x + self.self_attn(normed, cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(nn.Module):
    """Checkpoint prefix `model.language_model.` (ours: `model.`)."""

    def __init__(self, config: VLModelConfig) -> None:
        super().__init__()
        if config.linear is None:
            raise ValueError(f"{config.architecture} config has no linear-attention layers")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.tp)
        self.layers = nn.ModuleList(
            [Qwen3_5DecoderLayer(config, i) for i in range(config.num_layers)]
        )
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(
            config.rotary_dim, config.rope_theta, config.mrope_section, interleaved=True
        )

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        states: LinearStepContext,
    ) -> torch.Tensor:
        """inputs_embeds `[N, H]`, positions `[3, N]` (or `[N]`) -> `[N, H]`; `states`
        holds the linear layers' state, as `attn` holds the full layers' KV."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        cos, sin = self.rotary_emb(positions, inputs_embeds.dtype)
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, attn, states)
        return self.norm(x)
