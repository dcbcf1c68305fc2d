"""Which class serves which checkpoint, and building a model from a folder.

Model modules are imported only when picked, so importing the registry is cheap.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import VLModelConfig, architecture_of
from .layers import RMSNorm
from .loader import iter_checkpoint
from .tensor_parallel import SINGLE, TPShard

if TYPE_CHECKING:  # imported only when picked (below), so importing the registry is cheap
    from .qwen2_vl import Qwen2VLForCausalLM

# config.architectures[0] -> "module:Class"
ARCHITECTURES: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "iris_serve.scheduler.models.qwen2_vl:Qwen2VLForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "iris_serve.scheduler.models.qwen2_5_vl:Qwen2_5_VLForCausalLM",
    "Qwen3VLForConditionalGeneration": "iris_serve.scheduler.models.qwen3_vl:Qwen3VLForCausalLM",
    "Qwen3VLMoeForConditionalGeneration": (
        "iris_serve.scheduler.models.qwen3_vl_moe:Qwen3VLMoeForCausalLM"
    ),
    "Qwen3_5ForConditionalGeneration": "iris_serve.scheduler.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": (
        "iris_serve.scheduler.models.qwen3_5:Qwen3_5MoeForCausalLM"
    ),
}


def model_class(architecture: str) -> type[Qwen2VLForCausalLM]:
    """The class serving `architecture`; every one derives from Qwen2-VL's."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    module_name, class_name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def load_config(model_dir: str | Path) -> VLModelConfig:
    """Reads the checkpoint's config, failing early and clearly on an unknown architecture."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    model_class(architecture_of(raw))  # raises for unsupported ones
    return VLModelConfig.from_pretrained(model_dir)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    dummy_weights: bool = False,
    tp: TPShard = SINGLE,
) -> Qwen2VLForCausalLM:
    """Builds the model on the meta device, materialises it on `device` in `dtype` and
    loads the checkpoint's weights (or, with `dummy_weights`, small random ones). `tp`: the
    tensor-parallel shard this process holds (the whole model by default)."""
    config = dataclasses.replace(load_config(model_dir), tp=tp)
    cls = model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.reset_buffers()
    if dummy_weights:
        _init_dummy(model)
    else:
        model.load_weights(iter_checkpoint(model_dir))  # each rank reads its shards only
    return model.eval().requires_grad_(False)


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Norms at identity, everything else N(0, 0.02): shapes and speed, not meaning. A
    module whose parameters need other constants (a norm scaling by `1 + w`, a decay's
    parameters) names them in its `DUMMY_FILL`."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for module in model.modules():
        is_norm = isinstance(module, (nn.LayerNorm, RMSNorm))
        fills: dict[str, float] = getattr(module, "DUMMY_FILL", {})
        for name, param in module.named_parameters(recurse=False):
            if name in fills:
                param.fill_(fills[name])
            elif is_norm:
                param.fill_(1.0 if name == "weight" else 0.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
