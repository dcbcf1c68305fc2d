"""The seam between a hybrid model's linear-attention layers and whoever owns their state.

A Gated DeltaNet layer keeps, per sequence, a state of fixed size whatever the sequence's
length: `conv`, the last `conv_kernel - 1` columns fed to its causal depthwise conv (the
raw q/k/v projections), and `recurrent`, the delta rule's matrix S of every value head,
`[value_heads, key_head_dim, value_head_dim]`, always fp32 (rounding S to bf16 step after
step drifts). Unlike paged KV it is overwritten in place as tokens go by, so it cannot be
shared or rewound: a prefix-cache hit restores a copy taken at that position.

`LinearStates` is the pool, one tensor per kind with a row per slot and linear layer; a
sequence's state is the same slot of every layer. The model reads and writes only the
slots a step's `LinearStepContext` names: its owner (`scheduler/linear_states.py`)
decides which slot is whose, clears a slot before a sequence's first token and copies
one into another to take or restore a snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import huge_pages


@dataclass(frozen=True)
class LinearStateLayout:
    """The shape of one slot, on this rank (its heads under tensor parallelism)."""

    num_layers: int  # linear-attention layers, numbered 0.. in decoder order
    conv_channels: int  # 2 * key_heads * key_head_dim + value_heads * value_head_dim
    conv_kernel: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_dtype: torch.dtype  # the model's dtype

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_channels, self.conv_kernel - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.value_heads, self.key_head_dim, self.value_head_dim)

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state over every linear layer."""
        conv = self.conv_channels * (self.conv_kernel - 1) * _itemsize(self.conv_dtype)
        recurrent = self.value_heads * self.key_head_dim * self.value_head_dim * 4
        return self.num_layers * (conv + recurrent)


class LinearStates:
    """`num_slots` states on `device`: `conv[layer, slot]`, `recurrent[layer, slot]`."""

    def __init__(self, layout: LinearStateLayout, num_slots: int, device: torch.device) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.conv = huge_pages.zeros(
            layout.num_layers, num_slots, *layout.conv_shape, dtype=layout.conv_dtype, device=device
        )
        self.recurrent = huge_pages.zeros(
            layout.num_layers,
            num_slots,
            *layout.recurrent_shape,
            dtype=torch.float32,
            device=device,
        )

    @property
    def nbytes(self) -> int:
        return self.layout.bytes_per_slot * self.num_slots

    def clear(self, slot: int) -> None:
        """The zero state: a sequence before its first token."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def copy(self, source: int, target: int) -> None:
        """Slot `target` becomes a copy of slot `source` (taking or restoring a snapshot)."""
        self.conv[:, target].copy_(self.conv[:, source])
        self.recurrent[:, target].copy_(self.recurrent[:, source])


@dataclass(frozen=True)
class SequenceStates:
    """One sequence's share of a step, in the step's flat token order."""

    slot: int  # read before its first token of the step, written after its last
    num_tokens: int
    # (k, snapshot slot): the state after the sequence's first k tokens of this step
    # (1 <= k <= num_tokens) is also written to the snapshot slot
    captures: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class LinearStepContext:
    """What a step's linear layers read: the pool and each sequence's slot, in order.
    `slot_ids` `[len(sequences)]` int64 on the device holds the same slots, for a batched
    path (a decode step: one token per sequence)."""

    states: LinearStates
    sequences: Sequence[SequenceStates]
    slot_ids: torch.Tensor

    @classmethod
    def of(cls, states: LinearStates, sequences: Sequence[SequenceStates]) -> LinearStepContext:
        slot_ids = torch.tensor(
            [s.slot for s in sequences], dtype=torch.long, device=states.conv.device
        )
        return cls(states, sequences, slot_ids)

    @property
    def is_decode(self) -> bool:
        """Every sequence has one token (a capture then follows its only token)."""
        return all(s.num_tokens == 1 for s in self.sequences)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
