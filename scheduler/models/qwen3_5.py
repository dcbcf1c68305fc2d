"""Qwen3.5, dense and MoE: the hybrid decoder (`qwen3_5_lm`) behind Qwen2-VL's API, with
Qwen3-VL's vision tower without DeepStack.

A hybrid model keeps, besides its KV cache (full-attention layers only:
`config.num_kv_layers`), a fixed-size state per sequence for its linear-attention layers,
shaped by `config.linear_state_layout(dtype)`. Whoever drives the model owns that pool
and hands every `forward` a `LinearStepContext` naming each sequence's slot, in the
step's token order; `config.is_hybrid` tells the two kinds of model apart.

Weights load from the hub layout (`model.language_model.*`, `model.visual.*`,
`lm_head.*`), which Qwen2-VL's loader maps; the multi-token-prediction head (`mtp.*`) is
skipped, as transformers does. The MoE variant's expert tensors come in any layout
`moe.expert_weights_in_our_layout` reads.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..hybrid.linear_state import LinearStepContext
from .attention_api import AttentionContext
from .loader import Weight
from .moe import expert_weights_for
from .qwen2_vl import Qwen2VLForCausalLM
from .qwen3_5_lm import Qwen3_5Model
from .vision_qwen3 import Qwen3VisionTransformer

_SKIPPED_PREFIXES = ("mtp.",)  # multi-token prediction: a speculative head Iris does not run


class Qwen3_5ForCausalLM(Qwen2VLForCausalLM):
    vision_tower = Qwen3VisionTransformer
    language_model = Qwen3_5Model

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        deepstack: torch.Tensor | None = None,
        *,
        states: LinearStepContext | None = None,
    ) -> torch.Tensor:
        """As Qwen2-VL's, plus `states`, required: the linear-attention layers read each
        sequence's state from its slot and write it back advanced past the step's tokens."""
        if deepstack is not None:
            raise ValueError(f"{self.config.architecture} has no DeepStack levels")
        if states is None:
            raise ValueError(
                f"{self.config.architecture} has linear-attention layers: forward needs "
                "states=LinearStepContext (its sequences' state slots)"
            )
        model = self.model
        assert isinstance(model, Qwen3_5Model)
        return model(inputs_embeds, positions, attn, states)

    def _rename(self, name: str) -> str | None:
        if name.startswith(_SKIPPED_PREFIXES):
            return None
        return super()._rename(name)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(expert_weights_for(self.config, weights))
