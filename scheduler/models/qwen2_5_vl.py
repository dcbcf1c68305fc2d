"""Qwen2.5-VL: Qwen2-VL with the windowed, RMSNorm/SwiGLU vision tower."""

from __future__ import annotations

from .qwen2_vl import Qwen2VLForCausalLM
from .vision_qwen2_5 import Qwen2_5VisionTransformer


class Qwen2_5_VLForCausalLM(Qwen2VLForCausalLM):
    vision_tower = Qwen2_5VisionTransformer
