"""Qwen3-MoE's sparse MLP: a router picks top-k of E experts per token, and only the experts
that receive tokens run, as grouped matmuls over the tokens sorted by expert.

No host sync: tokens are sorted by expert on the device, group ends come from a
device-side count (`_count_rows`), and `torch.nn.functional.grouped_mm` runs every
expert's rows in one call per projection. Where grouped_mm cannot run (a device or dtype
without it, or rows not 16-byte aligned) a loop over the experts that received tokens
does the same after one `.tolist()` of the counts. Either way an expert without tokens
costs nothing, unlike transformers 4.57's eval path (all E experts for every token).

Weights are kept in transformers 5's in-memory layout (also vLLM's `w13`/`w2`):
`experts.gate_up_proj` `[E, 2I, H]` (gate rows, then up rows) and `experts.down_proj`
`[E, H, I]`; `expert_weights_in_our_layout` turns every checkpoint layout into it. A
block-FP8 checkpoint's experts are held so too, in e4m3 (`fp8_experts`); a 4-bit one's
(AWQ, GPTQ, W4A16: stored per expert, packed as any linear layer of the format) as one
`GatedMLP` per expert, named by its index (`experts.3.gate_up_proj`), whose linear layers
load and compute through the format's method as the dense layers do, its kernels included
(`RoutedExperts.use_linear_method`); on CUDA those are stacked once loaded for our grouped
Triton GEMM (`int4_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8_experts, int4_experts
from .config import MoEConfig, VLModelConfig
from .cpu_linear import dense_product
from .layers import GatedMLP
from .linear_method import LinearLayer, LinearMethod, use_method
from .loader import Weight, load_parameter, materialized
from .tensor_parallel import SINGLE, ReplicatedLinear, TPShard, TPSplit


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, E]` logits -> (weights `[N, k]` in the logits' dtype, expert ids `[N, k]`), as
    transformers: softmax in fp32, top-k, renormalised to sum 1, cast back."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class RoutedExperts(nn.Module):
    """E SwiGLU experts stored as two 3-D tensors (no `.weight` suffix, as checkpoints). Under
    tensor parallelism every rank holds every expert, with its share of the expert width."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPShard = SINGLE
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        start, width = tp.split(intermediate_size, "moe_intermediate_size")
        self.hidden_size = hidden_size
        self.tp = tp
        self.share = (start, width)  # this rank's columns of the expert width
        self.fp8: fp8_experts.Fp8ExpertScales | None = None  # held in block FP8: its grids
        self.per_expert: tuple[GatedMLP, ...] = ()  # held by a 4-bit format's linear layers
        self._held_as: str | None = None
        self.int4_group: int | None = None  # stacked for the grouped 4-bit GEMM: its group
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, width))
        self.tp_splits = {
            "gate_up_proj": TPSplit(1, ((start, width), (intermediate_size + start, width))),
            "down_proj": TPSplit(2, ((start, width),)),
        }

    @property
    def quantization(self) -> str | None:
        """The format the experts are held in (None: the model's dtype)."""
        return self._held_as

    def use_block_fp8(self) -> None:
        """Holds the experts in block FP8 (`fp8_experts`), before loading."""
        fp8_experts.use_block_fp8(self, *self.share, self.intermediate_size)
        self._held_as = "block-fp8"

    def use_linear_method(self, method: LinearMethod) -> None:
        """Holds each expert as a `GatedMLP` (child `str(e)`) whose layers are built with
        `method`, before loading (on the meta device): a 4-bit checkpoint's per-expert
        tensors (`experts.3.gate_proj.qweight`) then load as a dense MLP's do, this rank's
        share of the expert width sliced by the layers themselves."""
        mlps = []
        for expert in range(self.num_experts):
            mlp = GatedMLP(
                self.hidden_size, self.intermediate_size, bias=False, act="silu", tp=self.tp
            )
            for layer in (mlp.gate_up_proj, mlp.down_proj):
                use_method(layer, method)
            self.add_module(str(expert), mlp)
            mlps.append(mlp)
        del self.gate_up_proj, self.down_proj
        self.tp_splits = {}
        self.per_expert = tuple(mlps)
        self._held_as = method.name

    def stacked_weights(self) -> int:
        """The weights the experts multiply by, where they are not linear layers of their
        own (0 where each expert has its layers)."""
        if self.per_expert:
            return 0
        if self.int4_group is not None:
            return self.num_experts * 3 * self.hidden_size * self.share[1]
        return self.gate_up_proj.numel() + self.down_proj.numel()

    def stack_for_grouped_kernel(self) -> None:
        """Once loaded: 4-bit experts held for our Triton GEMM (CUDA) are stacked, so each
        projection of every expert is one launch (`int4_experts`)."""
        if self.per_expert:
            int4_experts.stack(self)

    def load_weight(self, leaf: str, tensor: Weight, shard: int | None) -> int:
        """The loader's way in: a block-FP8 scale grid through `fp8_experts`, the rest as
        parameters are loaded."""
        if leaf.endswith(fp8_experts.SCALE):
            return fp8_experts.load_scale(self, leaf, tensor)
        return load_parameter(self, leaf, tensor, shard)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x `[N, H]`, experts and weights `[N, k]` -> `sum_k weight * expert(x)` `[N, H]`."""
        top_k = experts.shape[1]
        order = torch.argsort(experts.flatten(), stable=True)
        token = order // top_k  # the token of each (token, slot) pair, sorted by expert
        rows_per_expert = _count_rows(experts.flatten(), self.num_experts)
        sorted_x = x[token]
        if self.per_expert:
            sorted_y = self._per_expert_layers(sorted_x, rows_per_expert)
        elif self.int4_group is not None:
            product = int4_experts.grouped_product
            gate, up = product(self, "gate_up_proj", sorted_x, rows_per_expert).chunk(2, dim=-1)
            sorted_y = product(self, "down_proj", F.silu(gate) * up, rows_per_expert)
        else:
            gate, up = self._grouped(sorted_x, "gate_up_proj", rows_per_expert).chunk(2, dim=-1)
            sorted_y = self._grouped(F.silu(gate) * up, "down_proj", rows_per_expert)
        sorted_y = sorted_y * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, sorted_y)

    def _per_expert_layers(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Each expert with rows through its own layers' method (one `.tolist()` of the
        counts, so no CUDA graph records it: capture fails and one device decodes
        eagerly). The down projection's partial sums are left to the block to reduce."""
        out = x.new_empty(x.shape)
        start = 0
        for mlp, count in zip(self.per_expert, rows.tolist(), strict=True):
            if count:
                gate, up = _unreduced(mlp.gate_up_proj, x[start : start + count]).chunk(2, dim=-1)
                out[start : start + count] = _unreduced(mlp.down_proj, F.silu(gate) * up)
                start += count
        return out

    def _grouped(self, x: torch.Tensor, name: str, rows: torch.Tensor) -> torch.Tensor:
        """`_grouped_linear` over projection `name`. In block FP8 on CUDA through our
        grouped Triton GEMM, no count read back (CUDA graphs); on a CPU one expert with
        rows at a time (the loop reads the counts anyway; `fp8_experts.cpu_product`);
        elsewhere every expert dequantized at once."""
        weight = getattr(self, name)
        if weight.dtype != fp8_experts.FP8:
            return _grouped_linear(x, weight, rows)
        if x.is_cuda:
            return fp8_experts.grouped_product(self, name, x, rows)
        if x.device.type == "cpu":
            return _looped(
                x, rows, weight.shape[1], lambda e, xs: fp8_experts.cpu_product(self, name, e, xs)
            )
        return _grouped_linear(x, fp8_experts.dequantized(self, name, None, x.dtype), rows)


class SparseMoEBlock(nn.Module):
    """Checkpoint names `mlp.gate.weight` `[E, H]` (the router) and `mlp.experts.*`; with a
    shared expert (Qwen3.5-MoE) also `mlp.shared_expert.*`, a SwiGLU MLP every token runs,
    and `mlp.shared_expert_gate.weight` `[1, H]`, which scales its output by σ(gate(x))."""

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.tp = tp
        self.gate = ReplicatedLinear(hidden_size, moe.num_experts, bias=False)  # on every rank
        self.experts = RoutedExperts(moe.num_experts, hidden_size, moe.intermediate_size, tp)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(
                hidden_size, moe.shared_expert_intermediate_size, bias=False, act="silu", tp=tp
            )
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False)  # on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k)
        out = self.tp.all_reduce(self.experts(x, experts, weights))
        if self.shared_expert is None or self.shared_expert_gate is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def _unreduced(layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s product through its method, without a row-parallel layer's all-reduce."""
    return layer.method.apply(layer, x, None)


def _count_rows(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert `[E]`. Not `torch.bincount`: on CUDA it reads the largest id back
    to the host to size its output, a sync per layer that a CUDA graph cannot record."""
    counts = torch.zeros(num_experts, dtype=torch.long, device=experts.device)
    return counts.scatter_add_(0, experts, torch.ones_like(experts))


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`x` `[M, in]` sorted by group, `weight` `[E, out, in]`, `rows` `[E]` rows per group ->
    `[M, out]`: group e's rows times `weight[e].T`."""
    if _grouped_mm_works(x.device.type, x.dtype) and _aligned(x, weight):
        ends = torch.cumsum(rows, 0, dtype=torch.int32)
        return F.grouped_mm(x, weight.transpose(1, 2), offs=ends)
    return _looped(x, rows, weight.shape[1], lambda e, xs: dense_product(xs, weight[e]))


def _looped(
    x: torch.Tensor,
    rows: torch.Tensor,
    out_features: int,
    product: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`_grouped_linear` as a loop over the groups with rows (one `.tolist()` of the
    counts): `product(e, group e's rows)`, `[count, out_features]`."""
    out = x.new_empty(x.shape[0], out_features)
    start = 0
    for expert, count in enumerate(rows.tolist()):
        if count:
            out[start : start + count] = product(expert, x[start : start + count])
            start += count
    return out


def _aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """grouped_mm wants every row stride a multiple of 16 bytes."""
    size = x.element_size()
    return (x.shape[1] * size) % 16 == 0 and (weight.shape[1] * size) % 16 == 0


@cache
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch runs grouped_mm on this device and dtype, tried once on 16 rows."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        x = torch.ones(4, 8, device=device_type, dtype=dtype)
        w = torch.ones(2, 8, 8, device=device_type, dtype=dtype)
        ends = torch.tensor([1, 4], device=device_type, dtype=torch.int32)
        F.grouped_mm(x, w, offs=ends)
    except (RuntimeError, NotImplementedError):
        return False
    return True


# ------------------------------------------------------------------ checkpoint layouts

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(  # an expert's weight, or a block-FP8 checkpoint's scale grid of it
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)"
    r"\.weight(?P<suffix>_scale_inv)?$"
)


def expert_weights_for(
    config: VLModelConfig, weights: Iterable[tuple[str, Weight]]
) -> Iterator[tuple[str, Weight]]:
    """`expert_weights_in_our_layout` for the shapes of `config`'s experts (which it must
    have)."""
    if config.moe is None:
        raise ValueError(f"{config.architecture} config has no experts")
    return expert_weights_in_our_layout(
        weights,
        num_experts=config.moe.num_experts,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe.intermediate_size,
    )


def expert_weights_in_our_layout(
    weights: Iterable[tuple[str, Weight]],
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
) -> Iterator[tuple[str, Weight]]:
    """Passes every tensor through, with expert tensors turned into `[E, 2I, H]` / `[E, H, I]`.
    Fused tensors are oriented by shape against H and I (when H == 2I or H == I both layouts
    have one shape: this raises rather than guess). Per-expert tensors are stacked once all
    E of a layer's projection have arrived (a block-FP8 expert's scale grids likewise, into
    `gate_up_proj_scale_inv` / `down_proj_scale_inv`: `fp8_experts`); a layer still missing
    experts at the end raises."""
    h, i = hidden_size, intermediate_size
    ours = {"gate_up_proj": (num_experts, 2 * i, h), "down_proj": (num_experts, h, i)}
    hub = {"gate_up_proj": (num_experts, h, 2 * i), "down_proj": (num_experts, i, h)}
    pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        if fused := _FUSED.match(name):
            kind = fused["kind"]
            if ours[kind] == hub[kind]:
                raise ValueError(
                    f"{name}: hidden_size {h} and moe_intermediate_size {i} give the hub and "
                    f"transformers layouts one shape {tuple(tensor.shape)}; cannot tell them apart"
                )
            if tuple(tensor.shape) == hub[kind]:  # read whole to transpose (ours: sliced)
                tensor = materialized(tensor).transpose(1, 2)
            yield name, tensor
        elif per_expert := _PER_EXPERT.match(name):
            kind = per_expert["kind"]
            group = "down_proj" if kind == "down_proj" else "gate_up_proj"
            key = (f"{per_expert['prefix']}.{group}{per_expert['suffix'] or ''}", kind)
            pending.setdefault(key, {})[int(per_expert["expert"])] = materialized(tensor)
            yield from _stack_complete(pending, key[0], num_experts)
        else:
            yield name, tensor
    if pending:
        missing = [
            f"{fused_name} ({kind}: experts {sorted(set(range(num_experts)) - set(got))} missing)"
            for (fused_name, kind), got in sorted(pending.items())
        ]
        raise ValueError(f"incomplete per-expert weights: {', '.join(missing)}")


def _stack_complete(
    pending: dict[tuple[str, str], dict[int, torch.Tensor]], fused_name: str, num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `fused_name` stacked once every projection it is made of has all experts."""
    is_down = fused_name.removesuffix(fp8_experts.SCALE).endswith("down_proj")
    kinds = ("down_proj",) if is_down else ("gate_proj", "up_proj")
    groups = [pending.get((fused_name, kind), {}) for kind in kinds]
    if any(sorted(group) != list(range(num_experts)) for group in groups):
        return
    for kind in kinds:
        del pending[(fused_name, kind)]
    per_expert = [torch.cat([group[e] for group in groups]) for e in range(num_experts)]
    yield fused_name, torch.stack(per_expert)
