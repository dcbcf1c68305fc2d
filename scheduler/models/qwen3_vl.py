"""Qwen3-VL (dense): the Qwen3 decoder with DeepStack and the Qwen3-VL vision tower, behind
Qwen2-VL's API. `encode_images` returns each image token's main embedding and its L
DeepStack levels side by side, `[tokens, H * (1 + L)]`, one tensor per image for the
embedding cache; `forward` takes the step's levels as `[L, N, H]` (zeros at text rows).
Weights are named `model.language_model.*`, `model.visual.*` and (untied) `lm_head.*`,
which Qwen2-VL's loader already maps.
"""

from __future__ import annotations

import torch

from ..hybrid.linear_state import LinearStepContext
from .attention_api import AttentionContext
from .qwen2_vl import Qwen2VLForCausalLM
from .qwen3_lm import Qwen3Model
from .vision_qwen3 import Qwen3VisionTransformer


class Qwen3VLForCausalLM(Qwen2VLForCausalLM):
    vision_tower = Qwen3VisionTransformer
    language_model = Qwen3Model

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        deepstack: torch.Tensor | None = None,
        *,
        states: LinearStepContext | None = None,
    ) -> torch.Tensor:
        """As Qwen2-VL's, plus `deepstack` `[L, N, H]`: level k is added to decoder layer k's
        output (zeros at text rows). None: no row of the step is an image row."""
        if states is not None:
            raise ValueError(f"{self.config.architecture} has no linear-attention layers")
        model = self.model
        assert isinstance(model, Qwen3Model)
        return model(inputs_embeds, positions, attn, deepstack)
