"""Which `LinearMethod` a model's linear layers are built with: the one place that reads
the settings and the checkpoint for it.

- `dense`: plain `F.linear` over the weights as loaded (GPUs; `--cpu-linear aten`);
- `onednn`: on a CPU in float32 or bfloat16, weights prepacked for oneDNN after loading,
  the dense copy freed (`cpu_linear`; `--cpu-linear onednn`, the default there).

A quantized checkpoint format (its config.json's `quantization_config`: block FP8, AWQ,
GPTQ) plugs in here: a `LinearMethod` subclass that creates its packed weights and scales,
loads them through its `load_weight` (slicing scales as the layer's `tp_splits` slice the
weight) and applies them, a row in `LINEAR_METHODS`, and a branch in `select_linear_method`.
"""

from __future__ import annotations

from typing import Literal

import torch

from .cpu_linear import OneDNNPackedLinear, can_pack
from .linear_method import DENSE, LinearMethod

LINEAR_METHODS: dict[str, LinearMethod] = {
    DENSE.name: DENSE,
    OneDNNPackedLinear.name: OneDNNPackedLinear(),
}


def select_linear_method(
    device: torch.device,
    dtype: torch.dtype,
    cpu_linear: Literal["onednn", "aten"],
) -> LinearMethod:
    """The method for a model on `device` in `dtype`: oneDNN-packed on a CPU where it can
    run (`cpu_linear` "onednn"), dense otherwise."""
    if cpu_linear == "onednn" and can_pack(device, dtype):
        return LINEAR_METHODS[OneDNNPackedLinear.name]
    return LINEAR_METHODS[DENSE.name]
