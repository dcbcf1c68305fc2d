"""A bfloat16 decode step through every layer of a Qwen2 decoder (Qwen2-VL, Qwen2.5-VL) in
one C++ call on a CPU (`cpu_kernels/decode_layers.cpp`).

At batch 1 the module path's layers cost about as much again in Python and small ops as
the weights and the KV take to read: some twenty crossings into PyTorch per layer, each
paying its argument parsing, checks and dispatch. The fused step calls the same kernels
(RMS norm, pair-packed linears, rotary, paged decode attention) and the same PyTorch ops
(the residual adds, SiLU, the gate's product) in the same order, so its hidden states
equal the module path's to the bit; only the crossings go.

It runs where every layer is a plain Qwen2 layer, its linears packed as pairs
(`pair_linear.py`: bf16 on AVX512-BF16), on one rank, and the step is decodes only, each
through the paged decode kernel (`AttentionContext`'s `kernel_decodes`). Anything else
takes the layers one by one, as before.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import cpu_kernels
from .attention_api import KernelDecodes
from .layers import GatedMLP, RMSNorm
from .linear_method import LinearLayer
from .qwen2_lm import Qwen2Attention, Qwen2DecoderLayer, Qwen2Model

KERNELS = ("rms_norm", "pair_linear", "rotary", "paged_attention", "decode_layers")


class FusedDecode:
    """A decoder's weights, in the kernel's order (`decode_layers.cpp`), and its shapes."""

    def __init__(
        self, weights: list[torch.Tensor | None], shape: list[int], eps: float, head_dim: int
    ) -> None:
        self.weights = weights
        self.shape = shape  # heads, kv_heads, head_dim, intermediate
        self.eps = eps
        self.scale = 1.0 / math.sqrt(head_dim)  # SDPA's default, as the module path's
        self.group = shape[0] // shape[1]  # query heads per KV head

    @classmethod
    def of(cls, model: Qwen2Model) -> FusedDecode | None:
        """The fused step of `model`'s layers, or None where it cannot run them."""
        layers = [_plain_qwen2(layer) for layer in model.layers]
        if not layers or None in layers or not all(map(cpu_kernels.load, KERNELS)):
            return None
        plain = [layer for layer in layers if layer is not None]
        first = plain[0]
        heads, kv_heads = first.attention.num_heads, first.attention.num_kv_heads
        head_dim, intermediate = first.attention.head_dim, first.mlp.down_proj.in_features
        widths = ((heads + 2 * kv_heads) * head_dim, 2 * intermediate)
        norms = [norm for layer in plain for norm in layer.norms]
        if (
            heads % kv_heads
            or any(layer.widths != widths for layer in plain)
            or any(
                norm.eps != norms[0].eps or norm.weight.dtype != torch.bfloat16 for norm in norms
            )
        ):
            return None
        weights = [weight for layer in plain for weight in layer.weights()]
        return cls(weights, [heads, kv_heads, head_dim, intermediate], norms[0].eps, head_dim)

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, decodes: KernelDecodes
    ) -> torch.Tensor | None:
        """The layers' output for the step's decode rows `x` `[N, hidden]` (the final norm
        not applied), their new K/V written to the cache; None (nothing written) where the
        decode kernel takes fewer query heads per KV head than the model has."""
        if self.group > decodes.max_group:
            return None
        return torch.ops.iris_decode.decode_layers(
            x.contiguous(),
            self.weights,
            self.shape,
            self.eps,
            cos.contiguous(),
            sin.contiguous(),
            decodes.cache,
            decodes.slot_mapping,
            decodes.spans,
            decodes.sequence_spans,
            self.scale,
        )


def attach(model: torch.nn.Module) -> bool:
    """Gives `model`'s Qwen2 decoder its fused decode step where one can run (after loading:
    the step holds the packed weights as they are now); whether it did."""
    attached = False
    for module in model.modules():
        if isinstance(module, Qwen2Model):
            module.fused_decode = FusedDecode.of(module)
            attached = attached or module.fused_decode is not None
    return attached


class _Parts(NamedTuple):
    """A plain Qwen2 layer's modules, typed."""

    attention: Qwen2Attention
    mlp: GatedMLP
    norms: tuple[RMSNorm, RMSNorm]  # input, post-attention

    @property
    def widths(self) -> tuple[int, int]:
        """qkv's and gate_up's output widths."""
        return self.attention.qkv_proj.out_features, self.mlp.gate_up_proj.out_features

    def weights(self) -> list[torch.Tensor | None]:
        """This layer's ten, in the kernel's order."""
        attention, mlp = self.attention, self.mlp
        return [
            self.norms[0].weight,
            *_packed(attention.qkv_proj),
            *_packed(attention.o_proj),
            self.norms[1].weight,
            *_packed(mlp.gate_up_proj),
            *_packed(mlp.down_proj),
        ]


def _plain_qwen2(layer: torch.nn.Module) -> _Parts | None:
    """A Qwen2 layer as Qwen2-VL builds it, on one rank, its linears packed as pairs."""
    if type(layer) is not Qwen2DecoderLayer:
        return None
    attention, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if type(attention) is not Qwen2Attention or type(mlp) is not GatedMLP or mlp.act is not F.silu:
        return None
    if type(norms[0]) is not RMSNorm or type(norms[1]) is not RMSNorm:
        return None
    if attention.o_proj.tp.size != 1 or mlp.down_proj.tp.size != 1:
        return None
    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(
        linear.method.name == "pairs" and hasattr(linear, "packed_pairs") for linear in linears
    ):
        return None
    return _Parts(attention, mlp, norms)


def _packed(linear: LinearLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
    return linear.get_buffer("packed_pairs"), linear.bias
