"""MoE experts in a quantized checkpoint's layout, and back: Qwen's FP8 MoE releases store
each expert's projections apart (`...mlp.experts.{e}.{gate,up,down}_proj.weight`), while
the generated full-precision Qwen3-VL-MoE checkpoints fuse them as transformers 5 holds
them (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj` `[E, H, I]`; the hub's
bf16 files are the transposes). `split` turns a fused tensor into per-expert ones; `fuse`
turns them back for a twin that transformers must load as the source was."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Tensors = dict[str, "torch.Tensor"]
FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$"
)


def is_expert_weight(name: str) -> bool:
    return bool(FUSED.match(name) or PER_EXPERT.match(name))


def split(name: str, tensor: torch.Tensor, hidden: int, intermediate: int) -> Tensors:
    """A fused experts tensor (either orientation, told apart by `hidden` and
    `intermediate`) as per-expert `[out, in]` weights; a per-expert one as it is."""
    fused = FUSED.match(name)
    if fused is None:
        return {name: tensor}
    prefix, kind = fused["prefix"], fused["kind"]
    if kind == "gate_up_proj":
        ours = tensor if tensor.shape[1:] == (2 * intermediate, hidden) else tensor.transpose(1, 2)
        parts = {"gate_proj": ours[:, :intermediate], "up_proj": ours[:, intermediate:]}
    else:
        ours = tensor if tensor.shape[1:] == (hidden, intermediate) else tensor.transpose(1, 2)
        parts = {"down_proj": ours}
    return {
        f"{prefix}.{e}.{part}.weight": weights[e].contiguous()
        for part, weights in parts.items()
        for e in range(tensor.shape[0])
    }


def fuse(tensors: Tensors) -> Tensors:
    """Per-expert weights stacked into transformers 5's fused tensors (the rest as it is)."""
    import torch

    out: Tensors = {}
    grouped: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        kinds = grouped.setdefault(match["prefix"], {})
        kinds.setdefault(match["kind"], {})[int(match["expert"])] = tensor
    for prefix, kinds in grouped.items():
        count = len(kinds["down_proj"])
        gate_up = [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]]) for e in range(count)]
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.down_proj"] = torch.stack([kinds["down_proj"][e] for e in range(count)])
    return out
