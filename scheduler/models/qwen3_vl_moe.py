"""Qwen3-VL-MoE: Qwen3-VL whose decoder layers (those `MoEConfig.is_moe_layer` picks) run
routed experts instead of a dense MLP (`moe.SparseMoEBlock`, built by
`Qwen3Model.build_mlp`). The vision tower, DeepStack and everything the scheduler drives
are Qwen3-VL's; only loading differs, because expert tensors come in several layouts.
"""

from __future__ import annotations

from collections.abc import Iterable

from .loader import Weight
from .moe import expert_weights_for
from .qwen3_vl import Qwen3VLForCausalLM


class Qwen3VLMoeForCausalLM(Qwen3VLForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(expert_weights_for(self.config, weights))
