"""Tensor-parallel building blocks: one rank's shard of each layer and the collectives
that put the ranks' partial results back together, split the Megatron way
(`docs/scale-out.md`, "Tensor parallelism", the model). Vision towers are not split.

A shard knows which part of each checkpoint tensor it holds: a module's `tp_splits` maps a
parameter's name to a `TPSplit`, which the loader (for a linear layer, its
`linear_method.LinearMethod`) applies before the copy. With `size == 1` every class here
computes what its plain torch counterpart does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .linear_method import DENSE, LinearLayer


@dataclass(frozen=True)
class TPShard:
    """This process's place in a tensor-parallel group (`group` None: the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total`; raises naming `what`."""
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) is not divisible by tensor parallel size {self.size}"
            )
        length = total // self.size
        return self.rank * length, length

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (returned for chaining); a no-op on one rank."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (a collective through a tensor on `device`;
        `value` itself on one rank): what the ranks agree on where each may hold a different
        amount (pages, snapshots)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Ranks' `[..., n]` concatenated in rank order -> `[..., size * n]`."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPShard()


@dataclass(frozen=True)
class TPSplit:
    """The part of a checkpoint tensor one rank holds: along `dim`, the concatenation of
    `pieces` `(start, length)`, in the coordinates of the tensor that fills the parameter
    (for a packed parameter, `q_proj` into `qkv_proj`, piece i applies to checkpoint
    tensor i; otherwise all pieces apply to the one tensor, e.g. gate and up rows of a
    fused expert tensor). A parameter with fewer dims than `dim + 1` (a row-parallel
    layer's bias) is not split."""

    dim: int
    pieces: tuple[tuple[int, int], ...]

    def take(self, tensor: Any, packed_piece: int | None = None) -> Any:
        """This rank's part of `tensor` (a torch tensor, or a `loader.CheckpointTensor`,
        of which only that part is read)."""
        if tensor.dim() <= self.dim:
            return tensor
        if packed_piece is not None:
            return tensor.narrow(self.dim, *self.pieces[packed_piece])
        parts = [tensor.narrow(self.dim, start, length) for start, length in self.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class AttentionHeads:
    """This rank's attention heads: `num_heads` query heads starting at `q_start`, and
    `num_kv_heads` KV heads starting at `kv_start` (a replicated KV head when the group
    has more ranks than the model has KV heads)."""

    num_heads: int
    q_start: int
    num_kv_heads: int
    kv_start: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: TPShard) -> AttentionHeads:
        q_start, q_heads = tp.split(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            kv_start, kv_heads = tp.split(num_kv_heads, "num_key_value_heads")
        elif tp.size % num_kv_heads:
            raise ValueError(
                f"tensor parallel size {tp.size} is neither a divisor nor a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        else:  # each KV head serves size // num_kv_heads consecutive ranks
            kv_start, kv_heads = tp.rank // (tp.size // num_kv_heads), 1
        return cls(q_heads, q_start, kv_heads, kv_start)


@dataclass(frozen=True)
class LinearAttentionHeads:
    """This rank's Gated DeltaNet heads: `num_key_heads` q/k heads from `key_start` and
    `num_value_heads` v heads from `value_start`. Both counts are split evenly, so the
    value heads a key head serves (consecutive ones) stay on its rank."""

    num_key_heads: int
    key_start: int
    num_value_heads: int
    value_start: int

    @classmethod
    def of(cls, num_key_heads: int, num_value_heads: int, tp: TPShard) -> LinearAttentionHeads:
        key_start, key_heads = tp.split(num_key_heads, "linear_num_key_heads")
        value_start, value_heads = tp.split(num_value_heads, "linear_num_value_heads")
        return cls(key_heads, key_start, value_heads, value_start)


class ReplicatedLinear(LinearLayer):
    """A whole linear layer on every rank (the vision towers', a router's)."""


class ColumnParallelLinear(LinearLayer):
    """A slice of the output features: `pieces` `(start, length)` of each packed part
    (one part for an unpacked layer), bias sliced alike. No communication."""

    def __init__(self, in_features: int, pieces: Sequence[tuple[int, int]], bias: bool) -> None:
        super().__init__(in_features, sum(length for _, length in pieces), bias=bias)
        self.shard_sizes = tuple(length for _, length in pieces)
        split = TPSplit(0, tuple(pieces))
        self.tp_splits = {"weight": split, "bias": split}


def column_slices(in_features: int, pieces: Sequence[tuple[int, int]]) -> LinearLayer:
    """A layer (no bias) holding the rows `pieces` `(start, length)` of *one* checkpoint
    tensor, concatenated: unlike a packed `ColumnParallelLinear`, whose pieces come from
    several tensors (q, k and v heads of a projection stored fused, for instance)."""
    layer = LinearLayer(in_features, sum(length for _, length in pieces), bias=False)
    layer.tp_splits = {"weight": TPSplit(0, tuple(pieces))}
    return layer


class RowParallelLinear(LinearLayer):
    """A slice of the input features; the partial outputs are summed over the ranks, and
    the (unsplit) bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPShard) -> None:
        start, length = tp.split(in_features, "a row-parallel layer's input width")
        super().__init__(length, out_features, bias=bias)
        self.tp = tp
        self.tp_splits = {"weight": TPSplit(1, ((start, length),))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.method.apply(self, x, self.bias)
        out = self.tp.all_reduce(self.method.apply(self, x, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The rows of this rank's vocabulary range; other ids look up zeros, and the ranks'
    lookups are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPShard) -> None:
        start, length = tp.split(vocab_size, "vocab_size")
        super().__init__(length, hidden_size)
        self.vocab_start = start
        self.tp = tp
        self.tp_splits = {"weight": TPSplit(0, ((start, length),))}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside[:, None], 0))


def vocab_parallel_head(hidden_size: int, vocab_size: int, tp: TPShard) -> LinearLayer:
    """The LM head's rows of this rank's vocabulary range (logits all-gathered by the model).
    Always dense: the logits read its weight as they read tied embeddings."""
    start, length = tp.split(vocab_size, "vocab_size")
    head = LinearLayer(hidden_size, length, bias=False, method=DENSE)
    head.tp_splits = {"weight": TPSplit(0, ((start, length),))}
    return head
