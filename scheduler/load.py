"""The model one rank serves: built with the linear method its settings pick
(`models.quantization`), loaded, its weights processed for that method, and one start-up
line of what its linear layers hold."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from . import cpu_kernels, huge_pages
from .config import EngineConfig
from .kv.sizing import readable_bytes
from .models import fused_decode
from .models.cpu_linear import bound_primitive_caches
from .models.gated_deltanet import GatedDeltaNet
from .models.int4_cpu import Int4PackedCpuLinear
from .models.int4_kernel import Int4TritonLinear
from .models.linear_method import (
    LinearMethod,
    building_with,
    linear_layers,
    linear_weight_bytes,
    process_linears_after_loading,
)
from .models.moe import RoutedExperts
from .models.quantization import select_linear_method
from .models.registry import load_model
from .models.tensor_parallel import TPShard

if TYPE_CHECKING:
    from .models.qwen2_vl import Qwen2VLForCausalLM


def load_rank_model(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPShard,
    say: Callable[..., None],
) -> Qwen2VLForCausalLM:
    """This rank's shard of `config.model` on `device` in `dtype`, ready to serve."""
    if device.type == "cpu":
        bound_primitive_caches()
    method = select_linear_method(device, dtype, config.cpu_linear)
    started = time.monotonic()
    say("loading %s on %s (%s)", config.model, device, str(dtype).removeprefix("torch."))
    with building_with(method):
        model = load_model(config.model, dtype=dtype, device=device, tp=tp)
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.fuse_input_projections()
    process_linears_after_loading(model)
    for experts in model.modules():
        if isinstance(experts, RoutedExperts):
            experts.stack_for_grouped_kernel()
    if device.type == "cpu":
        loaded = cpu_kernels.load_for(model, dtype)
        say("CPU kernels: %s", ", ".join(loaded) or "none (PyTorch's paths)")
        on_huge_pages = huge_pages.collapse_weights(model)
        say("weights on huge pages: %s", readable_bytes(on_huge_pages) if on_huge_pages else "none")
        if fused_decode.attach(model):
            say("decode steps: every layer in one C++ call (decode_layers)")
    say("model loaded in %.1f s", time.monotonic() - started)
    resident, dense = linear_weight_bytes(model)
    say(
        "linear weights: %s resident per rank, %.2fx their dense size (%s)",
        readable_bytes(resident),
        resident / max(dense, 1),
        methods_used(model, method),
    )
    return model


def methods_used(model: Qwen2VLForCausalLM, method: LinearMethod) -> str:
    """ "onednn method", or with a quantized checkpoint "onednn method; block-fp8 for 8
    layers at 0.52x" (their bytes over their dense size in the model's dtype; ", through
    int4-cpu" where a kernel took them once loaded; ", the routed experts of 2 layers"
    where those are held quantized too): how the linear layers compute (`method`: the
    settings' choice)."""
    fmt = model.quantization
    if fmt is None:
        return f"{method.name} method"
    names = (fmt, Int4PackedCpuLinear.name, Int4TritonLinear.name)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts) and m.quantization]
    experts_layers = {id(layer) for m in experts for layer in linear_layers(m)}
    quantized = [layer for layer in linear_layers(model) if layer.method.name in names]
    kernels = sorted({layer.method.name for layer in quantized} - {fmt})
    through = f", through {', '.join(kernels)}" if kernels else ""
    held = sum(layer.method.resident_bytes(layer) for layer in quantized)
    share = held / max(1, sum(layer.method.dense_bytes(layer) for layer in quantized))
    quantized = [layer for layer in quantized if id(layer) not in experts_layers]
    routed = f", the routed experts of {len(experts)} layers" if experts else ""
    return (
        f"{method.name} method; {fmt} for {len(quantized)} layers at {share:.2f}x{through}{routed}"
    )
