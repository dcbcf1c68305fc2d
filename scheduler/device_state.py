"""What one rank holds on its device: the model (or its tensor-parallel shard), the paged
KV cache and the attention backend over it, and a hybrid model's linear-attention state
pool. The engine (rank 0) and every follower rank build theirs here, so the ranks cannot
disagree on how; each step of the build lives with its concept (`load`, `kv.sizing`,
`hybrid.state_pool`, `step.graph_capture`, `heap_policy` for a CPU rank's malloc)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .attention import AttentionBackend, create_backend
from .auto_dtype import auto_dtype
from .config import EngineConfig
from .heap_policy import hold_freed_heap
from .hybrid.linear_state import LinearStates
from .hybrid.state_pool import linear_state_pool, say_hybrid
from .kv.host_tier import HostMemory
from .kv.kv_cache import KVCache, KVLayout
from .kv.sizing import host_tier, kv_budget_bytes, kv_page_count, say_kv_cache
from .load import load_rank_model
from .models.registry import load_config
from .models.tensor_parallel import SINGLE, TPShard
from .step.decode_graphs import DecodeGraphs
from .step.graph_capture import capture_decode_graphs

if TYPE_CHECKING:
    from .models.qwen2_vl import Qwen2VLForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class DeviceState:
    device: torch.device
    dtype: torch.dtype
    model: Qwen2VLForCausalLM
    kv_cache: KVCache
    attention: AttentionBackend
    max_model_len: int
    decode_graphs: DecodeGraphs | None
    # a hybrid model's: `max_num_seqs` working slots, then `linear_state_snapshots`
    linear_states: LinearStates | None = None
    # this rank's side of the host tier (`kv_offload_bytes`), None without the tier
    host_memory: HostMemory | None = None

    @classmethod
    def build(cls, config: EngineConfig, tp: TPShard = SINGLE, replica: int = 0) -> DeviceState:
        """Loads this rank's shard and sizes its KV cache; under tensor parallelism every rank
        takes the smallest page count any rank can hold (a collective), so page ids mean the
        same on all. `replica` picks the GPU. On CUDA the decode graphs are captured last, on
        every rank in the same order (their collectives are recorded too)."""
        device = rank_device(config.resolved_device(), replica * tp.size + tp.rank)
        say = logger.info if tp.rank == 0 else logger.debug  # once per replica
        if device.type == "cpu":
            hold_freed_heap()
        checkpoint_dtype = load_config(config.model).dtype
        dtype = config.resolved_dtype(device, checkpoint_dtype)
        if config.dtype == "auto":
            say("--dtype auto: %s", auto_dtype(device, checkpoint_dtype)[1])
        model = load_rank_model(config, device, dtype, tp, say)
        layout = KVLayout.of(model.config, config.page_size, dtype)
        budget = None if config.num_kv_pages else kv_budget_bytes(config, device, model, layout, tp)
        linear_states = linear_state_pool(config, model, dtype, device, budget, tp)
        kv_cache = KVCache(
            layout, kv_page_count(config, layout, budget, linear_states, tp, device), device
        )
        say_kv_cache(say, config, kv_cache)
        if linear_states is not None:
            say_hybrid(say, model, linear_states)
        host_memory = host_tier(config, kv_cache, linear_states, say)
        attention = create_backend(config.attention_backend, kv_cache, device)
        max_model_len = min(
            config.max_model_len or model.config.max_position_embeddings,
            model.config.max_position_embeddings,
            kv_cache.num_pages * config.page_size,
        )
        graphs = None
        if device.type == "cuda" and not config.enforce_eager:
            graphs = capture_decode_graphs(
                model, attention, device, config, max_model_len, tp, linear_states
            )
        return cls(
            device,
            dtype,
            model,
            kv_cache,
            attention,
            max_model_len,
            graphs,
            linear_states,
            host_memory,
        )


def rank_device(device: torch.device, index: int) -> torch.device:
    """On CUDA, the `index`-th scheduler process of a server (replica * tensor-parallel size +
    rank) uses the `index`-th GPU after the one configured; on the CPU all share it."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + index)
