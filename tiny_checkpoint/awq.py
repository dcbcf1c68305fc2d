"""AWQ 4-bit checkpoints (GEMM packing), in the layout of Qwen's `-AWQ` releases
(`quantized.py` picks the tensors): each decoder projection `X` as `X.qweight` (int32
`[K, N/8]`, nibble i of word j holding column 8j + ORDER[i]), `X.qzeros` (int32
`[K/G, N/8]`, packed alike) and `X.scales` (fp16 `[K/G, N]`), its bias as it was, and
config.json's `quantization_config` {quant_method "awq", bits 4, group_size G, version
"gemm", zero_point true, modules_to_not_convert}. Round-to-nearest per group of G input
rows: `s = (max - min) / 15`, `z = round(-min / s)`, `q = round(w / s) + z`, both in
[0, 15]. The twin: `Wt[k, n] = (q[k, n] - z[k // G, n]) · s[k // G, n]`, stored as
`X.weight = Wt.T`.

Written apart from the scheduler's loader, so that a test of one against the other
compares two readings of the format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import quantized

if TYPE_CHECKING:
    import torch

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of nibble i, within its word
PACK = 8
GROUP_SIZE = 32  # the tiny checkpoints' widths (64, 192) are not multiples of 128


def write_awq(src: str | Path, out: str | Path, group_size: int = GROUP_SIZE) -> Path:
    """The AWQ checkpoint of the full-precision one in `src`, written to `out`."""

    def stored(name: str, weight: torch.Tensor) -> quantized.Tensors:
        qweight, qzeros, scales = quantize(weight.t(), group_size)
        stem = name.removesuffix(".weight")
        return {f"{stem}.qweight": qweight, f"{stem}.qzeros": qzeros, f"{stem}.scales": scales}

    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "version": "gemm",
        "zero_point": True,
    }
    return quantized.write_quantized(src, out, stored, config, "awq")


def write_awq_twin(src: str | Path, out: str | Path) -> Path:
    """The float32 checkpoint holding exactly the weights of the AWQ one in `src`."""
    config = json.loads((Path(src) / "config.json").read_text())
    group = int(config["quantization_config"]["group_size"])

    def restore(tensors: quantized.Tensors) -> quantized.Tensors:
        out: quantized.Tensors = {}
        for name, tensor in tensors.items():
            stem, _, leaf = name.rpartition(".")
            if leaf == "qweight":
                wt = dequantize(tensor, tensors[f"{stem}.qzeros"], tensors[f"{stem}.scales"], group)
                out[f"{stem}.weight"] = wt.t().contiguous()
            elif leaf not in ("qzeros", "scales") or f"{stem}.qweight" not in tensors:
                out[name] = tensor
        return out

    return quantized.write_dequantized(src, out, restore)


def quantize(wt: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, qzeros, scales) of a float `Wt` `[K, N]` (see the module)."""
    import torch

    rows, cols = wt.shape
    grouped = wt.float().view(rows // group, group, cols)
    low, high = grouped.amin(dim=1), grouped.amax(dim=1)
    scales = ((high - low) / 15).clamp(min=1e-6).to(torch.float16)
    s = scales.float()
    zeros = (-low / s).round().clamp(0, 15)
    q = ((grouped / s[:, None]).round() + zeros[:, None]).clamp(0, 15).view(rows, cols)
    return pack(q.to(torch.int32)), pack(zeros.to(torch.int32)), scales


def dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """float32 `Wt` `[K, N]`."""
    q, z = unpack(qweight), unpack(qzeros)
    rows = q.shape[0]
    return (
        q.float() - z.float().repeat_interleave(group, 0)[:rows]
    ) * scales.float().repeat_interleave(group, 0)[:rows]


def pack(values: torch.Tensor) -> torch.Tensor:
    """int32 `[R, N]` of values in [0, 15] -> AWQ's int32 `[R, N/8]`."""
    import torch

    rows, cols = values.shape
    columns = values.view(rows, cols // PACK, PACK).long()
    words = torch.zeros(rows, cols // PACK, dtype=torch.int64)
    for i, column in enumerate(ORDER):
        words |= columns[..., column] << (4 * i)
    return words.to(torch.int32)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 `[R, N/8]` -> int32 `[R, N]`."""
    import torch

    rows, count = words.shape
    values = torch.empty(rows, count, PACK, dtype=torch.int32)
    for i, column in enumerate(ORDER):
        values[..., column] = (words >> (4 * i)) & 0xF
    return values.view(rows, count * PACK)
