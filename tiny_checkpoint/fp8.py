"""Block-FP8 checkpoints, in the layout of Qwen's `-FP8` releases (`quantized.py` picks the
tensors): each decoder projection as e4m3 `X.weight` `[N, K]` with `X.weight_scale_inv`
`[ceil(N/128), ceil(K/128)]` (bfloat16, as Qwen3's releases), and config.json's
`quantization_config` {quant_method "fp8", fmt "e4m3", activation_scheme "dynamic",
weight_block_size [128, 128], modules_to_not_convert}; MoE experts per expert, each
projection with its own grid, as Qwen's FP8 MoE releases (`experts`). The twin:
`W = f32(Wq) · S` per block.

The math is written here, apart from the scheduler's loader, so that a test of one
against the other compares two readings of the format.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import quantized

if TYPE_CHECKING:
    import torch

BLOCK = 128
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"


def write_fp8(src: str | Path, out: str | Path, scale_dtype: str = "bfloat16") -> Path:
    """The block-FP8 checkpoint of the full-precision one in `src`, written to `out`."""
    import torch

    def stored(name: str, weight: torch.Tensor) -> quantized.Tensors:
        q, scale = quantize(weight, getattr(torch, scale_dtype))
        return {name: q, name + SCALE_SUFFIX: scale}

    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    return quantized.write_quantized(src, out, stored, config, "fp8")


def write_fp8_twin(src: str | Path, out: str | Path) -> Path:
    """The float32 checkpoint holding exactly the weights of the block-FP8 one in `src`."""
    import torch

    def restore(tensors: quantized.Tensors) -> quantized.Tensors:
        out: quantized.Tensors = {}
        for name, tensor in tensors.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            fp8 = tensor.dtype == torch.float8_e4m3fn
            out[name] = dequantize(tensor, tensors[name + SCALE_SUFFIX]) if fp8 else tensor
        return out

    return quantized.write_dequantized(src, out, restore)


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
