"""The engine's settings: one frozen dataclass; CLI flags default to its fields."""

from __future__ import annotations

from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")

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
