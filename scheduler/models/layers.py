"""Building blocks shared by the language model and the vision towers.

Every function here reproduces transformers' Qwen2-VL arithmetic step for step (which
dtype each op runs in included), so fp32 results agree to rounding and bf16 results
round the same way. On a CPU the rotary embedding (and in bfloat16 the RMS norms) run as
one C++ pass each instead (`apply_rotary`, `fused_rms_norm`), in the same order of
roundings.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels
from .tensor_parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TPShard,
)


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its root mean square along the last dim, in fp32 (whatever x's dtype)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fused_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor | None:
    """The norm in one C++ pass per row on a CPU in bfloat16 (`cpu_kernels/rms_norm.cpp`,
    the same order of roundings as the modules below), or None where it does not run:
    another device, float32 (`cpu_kernels.RUNS_IN` says why), a weight in another dtype,
    a strided x, autograd recording, or the kernel did not build."""
    if (
        x.device.type != "cpu"
        or x.dtype not in cpu_kernels.RUNS_IN["rms_norm"]
        or weight.dtype != x.dtype
        or not x.is_contiguous()
        or (torch.is_grad_enabled() and weight.requires_grad)
        or not cpu_kernels.load("rms_norm")
    ):
        return None
    return torch.ops.iris_norm.rms_norm(x, weight, eps, zero_centered)


class RMSNorm(nn.Module):
    """Normalises in fp32, casts back, then scales (transformers' order)."""

    CPU_KERNELS: ClassVar[tuple[str, ...]] = ("rms_norm",)  # `fused_rms_norm`: cpu_kernels.load_for

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_rms_norm(x, self.weight, self.eps, zero_centered=False)
        if fused is not None:
            return fused
        return self.weight * rms_normalized(x, self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by `1 + weight` (Qwen3.5's decoder stores its norm weights centred on
    zero). Scales in fp32 before casting back: transformers' order for this norm, unlike
    `RMSNorm`'s, so bf16 rounds differently."""

    CPU_KERNELS: ClassVar[tuple[str, ...]] = ("rms_norm",)

    DUMMY_FILL: ClassVar[dict[str, float]] = {"weight": 0.0}  # `registry._init_dummy`: identity

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_rms_norm(x, self.weight, self.eps, zero_centered=True)
        if fused is not None:
            return fused
        return (rms_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise NotImplementedError(f"activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one `gate_up_proj`, whose two
    halves the loader fills from `gate_proj` and `up_proj` (`PACKED_SHARDS`). Under tensor
    parallelism a rank holds its share of the intermediate width, and `down_proj` sums the
    ranks' partial outputs."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        act: str,
        tp: TPShard = SINGLE,
    ) -> None:
        super().__init__()
        share = tp.split(intermediate_size, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (share, share), bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


# checkpoint module name -> (our fused module name, shard index)
PACKED_SHARDS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# ---------------------------------------------------------------- rotary embeddings


def rope_inv_freq(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies of a `dim`-wide rotary embedding, fp32, `[dim // 2]`."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta**exponent)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary_kernel_runs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `apply_rotary` takes the C++ kernel: on a CPU, float32 or bfloat16 throughout,
    each token's heads contiguous, contiguous cos/sin, autograd not recording x."""
    return (
        x.device.type == "cpu"
        and x.dim() == 3
        and x.dtype in cpu_kernels.DTYPES
        and cos.dtype == sin.dtype == x.dtype
        and cos.dim() == 2
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.is_contiguous()
        and sin.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
        and cpu_kernels.load("rotary")
    )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[N, heads, D]`, cos/sin `[N, R]` (already in x's dtype for the LM): rotates the
    first R dims of each head and passes the others through (R < D: Qwen3.5's partial
    rotary). On a CPU in one C++ pass, rounding as these ops do (`cpu_kernels/rotary.cpp`)."""
    if _rotary_kernel_runs(x, cos, sin):
        return torch.ops.iris_rotary.rotary(x, cos, sin)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated, passed = x[..., :rotary], x[..., rotary:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


def mrope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    dtype: torch.dtype,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[N, head_dim]` for M-RoPE positions `[3, N]` (temporal, height, width).

    Frequency band i of each half takes its angle from axis `i % 3` of the section it
    falls in: with section (16, 24, 24) the first 16 frequencies follow the temporal
    position, the next 24 the height and the last 24 the width.

    `interleaved` (Qwen3-VL): slot i follows the height if `i % 3 == 1` and
    `i < 3 * section[1]`, the width if `i % 3 == 2` and `i < 3 * section[2]`, else the
    temporal position; with (24, 20, 20) slots 60..63 are temporal.
    """
    freqs = positions[..., None].float() * inv_freq.float()  # [3, N, D/2]
    if interleaved:
        mixed = freqs[0].clone()
        for axis in (1, 2):
            slots = slice(axis, 3 * mrope_section[axis], 3)
            mixed[..., slots] = freqs[axis, ..., slots]
        freqs = mixed
    else:
        parts = freqs.split(list(mrope_section), dim=-1)
        freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class MRotaryEmbedding(nn.Module):
    """Holds the LM's inverse frequencies as a non-persistent fp32 buffer."""

    inv_freq: torch.Tensor  # registered as a buffer in __init__

    def __init__(
        self, head_dim: int, theta: float, mrope_section: Sequence[int], interleaved: bool = False
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.mrope_section = tuple(mrope_section)
        self.interleaved = interleaved
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta), persistent=False)

    def reset_buffers(self) -> None:
        """Recomputes `inv_freq` (needed after building on the meta device)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, device=self.inv_freq.device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return mrope_cos_sin(positions, self.inv_freq, self.mrope_section, dtype, self.interleaved)


# ------------------------------------------------------------ segmented attention


class SegmentPlan:
    """Non-causal attention restricted to contiguous segments of a flat token axis, built once
    per vision forward from `cu_seqlens` and reused by every block. Segments of equal length
    are gathered into one batched SDPA call (a tower with hundreds of same-sized windows makes
    a handful of calls), and memory grows with the sum of the segments' squared lengths,
    never with the square of the total: a call batches at most `max_scores // length**2`
    segments, so a backend that materialises the scores holds about one large image's worth.
    On a CPU in bfloat16 every segment is attended in one C++ call instead
    (`cpu_kernels/segment_attention.cpp`): torch's CPU flash kernel computes bf16 at fp32's
    pace."""

    def __init__(
        self, cu_seqlens: Sequence[int], device: torch.device, max_scores: int = 1 << 24
    ) -> None:
        self.starts = torch.tensor(list(cu_seqlens), dtype=torch.long)  # the kernel's segments
        by_length: dict[int, list[int]] = {}
        for start, end in itertools.pairwise(cu_seqlens):
            if end > start:
                by_length.setdefault(end - start, []).append(start)
        self.total = int(cu_seqlens[-1])
        self.whole = len(by_length) == 1 and len(by_length.get(self.total, [])) == 1
        self.groups: list[torch.Tensor] = []  # each [num_segments, length] token indices
        for length, group_starts in by_length.items():
            per_call = max(1, max_scores // (length * length))
            for i in range(0, len(group_starts), per_call):
                first = torch.tensor(group_starts[i : i + per_call], device=device)
                self.groups.append(first[:, None] + torch.arange(length, device=device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q/k/v `[total, heads, D]` -> `[total, heads, D]`."""
        scale = q.shape[-1] ** -0.5
        if self._kernel_runs(q, k, v):
            return torch.ops.iris_vision.segment_attention(q, k, v, self.starts, scale)
        if self.whole:  # 4-D inputs: the fused (flash / mem-efficient) kernels need them
            qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            return F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1)
        out = torch.empty_like(q)
        for index in self.groups:
            # [S, L, H, D] -> [S, H, L, D]
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))
            attended = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
            out[index] = attended.transpose(1, 2)
        return out

    @staticmethod
    def _kernel_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether `segment_attention.cpp` takes these: on a CPU, in a dtype `RUNS_IN` names
        (bfloat16: fp32 keeps SDPA's arithmetic), each head contiguous and of an even size it
        holds, no autograd, and the kernel built."""
        head = q.shape[-1]
        return (
            q.device.type == "cpu"
            and q.dtype in cpu_kernels.RUNS_IN["segment_attention"]
            and k.dtype == v.dtype == q.dtype
            and all(t.stride(-1) == 1 for t in (q, k, v))
            and head % 2 == 0
            and head <= cpu_kernels.MAX_HEAD_DIM
            and not (
                torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            )
            and cpu_kernels.load("segment_attention")
        )
