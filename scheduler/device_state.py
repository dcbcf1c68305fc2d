"""What one rank holds on its device: the model (or its tensor-parallel shard), the paged
KV cache and the attention backend over it, and a hybrid model's linear-attention state
pool. The engine (rank 0) and every follower rank build theirs here, so the ranks cannot
disagree on how."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .attention import AttentionBackend, create_backend
from .config import EngineConfig
from .hybrid.linear_state import LinearStates
from .kv.host_tier import HostMemory, host_blocks
from .kv.kv_cache import KVCache, KVLayout
from .kv.memory_profile import profile_activations
from .models.cpu_linear import pack_linears
from .models.registry import load_config, load_model
from .models.tensor_parallel import SINGLE, TPShard
from .step.decode_graphs import CudaGraphCapture, DecodeGraphs

if TYPE_CHECKING:
    from .models.qwen2_vl import Qwen2VLForCausalLM

logger = logging.getLogger(__name__)
# Left free on a GPU beyond the profiled activations: the CUDA context's growth, the
# allocator's fragmentation, the sampler's temporaries.
HEADROOM_BYTES = 1 << 30
# A hybrid model's linear-state snapshots by default, within half of the cache's memory.
DEFAULT_SNAPSHOTS = 64


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
        dtype = config.resolved_dtype(device)
        say = logger.info if tp.rank == 0 else logger.debug  # once per replica
        started = time.monotonic()
        say("loading %s on %s (%s)", config.model, device, str(dtype).removeprefix("torch."))
        model = load_model(config.model, dtype=dtype, device=device, tp=tp)
        say("model loaded in %.1f s", time.monotonic() - started)
        if device.type == "cpu" and config.cpu_linear == "onednn":
            say("CPU linear layers: %d prepacked for oneDNN", pack_linears(model))
        layout = KVLayout.of(model.config, config.page_size, dtype)
        budget = (
            None if config.num_kv_pages else _kv_budget_bytes(config, device, model, layout, tp)
        )
        linear_states = _linear_states(config, model, dtype, device, budget, tp)
        state_bytes = 0 if linear_states is None else linear_states.nbytes
        num_pages = config.num_kv_pages or layout.pages_for_budget((budget or 0) - state_bytes)
        if num_pages < 1 and linear_states is not None:
            raise ValueError(
                f"the linear-attention state ({state_bytes / 2**30:.2f} GiB for "
                f"{linear_states.num_slots} slots) leaves no memory for the KV cache: lower "
                "--max-num-seqs or --linear-state-snapshots, or give the cache more memory"
            )
        num_pages = agree_on_minimum(num_pages, tp, device)
        kv_cache = KVCache(layout, num_pages, device)
        say(
            "KV cache: %d pages of %d tokens (%d tokens, %.2f GiB per rank, %s)",
            num_pages,
            config.page_size,
            num_pages * config.page_size,
            num_pages * layout.bytes_per_page / 2**30,
            "set by num_kv_pages" if config.num_kv_pages else _kv_sizing(device),
        )
        if linear_states is not None:
            _say_hybrid(say, model, linear_states)
        host_memory = None
        if config.kv_offload_bytes:
            blocks = host_blocks(config.kv_offload_bytes, layout)
            host_memory = HostMemory(kv_cache, blocks, linear_states)
            say(
                "host tier: %.2f GiB of %s host memory per rank, up to %d KV pages (%d tokens; "
                "%.1fx the device's), with the image embeddings and state snapshots evicted",
                config.kv_offload_bytes / 2**30,
                "pinned" if device.type == "cuda" else "pageable",
                blocks,
                blocks * config.page_size,
                blocks / num_pages,
            )
        attention = create_backend(config.attention_backend, kv_cache, device)
        max_model_len = min(
            config.max_model_len or model.config.max_position_embeddings,
            model.config.max_position_embeddings,
            num_pages * config.page_size,
        )
        graphs = None
        if device.type == "cuda" and not config.enforce_eager:
            graphs = _capture_decode_graphs(
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


def _linear_states(
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
        snapshots = agree_on_minimum(max(0, min(DEFAULT_SNAPSHOTS, fit)), tp, device)
    return LinearStates(layout, config.max_num_seqs + snapshots + 1, device)


def _say_hybrid(say: Callable[..., None], model: Qwen2VLForCausalLM, states: LinearStates) -> None:
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


def _capture_decode_graphs(
    model: Qwen2VLForCausalLM,
    attention: AttentionBackend,
    device: torch.device,
    config: EngineConfig,
    max_model_len: int,
    tp: TPShard,
    linear_states: LinearStates | None = None,
) -> DecodeGraphs | None:
    """The decode graphs. Where capture fails on one device the server decodes eagerly
    and says why (a capture error leaves the device usable). Under tensor parallelism it
    stops instead, naming `--enforce-eager`: the other ranks go on capturing, inside
    collectives this rank would never join, and the launcher stops them all."""
    max_pages = -(-max_model_len // config.page_size)
    reserved = torch.cuda.memory_reserved(device)
    try:
        with torch.inference_mode():
            graphs = DecodeGraphs.build(
                model,
                attention,
                device,
                config.max_num_seqs,
                max_pages,
                CudaGraphCapture(device),
                linear_states,
            )
    except RuntimeError as error:
        if tp.size > 1:
            raise RuntimeError(
                f"capturing CUDA graphs for decode failed on rank {tp.rank} ({error}); "
                "--enforce-eager runs without them"
            ) from error
        logger.exception(
            "capturing CUDA graphs for decode failed: decode steps run eagerly "
            "(--enforce-eager skips the capture)"
        )
        torch.cuda.synchronize(device)
        return None
    if graphs is not None:
        logger.info(
            "decode graphs hold %.2f GiB of GPU memory (within the headroom)",
            (torch.cuda.memory_reserved(device) - reserved) / 2**30,
        )
    return graphs


def _kv_sizing(device: torch.device) -> str:
    """How the KV cache's size was chosen, for the start-up log."""
    if device.type == "cuda":
        return "sized from --gpu-memory-utilization after a memory profile"
    return "sized by --kv-cache-memory"


def rank_device(device: torch.device, index: int) -> torch.device:
    """On CUDA, the `index`-th scheduler process of a server (replica * tensor-parallel size +
    rank) uses the `index`-th GPU after the one configured; on the CPU all share it."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + index)


def agree_on_minimum(value: int, tp: TPShard, device: torch.device) -> int:
    """The smallest of every rank's `value` (a collective; `value` itself on one rank)."""
    if tp.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=tp.group)
    return int(tensor.item())


def _kv_budget_bytes(
    config: EngineConfig,
    device: torch.device,
    model: Qwen2VLForCausalLM,
    layout: KVLayout,
    tp: TPShard,
) -> int:
    if device.type != "cuda":
        return config.kv_cache_memory
    # every rank runs the prefill pass (a collective); only rank 0 runs the vision tower
    profile = profile_activations(model, config, layout, device, encoder=tp.rank == 0)
    logger.info(
        "activations profiled: a %d-token step %.2f GiB, a %d-token vision-tower call %.2f GiB",
        profile.prefill_tokens,
        profile.prefill_bytes / 2**30,
        profile.image_tokens,
        profile.encoder_bytes / 2**30,
    )
    free, total = torch.cuda.mem_get_info(device)
    embedding_cache = config.mm_embedding_cache_bytes if config.enable_mm_embedding_cache else 0
    return cuda_kv_budget(
        total,
        free,
        own=torch.cuda.memory_reserved(device),
        utilization=config.gpu_memory_utilization,
        embedding_cache=embedding_cache,
        activations=profile.total_bytes,
    )


def cuda_kv_budget(
    total: int, free: int, own: int, utilization: float, embedding_cache: int, activations: int
) -> int:
    """This process's KV cache bytes on a GPU, with the model loaded (`own`: what torch holds
    for it so far): `utilization` × `total`, less what it holds and will allocate (the
    embedding cache at its bound, the profiled `activations`, a headroom), and never more
    than is `free`. Other processes' memory is not counted against the share, so two servers
    at 0.45 each share one GPU, as two vLLM instances do."""
    later = embedding_cache + activations + HEADROOM_BYTES
    budget = min(int(total * utilization) - own, free) - later
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"no GPU memory left for the KV cache: --gpu-memory-utilization {utilization} "
            f"gives this server {total * utilization / gib:.1f} GiB of {total / gib:.1f}, "
            f"the model holds {own / gib:.1f}, {free / gib:.1f} GiB is free, and the "
            f"embedding cache, the activations and a headroom take {later / gib:.1f}: raise "
            "--gpu-memory-utilization or lower --mm-embedding-cache-gb"
        )
    return budget
