"""How many linear-attention state slots a hybrid model's rank holds beside its KV cache,
and what a hybrid checkpoint keeps per request (the served-load reports)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import EngineConfig
from ..kv.kv_cache import KVLayout
from ..models.registry import load_config
from ..models.tensor_parallel import TPShard
from .linear_state import LinearStates

if TYPE_CHECKING:
    from ..models.qwen2_vl import Qwen2VLForCausalLM

# A hybrid model's linear-state snapshots by default, within half of the cache's memory.
DEFAULT_SNAPSHOTS = 64


@dataclass(frozen=True)
class HybridFootprint:
    """What a hybrid model keeps per request beside its KV, on one rank, at a dtype."""

    state_bytes_per_slot: int  # one request's (or one snapshot's) linear-attention state
    kv_bytes_per_token: int  # over the full-attention layers only
    num_kv_layers: int
    num_layers: int


def hybrid_footprint(model_dir: str | Path, dtype: torch.dtype) -> HybridFootprint | None:
    """A checkpoint's `HybridFootprint` (read from its config alone); None when it has no
    linear-attention layers."""
    config = load_config(model_dir)
    if not config.is_hybrid:
        return None
    return HybridFootprint(
        config.linear_state_layout(dtype).bytes_per_slot,
        KVLayout.of(config, 1, dtype).bytes_per_page,
        config.num_kv_layers,
        config.num_layers,
    )


def linear_state_pool(
    config: EngineConfig,
    model: Qwen2VLForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    budget: int | None,
    tp: TPShard,
) -> LinearStates | None:
    """A hybrid model's state pool: a working slot per request that may run, then the
    prefix cache's snapshots (none without it), then one scratch slot that padding rows of
    decode graphs read and write. None for a model without linear layers. `budget`: the
    bytes of the KV cache and the pool together (None: the page count is set)."""
    if not model.config.is_hybrid:
        return None
    layout = model.config.linear_state_layout(dtype)
    working = config.max_num_seqs + 1
    snapshots = config.linear_state_snapshots
    if not config.enable_prefix_caching:
        snapshots = 0
    elif snapshots is None:
        fit = (
            DEFAULT_SNAPSHOTS if budget is None else budget // 2 // layout.bytes_per_slot - working
        )
        snapshots = tp.min_over_ranks(max(0, min(DEFAULT_SNAPSHOTS, fit)), device)
    return LinearStates(layout, config.max_num_seqs + snapshots + 1, device)


def say_hybrid(say: Callable[..., None], model: Qwen2VLForCausalLM, states: LinearStates) -> None:
    """The start-up lines of a hybrid model: what its state takes, and what the KV holds."""
    config = model.config
    layout = states.layout
    say(
        "linear-attention state: %d slots of %.1f MiB (%.2f GiB per rank): a running request "
        "holds one, the prefix cache's snapshots the rest (and one scratch slot)",
        states.num_slots,
        layout.bytes_per_slot / 2**20,
        states.nbytes / 2**30,
    )
    say(
        "the KV cache covers the %d full-attention layers of %d: the same memory holds "
        "%.1fx the tokens it would for a model of full-attention layers only",
        config.num_kv_layers,
        config.num_layers,
        config.num_layers / config.num_kv_layers,
    )
