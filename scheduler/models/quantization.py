"""Which `LinearMethod` a model's linear layers are built with: the one place that reads
the settings and the checkpoint for it.

- `dense`: plain `F.linear` over the weights as loaded (GPUs; `--cpu-linear aten`);
- `pairs`: on a CPU in bfloat16, weights packed into blocks of pairs for our kernel after
  loading, the dense copy freed (`pair_linear`; what `--cpu-linear auto` takes where the
  CPU has AVX512-BF16 and no AMX);
- `onednn`: on a CPU in float32 or bfloat16, weights prepacked for oneDNN after loading,
  the dense copy freed (`cpu_linear`; what `auto` takes on a CPU otherwise);
- `block-fp8`: the layers a block-FP8 checkpoint stores quantized (`block_fp8`);
- `awq`: the layers an AWQ (4-bit, GEMM packing) checkpoint stores quantized (`awq`);
- `gptq`: the layers a GPTQ (4-bit) checkpoint stores quantized (`gptq`);
- `w4a16`: the layers a compressed-tensors W4A16 checkpoint stores packed
  (`compressed_tensors`);
- `int4-cpu`, `int4-triton`: what the three 4-bit methods hand their layers to once
  loaded, in bfloat16 on a CPU and on CUDA (`int4_kernel`), so the start-up line names it.

A layer is built with the settings' method (`select_linear_method`); a quantized
checkpoint (its config.json's `quantization_config`) then re-creates the layers it stores
quantized with its format's method before any weight is loaded (`quantize_layers`). Which
layers those are is read from the checkpoint's tensors, not from the config's skip list
(`modules_to_not_convert`, hundreds of names whose spelling varies): a layer is quantized
where its weight has a scale beside it. A new format (AWQ, GPTQ) is a `LinearMethod`, a
row in `FORMATS` and the tensor that marks a layer it quantized.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .awq import AwqLinear
from .block_fp8 import SCALE_SUFFIX, BlockFp8Linear
from .compressed_tensors import PackedW4A16Linear
from .cpu_linear import OneDNNPackedLinear, can_pack
from .gptq import GptqLinear
from .linear_method import DENSE, LinearLayer, LinearMethod, use_method
from .loader import checkpoint_names
from .moe import RoutedExperts
from .pair_linear import PairPackedLinear
from .pair_linear import can_run as pairs_can_run
from .pair_linear import preferred as pairs_preferred

if TYPE_CHECKING:
    from ..config import CpuLinear

LINEAR_METHODS: dict[str, LinearMethod] = {
    DENSE.name: DENSE,
    OneDNNPackedLinear.name: OneDNNPackedLinear(),
    PairPackedLinear.name: PairPackedLinear(),
}


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint format: `method(quantization_config, dtype)` checks the config and builds
    the method its layers load through for a model computing in `dtype` (raising, naming
    what differs, for a scheme Iris does not read); a layer `X` is stored quantized where
    the checkpoint has `X<marker>`."""

    name: str  # as `/v1/models` and the start-up log say it
    method: Callable[[dict[str, Any], torch.dtype], LinearMethod]
    marker: str


def _fp8(config: dict[str, Any], dtype: torch.dtype) -> LinearMethod:
    block, fmt = config.get("weight_block_size"), config.get("fmt", "e4m3")
    if block != [128, 128] or fmt != "e4m3":
        raise ValueError(
            "only block-wise FP8 with e4m3 weights and weight_block_size [128, 128] is "
            f"supported, got fmt {fmt!r}, weight_block_size {block!r}"
        )
    return BlockFp8Linear(dtype=dtype)


def _awq(config: dict[str, Any], dtype: torch.dtype) -> LinearMethod:
    bits, version = config.get("bits"), str(config.get("version", "gemm")).lower()
    zero_point, group = config.get("zero_point", True), config.get("group_size")
    if (bits, version, zero_point) != (4, "gemm", True) or not isinstance(group, int):
        raise ValueError(
            "only AWQ with bits 4, version gemm, zero_point true and an integer group_size "
            f"is supported, got bits {bits!r}, version {version!r}, zero_point "
            f"{zero_point!r}, group_size {group!r}"
        )
    return AwqLinear(group, dtype)


def _gptq(config: dict[str, Any], dtype: torch.dtype) -> LinearMethod:
    bits, group = config.get("bits"), config.get("group_size")
    fmt = config.get("checkpoint_format", "gptq")  # "gptq" stores zero - 1
    if bits != 4 or fmt not in ("gptq", "gptq_v2") or not isinstance(group, int) or group < 1:
        raise ValueError(
            "only GPTQ with bits 4, checkpoint_format gptq or gptq_v2 and a positive "
            f"group_size is supported, got bits {bits!r}, checkpoint_format {fmt!r}, "
            f"group_size {group!r}"
        )
    return GptqLinear(group, 1 if fmt == "gptq" else 0, dtype)


def _w4a16(config: dict[str, Any], dtype: torch.dtype) -> LinearMethod:
    """One config group, "pack-quantized", 4-bit symmetric int weights in groups, no
    activation quantization or ordering."""
    groups = list((config.get("config_groups") or {}).values())
    weights = groups[0].get("weights") or {} if len(groups) == 1 else {}
    wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    if (
        config.get("format") != "pack-quantized"
        or {key: weights.get(key) for key in wanted} != wanted
        or not isinstance(weights.get("group_size"), int)
        or weights.get("actorder")
        or groups[0].get("input_activations")
    ):
        raise ValueError(
            "only compressed-tensors W4A16 is supported: format pack-quantized, one config "
            "group of 4-bit symmetric int weights by group, no activation quantization or "
            f"actorder; got format {config.get('format')!r}, {len(groups)} group(s), "
            f"weights {weights}"
        )
    return PackedW4A16Linear(weights["group_size"], dtype)


FORMATS: dict[str, QuantFormat] = {  # by quantization_config.quant_method
    "fp8": QuantFormat("block-fp8", _fp8, ".weight" + SCALE_SUFFIX),
    "awq": QuantFormat("awq", _awq, ".qweight"),
    "gptq": QuantFormat("gptq", _gptq, ".qweight"),
    "compressed-tensors": QuantFormat("w4a16", _w4a16, ".weight_packed"),
}


def checkpoint_format(
    model_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[QuantFormat, LinearMethod] | None:
    """The quantized format of the checkpoint in `model_dir` and the method its layers load
    through for a model computing in `dtype` (None: full precision); raises naming what
    Iris does not read yet."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quant: dict[str, Any] | None = config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method"))
    fmt = FORMATS.get(method)
    if fmt is None:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported yet; "
            f"supported: {', '.join(sorted(FORMATS))}"
        )
    return fmt, fmt.method(quant, dtype)


def quantize_layers(
    model: nn.Module,
    model_dir: str | Path,
    target: Callable[[str], str | None],
    dtype: torch.dtype,
) -> QuantFormat | None:
    """Re-creates, with the checkpoint's format's method, every linear layer of `model`
    (built on the meta device in `dtype`, its tensor-parallel slices set) that the
    checkpoint stores quantized; `target(name)` is the parameter a checkpoint tensor fills (None: skipped).
    Returns the format, None for a full-precision checkpoint."""
    found = checkpoint_format(model_dir, dtype)
    if found is None:
        return None
    fmt, method = found
    modules = dict(model.named_modules())
    quantized = 0
    for name in checkpoint_names(model_dir):
        if not name.endswith(fmt.marker):
            continue
        weight = target(name.removesuffix(fmt.marker) + ".weight")
        if weight is None:
            continue
        owner = modules.get(weight.rpartition(".")[0])
        experts = _routed_experts(modules, weight)
        if experts is not None:
            if experts.quantization is None:
                _hold_experts_quantized(experts, method)
                quantized += 1
            continue
        if not isinstance(owner, LinearLayer):
            raise ValueError(
                f"{name}: {fmt.name} weights of this kind of layer (not a linear layer or "
                "routed experts of Iris's) are not supported yet"
            )
        if owner.method is not method:
            use_method(owner, method)
            quantized += 1
    if not quantized:
        raise ValueError(f"a {fmt.name} checkpoint with no quantized layer Iris knows")
    return fmt


def _hold_experts_quantized(experts: RoutedExperts, method: LinearMethod) -> None:
    """Block FP8 holds the experts stacked in e4m3 (`fp8_experts`); a 4-bit format as one
    MLP per expert of its own linear layers (`RoutedExperts.use_linear_method`)."""
    if isinstance(method, BlockFp8Linear):
        experts.use_block_fp8()
    else:
        experts.use_linear_method(method)


def _routed_experts(modules: dict[str, nn.Module], weight: str) -> RoutedExperts | None:
    """The routed experts whose expert's projection `weight` names (`...experts.3.up_proj.
    weight`, how quantized MoE releases store experts, as the model renames it), if it
    names one."""
    match = _PER_EXPERT_WEIGHT.match(weight)
    experts = modules.get(match["experts"]) if match else None
    return experts if isinstance(experts, RoutedExperts) else None


_PER_EXPERT_WEIGHT = re.compile(r"^(?P<experts>.*\.experts)\.\d+\.\w+\.weight$")  # (renamed)


def select_linear_method(
    device: torch.device,
    dtype: torch.dtype,
    cpu_linear: CpuLinear,
) -> LinearMethod:
    """The method for a model on `device` in `dtype`, from `--cpu-linear`: `auto` takes our
    pairs where `pair_linear.preferred` says so, else oneDNN-packed where oneDNN runs;
    `pairs` and `onednn` ask for theirs (`pairs` raises where it cannot run); dense
    otherwise, and everywhere off a CPU."""
    if cpu_linear == "pairs":
        if not pairs_can_run(device, dtype):
            raise ValueError(
                f"--cpu-linear pairs computes bfloat16 on a CPU whose kernels build, not "
                f"{dtype} on {device.type}"
            )
        return LINEAR_METHODS[PairPackedLinear.name]
    if cpu_linear == "auto" and pairs_preferred(device, dtype):
        return LINEAR_METHODS[PairPackedLinear.name]
    if cpu_linear in ("auto", "onednn") and can_pack(device, dtype):
        return LINEAR_METHODS[OneDNNPackedLinear.name]
    return LINEAR_METHODS[DENSE.name]
