"""How many KV pages a rank holds, and how many host-tier blocks beside them: from the
configured page count, else from `--kv-cache-memory` on a CPU or from the GPU's share
after a memory profile (`memory_profile`), less a hybrid model's state pool. Every rank
takes the smallest count any rank can hold, so page ids mean the same on all."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..config import EngineConfig
from ..hybrid.linear_state import LinearStates
from ..models.tensor_parallel import TPShard
from .host_tier import HostMemory, host_blocks
from .kv_cache import KVCache, KVLayout
from .memory_profile import profile_activations

if TYPE_CHECKING:
    from ..models.qwen2_vl import Qwen2VLForCausalLM

logger = logging.getLogger(__name__)
# Left free on a GPU beyond the profiled activations: the CUDA context's growth, the
# allocator's fragmentation, the sampler's temporaries.
HEADROOM_BYTES = 1 << 30


def readable_bytes(nbytes: float) -> str:
    """`nbytes` for a start-up line: in GiB from 1 GiB up, else in MiB ("0.00 GiB" hides a
    small cache)."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


def kv_budget_bytes(
    config: EngineConfig,
    device: torch.device,
    model: Qwen2VLForCausalLM,
    layout: KVLayout,
    tp: TPShard,
) -> int:
    """The bytes of the KV cache and a hybrid model's state pool together: `--kv-cache-memory`
    off a GPU; on one, its share after profiling what a step and a vision-tower call take."""
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


def kv_page_count(
    config: EngineConfig,
    layout: KVLayout,
    budget: int | None,
    linear_states: LinearStates | None,
    tp: TPShard,
    device: torch.device,
) -> int:
    """The pages every rank holds: `num_kv_pages` if set, else what `budget` holds beside
    the state pool, the smallest over the ranks (a collective). Raises when the pool
    leaves no page."""
    state_bytes = 0 if linear_states is None else linear_states.nbytes
    num_pages = config.num_kv_pages or layout.pages_for_budget((budget or 0) - state_bytes)
    if num_pages < 1 and linear_states is not None:
        raise ValueError(
            f"the linear-attention state ({state_bytes / 2**30:.2f} GiB for "
            f"{linear_states.num_slots} slots) leaves no memory for the KV cache: lower "
            "--max-num-seqs or --linear-state-snapshots, or give the cache more memory"
        )
    return tp.min_over_ranks(num_pages, device)


def say_kv_cache(say: Callable[..., None], config: EngineConfig, kv_cache: KVCache) -> None:
    """The start-up line of the KV cache: its pages, tokens, size and how it was sized."""
    num_pages = kv_cache.num_pages
    say(
        "KV cache: %d pages of %d tokens (%d tokens, %s per rank, %s)",
        num_pages,
        config.page_size,
        num_pages * config.page_size,
        readable_bytes(num_pages * kv_cache.layout.bytes_per_page),
        "set by num_kv_pages" if config.num_kv_pages else _sizing(kv_cache.slots.device),
    )


def host_tier(
    config: EngineConfig,
    kv_cache: KVCache,
    linear_states: LinearStates | None,
    say: Callable[..., None],
) -> HostMemory | None:
    """This rank's side of the host tier (`kv_offload_bytes`); None without the tier."""
    if not config.kv_offload_bytes:
        return None
    blocks = host_blocks(config.kv_offload_bytes, kv_cache.layout)
    host_memory = HostMemory(kv_cache, blocks, linear_states)
    say(
        "host tier: %.2f GiB of %s host memory per rank, up to %d KV pages (%d tokens; "
        "%.1fx the device's), with the image embeddings and state snapshots evicted",
        config.kv_offload_bytes / 2**30,
        "pinned" if kv_cache.slots.device.type == "cuda" else "pageable",
        blocks,
        blocks * config.page_size,
        blocks / kv_cache.num_pages,
    )
    return host_memory


def _sizing(device: torch.device) -> str:
    """How the KV cache's size was chosen, for the start-up log."""
    if device.type == "cuda":
        return "sized from --gpu-memory-utilization after a memory profile"
    return "sized by --kv-cache-memory"
