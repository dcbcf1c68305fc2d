"""Block-FP8 checkpoints from a full-precision one, in the layout of Qwen's `-FP8` releases,
and their dequantized twins (the reference a parity test runs transformers on).

`write_fp8` stores each decoder projection as e4m3 `X.weight` `[N, K]` with
`X.weight_scale_inv` `[ceil(N/128), ceil(K/128)]` (bfloat16, as Qwen3's releases), and
config.json's `quantization_config` {quant_method "fp8", fmt "e4m3", activation_scheme
"dynamic", weight_block_size [128, 128], modules_to_not_convert}. What the releases keep
in full precision stays so: the vision tower, embeddings, norms, `lm_head`, MoE routers
and experts (not written quantized here), and Gated DeltaNet's `in_proj_a`/`in_proj_b`.
`write_dequantized` turns such a checkpoint back into float32 weights, `W = f32(Wq) ·
S` per block, without `quantization_config`: both sides then hold the same weights.

The math is written here, apart from the scheduler's loader, so that a test of one
against the other compares two readings of the format.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Change = Callable[[str, "torch.Tensor"], dict[str, "torch.Tensor"]]

BLOCK = 128
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
KEPT_DENSE = ("visual", ".experts.", "mlp.gate.", "shared_expert_gate", "in_proj_a", "in_proj_b")


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a `-FP8` release stores tensor `name` quantized: a decoder layer's 2-D
    projection weight, not one of `KEPT_DENSE`."""
    return (
        len(shape) == 2
        and ".layers." in name
        and name.endswith("proj.weight")
        and not any(kept in name for kept in KEPT_DENSE)
    )


def write_fp8(src: str | Path, out: str | Path, scale_dtype: str = "bfloat16") -> Path:
    """The block-FP8 checkpoint of the full-precision one in `src`, written to `out`."""
    import torch

    dense: list[str] = []  # linear layers kept in full precision: the config's skip list

    def quantized(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not is_quantized(name, tuple(tensor.shape)):
            if tensor.dim() == 2 and name.endswith(".weight") and "embed" not in name:
                dense.append(name.removesuffix(".weight"))
            return {name: tensor}
        weight, scale = quantize(tensor, getattr(torch, scale_dtype))
        return {name: weight, name + SCALE_SUFFIX: scale}

    out = _rewrite(src, out, quantized)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": sorted(dense),
    }
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    _stamp(out, "fp8")
    return out


def write_dequantized(src: str | Path, out: str | Path) -> Path:
    """The float32 checkpoint holding exactly the weights of the block-FP8 one in `src`."""
    import torch

    scales: dict[str, torch.Tensor] = {}

    def restored(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if name.endswith(SCALE_SUFFIX):
            return {}
        if tensor.dtype == torch.float8_e4m3fn:
            return {name: dequantize(tensor, scales[name + SCALE_SUFFIX])}
        return {name: tensor}

    from safetensors.torch import load_file

    for path in sorted(Path(src).glob("*.safetensors")):
        scales |= {k: v for k, v in load_file(path).items() if k.endswith(SCALE_SUFFIX)}
    out = _rewrite(src, out, restored)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    _stamp(out, "fp8, dequantized")
    return out


def _stamp(folder: Path, quant: str) -> None:
    """Adds `quant` to a generated checkpoint's stamp (its arguments), if it has one."""
    from . import STAMP_FILE

    path = folder / STAMP_FILE
    if path.exists():
        stamp = json.loads(path.read_text()) | {"quant": quant}
        path.write_text(json.dumps(stamp, indent=2) + "\n")


def quantize(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale grid in `scale_dtype`) of a float `[N, K]` weight: each 128×128
    block's scale is its largest magnitude over e4m3's largest, rounded to `scale_dtype`
    before the weight is divided by it (the last blocks may be partial)."""
    import torch

    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
    padded[:rows, :cols] = weight.float().abs()
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    grid = blocks.amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    scale = grid.to(scale_dtype)
    divided = weight.float() / _expanded(scale, rows, cols)
    return divided.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 `W[n, k] = f32(Wq[n, k]) · S[n // 128, k // 128]`."""
    rows, cols = weight.shape
    return weight.float() * _expanded(scale, rows, cols)


def _expanded(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]


def _rewrite(src: str | Path, out: str | Path, change: Change) -> Path:
    """`src` copied to `out`, every tensor passed through `change(name, tensor)` (the
    tensors it returns are written), one safetensors file per source file."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if (
            item.is_file()
            and item.suffix != ".safetensors"
            and item.name != "model.safetensors.index.json"
        ):
            shutil.copy2(item, out / item.name)
    files = sorted(src.glob("*.safetensors"))
    weight_map: dict[str, str] = {}
    for path in files:
        tensors = {}
        for name, tensor in load_file(path).items():
            tensors |= change(name, tensor)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, out / path.name, {"format": "pt"}
        )
        weight_map |= dict.fromkeys(tensors, path.name)
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
