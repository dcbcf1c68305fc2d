"""The engine's settings: one frozen dataclass; CLI flags default to its fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    page_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes of KV cache on CPU
    gpu_memory_utilization: float = 0.9  # fraction of the GPU for weights + KV on CUDA
    num_kv_pages: int | None = None  # overrides both budgets (tests force preemption with it)
    max_num_batched_tokens: int = 2048  # token budget of one step: chunked-prefill size
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True  # reuse full KV pages keyed by tokens + image keys
    # Per-image vision-tower outputs shared by all requests, LRU-bounded in bytes; pinned
    # entries (images of running requests) are never evicted, so it may exceed the bound.
    enable_mm_embedding_cache: bool = True  # off: an embedding lives only for its request
    mm_embedding_cache_bytes: int = 1 << 30
    # "request": one key over all of a request's images (a new image invalidates them all).
    mm_cache_granularity: Literal["image", "request"] = "image"
    chunked_mm_encoding: bool = True  # off: every image of a request in its first chunk
    max_num_encoder_tokens: int = 4096  # image tokens (after merging) per vision-tower call

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.mm_embedding_cache_bytes < 0:
            raise ValueError("mm_embedding_cache_bytes must not be negative")
        if self.mm_cache_granularity not in ("image", "request"):
            raise ValueError("mm_cache_granularity must be 'image' or 'request'")
        if self.max_num_encoder_tokens < 1:
            raise ValueError("max_num_encoder_tokens must be positive")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; use one of {sorted(_DTYPES)}"
            ) from None
