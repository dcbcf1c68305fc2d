"""The Qwen3 decoder with interleaved M-RoPE and DeepStack, as used by Qwen3-VL.

Differs from `qwen2_lm`: an explicit `head_dim`, an RMSNorm over each head of q and k
before the rotary, no q/k/v bias (unless the config asks), the interleaved M-RoPE
frequency layout, and DeepStack: level k of the vision features is added to the output
of decoder layer k, passed as one `[L, N, H]` tensor with zeros at text rows, so the add
needs no mask. `Qwen3Model.build_mlp` is where the MoE decoder differs (`SparseMoEBlock`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from .attention_api import AttentionContext
from .config import VLModelConfig
from .layers import GatedMLP, MRotaryEmbedding, RMSNorm, apply_rotary
from .moe import SparseMoEBlock
from .qwen2_lm import Qwen2DecoderLayer, qkv_projection
from .tensor_parallel import RowParallelLinear, VocabParallelEmbedding


class Qwen3Attention(nn.Module):
    CPU_KERNELS: ClassVar[tuple[str, ...]] = ("rotary", "paged_attention")  # cpu_kernels.load_for

    def __init__(self, config: VLModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.attention_heads.num_heads
        self.num_kv_heads = config.attention_heads.num_kv_heads
        bias = config.attention_bias
        self.qkv_proj = qkv_projection(config, bias=bias)
        self.o_proj = RowParallelLinear(
            config.num_heads * self.head_dim, config.hidden_size, bias=bias, tp=config.tp
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionContext,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = attn.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class Qwen3Model(nn.Module):
    """Checkpoint prefix `model.language_model.` (ours: `model.`)."""

    def __init__(self, config: VLModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.tp)
        self.layers = nn.ModuleList(
            [
                Qwen2DecoderLayer(config, i, Qwen3Attention(config, i), self.build_mlp(config, i))
                for i in range(config.num_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(
            config.head_dim, config.rope_theta, config.mrope_section, config.mrope_interleaved
        )
        self.deepstack_levels = config.deepstack_levels

    @staticmethod
    def build_mlp(config: VLModelConfig, layer_idx: int) -> nn.Module:
        """Routed experts where the config's MoE rule says so, else the dense SwiGLU MLP."""
        if config.moe is not None and config.moe.is_moe_layer(layer_idx):
            return SparseMoEBlock(config.hidden_size, config.moe, config.tp)
        return GatedMLP(
            config.hidden_size, config.intermediate_size, bias=False, act="silu", tp=config.tp
        )

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        deepstack: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds `[N, H]`, positions `[3, N]` (or `[N]`), deepstack `[L, N, H]` (zeros
        at text rows; None when no row of the step is an image row) -> `[N, H]`."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        if deepstack is not None and deepstack.shape[0] > len(self.layers):
            raise ValueError(f"{deepstack.shape[0]} DeepStack levels for {len(self.layers)} layers")
        cos, sin = self.rotary_emb(positions, inputs_embeds.dtype)
        x = inputs_embeds
        for layer_idx, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn)
            if deepstack is not None and layer_idx < deepstack.shape[0]:
                x = x + deepstack[layer_idx]
        return self.norm(x)
