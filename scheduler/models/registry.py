"""Which class serves which checkpoint, and building a model from a folder.

The class is the architecture's row's (`common/architectures.py`); model modules are
imported only when picked, so importing the registry is cheap.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...common.architectures import by_name
from .config import VLModelConfig, architecture_of
from .layers import RMSNorm
from .loader import iter_checkpoint
from .quantization import quantize_layers
from .tensor_parallel import SINGLE, TPShard

if TYPE_CHECKING:  # imported only when picked (below), so importing the registry is cheap
    from .qwen2_vl import Qwen2VLForCausalLM


def model_class(architecture: str) -> type[Qwen2VLForCausalLM]:
    """The class serving `architecture` (its row's `model_class`); every one derives from
    Qwen2-VL's. ValueError for an architecture without a row."""
    module_name, class_name = by_name(architecture).model_class.split(":")
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
    """Builds the model on the meta device (the layers a quantized checkpoint stores
    quantized re-created with its format's method, `quantization.quantize_layers`; the
    format's name in `model.quantization`), materialises it on `device` in `dtype` and
    loads the checkpoint's weights (or, with `dummy_weights`, small random ones). `tp`: the
    tensor-parallel shard this process holds (the whole model by default)."""
    config = dataclasses.replace(load_config(model_dir), tp=tp)
    cls = model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config).to(dtype=dtype)
        fmt = quantize_layers(model, model_dir, model.checkpoint_target, dtype)
    model.quantization = None if fmt is None else fmt.name
    model = model.to_empty(device=device)
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
