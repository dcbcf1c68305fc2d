"""compressed-tensors W4A16 checkpoints (llm-compressor's "pack-quantized" layout),
written by round-to-nearest (`quantized.py` picks the tensors): each decoder projection
`X` as `X.weight_packed` (int32 `[N, K/8]`, value i of word j holding input 8j + i, stored
plus 8), `X.weight_scale` (bf16 `[N, K/G]`) and `X.weight_shape` (`[N, K]`), its bias as it
was, and config.json's `quantization_config` {quant_method "compressed-tensors", format
"pack-quantized", one config group of 4-bit symmetric int weights by group, ignore}.
Symmetric, as compressed-tensors computes it: `s = max|w| / 7.5` per group,
`q = clamp(round(w / s), -8, 7)`. The twin: `W[n, k] = q[n, k] · s[n, k // G]`.

Written apart from the scheduler's loader, so that a test of one against the other
compares two readings of the format.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import quantized

if TYPE_CHECKING:
    import torch

PACK = 8
GROUP_SIZE = 32  # the tiny checkpoints' widths (64, 192) are not multiples of 128


def write_w4a16(src: str | Path, out: str | Path, group_size: int = GROUP_SIZE) -> Path:
    """The W4A16 checkpoint of the full-precision one in `src`, written to `out`."""
    import torch

    def stored(name: str, weight: torch.Tensor) -> quantized.Tensors:
        packed, scale = quantize(weight, group_size)
        stem = name.removesuffix(".weight")
        shape = torch.tensor(list(weight.shape), dtype=torch.int32)
        return {
            f"{stem}.weight_packed": packed,
            f"{stem}.weight_scale": scale,
            f"{stem}.weight_shape": shape,
        }

    scheme = {
        "targets": ["Linear"],
        "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
            "group_size": group_size,
        },
        "input_activations": None,
        "output_activations": None,
    }  # fmt: skip
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": scheme},
        "quantization_status": "compressed",
    }
    return quantized.write_quantized(src, out, stored, config, "w4a16", skip_list="ignore")


def write_w4a16_twin(src: str | Path, out: str | Path) -> Path:
    """The float32 checkpoint holding exactly the weights of the W4A16 one in `src`."""

    def restore(tensors: quantized.Tensors) -> quantized.Tensors:
        out: quantized.Tensors = {}
        for name, tensor in tensors.items():
            stem, _, leaf = name.rpartition(".")
            if leaf == "weight_packed":
                out[f"{stem}.weight"] = dequantize(tensor, tensors[f"{stem}.weight_scale"])
            elif (
                leaf not in ("weight_scale", "weight_shape")
                or f"{stem}.weight_packed" not in tensors
            ):
                out[name] = tensor
        return out

    return quantized.write_dequantized(src, out, restore)


def quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed, weight_scale) of a float `W` `[N, K]`."""
    import torch

    rows, cols = weight.shape
    grouped = weight.float().view(rows, cols // group, group)
    scale = (grouped.abs().amax(dim=-1) / 7.5).clamp(min=1e-6).to(torch.bfloat16)
    q = (grouped / scale.float().unsqueeze(-1)).round().clamp(-8, 7).view(rows, cols)
    stored = (q + 8).to(torch.int64).view(rows, cols // PACK, PACK)
    words = torch.zeros(rows, cols // PACK, dtype=torch.int64)
    for i in range(PACK):
        words |= stored[..., i] << (4 * i)
    return words.to(torch.int32), scale


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 `W` `[N, K]`."""
    import torch

    rows = packed.shape[0]
    values = torch.stack([(packed >> (4 * i)) & 0xF for i in range(PACK)], dim=-1)
    q = values.view(rows, -1).float() - 8
    group = q.shape[1] // scale.shape[1]
    return q * scale.float().repeat_interleave(group, dim=1)
