"""How much of a model its matmuls multiply by and its decode steps read, counted from the
layers as their methods hold them: a oneDNN-prepacked or quantized weight is no parameter,
so `model.parameters()` alone misses the linear layers (`bench.roofline`'s rooflines)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .linear_method import LinearLayer, linear_layers
from .moe import RoutedExperts

if TYPE_CHECKING:
    from .qwen2_vl import Qwen2VLForCausalLM


def matmul_weights(module: torch.nn.Module) -> int:
    """The weights `module`'s matmuls multiply each token by: every linear layer's and every
    routed expert's (all of them, whichever a token is routed to; a 4-bit checkpoint's
    experts are linear layers of their own)."""
    linear = sum(layer.in_features * layer.out_features for layer in linear_layers(module))
    experts = sum(m.stacked_weights() for m in module.modules() if isinstance(m, RoutedExperts))
    return linear + experts


def decode_weight_bytes(model: Qwen2VLForCausalLM) -> int:
    """What a decode step reads of the weights: the decoder's layers and the LM head (the
    embedding's matrix where they are tied), as held; not the vision tower, and of the
    embedding only the rows of the step's tokens."""
    language = model.model
    held = sum(layer.method.resident_bytes(layer) for layer in linear_layers(language))
    others = [  # norms, routed experts, Gated DeltaNet's own tensors
        p
        for module in language.modules()
        if not isinstance(module, LinearLayer) and module is not language.embed_tokens
        for p in module.parameters(recurse=False)
    ]
    head, embedding = model.lm_head, language.embed_tokens.weight
    tied = embedding.numel() * embedding.element_size()
    head_bytes = tied if head is None else head.method.resident_bytes(head)
    return held + sum(p.numel() * p.element_size() for p in others) + head_bytes
