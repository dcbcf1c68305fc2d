"""GPTQ 4-bit checkpoints (AutoGPTQ's layout, `checkpoint_format` "gptq"), written by
round-to-nearest (`quantized.py` picks the tensors): each decoder projection `X` as
`X.qweight` (int32 `[K/8, N]`, nibble i of word r holding input row 8r + i), `X.qzeros`
(int32 `[G, N/8]`, nibble i of word j holding column 8j + i, stored as zero - 1),
`X.scales` (fp16 `[G, N]`) and `X.g_idx` (int32 `[K]`), its bias as it was, and
config.json's `quantization_config` {quant_method "gptq", bits 4, group_size, desc_act,
sym, checkpoint_format "gptq"}: asymmetric (a zero per group and column) unless
`symmetric` (every zero 8, as Qwen's GPTQ-Int4 releases, and all vLLM's CPU kernel
takes). With `desc_act` the rows are grouped in an order of their own (a seeded
permutation here, activation order in a real one), so `g_idx` is not monotone. The twin:
`Wt[k, n] = (q[k, n] - z[g_idx[k], n]) · s[g_idx[k], n]`, stored as `X.weight = Wt.T`.

Written apart from the scheduler's loader, so that a test of one against the other
compares two readings of the format.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from . import quantized

if TYPE_CHECKING:
    import torch

PACK = 8
GROUP_SIZE = 32  # the tiny checkpoints' widths (64, 192) are not multiples of 128


def write_gptq(
    src: str | Path,
    out: str | Path,
    group_size: int = GROUP_SIZE,
    desc_act: bool = False,
    symmetric: bool = False,
) -> Path:
    """The GPTQ checkpoint of the full-precision one in `src`, written to `out`."""

    def stored(name: str, weight: torch.Tensor) -> quantized.Tensors:
        # the projections of one input (q/k/v, gate/up) share its order, as in a real one
        seed = zlib.crc32(name.rsplit(".", 2)[0].encode())
        g_idx = row_groups(weight.shape[1], group_size, desc_act, seed)
        qweight, qzeros, scales = quantize(weight.t(), g_idx, group_size, symmetric)
        stem = name.removesuffix(".weight")
        return {
            f"{stem}.qweight": qweight, f"{stem}.qzeros": qzeros,
            f"{stem}.scales": scales, f"{stem}.g_idx": g_idx,
        }  # fmt: skip

    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": symmetric,
        "checkpoint_format": "gptq",
    }
    return quantized.write_quantized(src, out, stored, config, "gptq")


def write_gptq_twin(src: str | Path, out: str | Path) -> Path:
    """The float32 checkpoint holding exactly the weights of the GPTQ one in `src`."""
    config = json.loads((Path(src) / "config.json").read_text())["quantization_config"]
    offset = 1 if config.get("checkpoint_format", "gptq") == "gptq" else 0

    def restore(tensors: quantized.Tensors) -> quantized.Tensors:
        out: quantized.Tensors = {}
        for name, tensor in tensors.items():
            stem, _, leaf = name.rpartition(".")
            if leaf == "qweight":
                parts = [tensors[f"{stem}.{p}"] for p in ("qzeros", "scales", "g_idx")]
                out[f"{stem}.weight"] = dequantize(tensor, *parts, offset).t().contiguous()
            elif leaf not in ("qzeros", "scales", "g_idx") or f"{stem}.qweight" not in tensors:
                out[name] = tensor
        return out

    return quantized.write_dequantized(src, out, restore)


def row_groups(rows: int, group: int, desc_act: bool, seed: int) -> torch.Tensor:
    """Each input row's group: in input order, or by a seeded permutation (`desc_act`)."""
    import torch

    order = torch.arange(rows)
    if desc_act:
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(rows, dtype=torch.int32)
    g_idx[order] = (torch.arange(rows) // group).to(torch.int32)
    return g_idx


def quantize(
    wt: torch.Tensor, g_idx: torch.Tensor, group: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, qzeros, scales) of a float `Wt` `[K, N]`, round-to-nearest per group of
    the rows `g_idx` puts together: asymmetric, or around a zero of 8 (AutoGPTQ's `sym`)."""
    import torch

    rows, cols = wt.shape
    groups = -(-rows // group)
    w = wt.float()
    index = g_idx.long()
    low = torch.full((groups, cols), float("inf")).scatter_reduce(
        0, index[:, None].expand(rows, cols), w, "amin"
    )
    high = torch.full((groups, cols), float("-inf")).scatter_reduce(
        0, index[:, None].expand(rows, cols), w, "amax"
    )
    if symmetric:
        high = torch.maximum(high.abs(), low.abs())
        low = -high
    scales = ((high - low) / 15).clamp(min=1e-6).to(torch.float16)
    s = scales.float()
    zeros = torch.full_like(s, 8.0) if symmetric else (-low / s).round().clamp(0, 15)
    q = ((w / s[index]).round() + zeros[index]).clamp(0, 15).to(torch.int32)
    qweight = _pack(q.view(rows // PACK, PACK, cols).permute(0, 2, 1)).contiguous()
    qzeros = _pack((zeros.to(torch.int32) - 1).clamp(min=0).view(groups, cols // PACK, PACK))
    return qweight, qzeros, scales


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    offset: int,
) -> torch.Tensor:
    """float32 `Wt` `[K, N]`."""
    q = _unpack(qweight).permute(0, 2, 1).reshape(qweight.shape[0] * PACK, -1)
    z = _unpack(qzeros).reshape(qzeros.shape[0], -1) + offset
    index = g_idx.long()
    return (q.float() - z.float()[index]) * scales.float()[index]


def _pack(values: torch.Tensor) -> torch.Tensor:
    """int32 `[..., 8]` of values in [0, 15] -> int32 `[...]`, value i at bits 4i."""
    import torch

    words = torch.zeros(values.shape[:-1], dtype=torch.int64)
    for i in range(PACK):
        words |= values[..., i].long() << (4 * i)
    return words.to(torch.int32)


def _unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 `[...]` -> int32 `[..., 8]`."""
    import torch

    return torch.stack([(words >> (4 * i)) & 0xF for i in range(PACK)], dim=-1)
