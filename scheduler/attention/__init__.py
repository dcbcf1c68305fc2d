"""Paged attention backends behind one interface (`base.AttentionBackend`).

- `sdpa`: torch's scaled_dot_product_attention reading the paged cache in place, over
  each sequence's runs of consecutive pages; the CPU default and the reference the
  other backends are tested against.
- `triton` (being built): our own Triton kernels reading K/V through the page table
  (CUDA; tested on the CPU under `TRITON_INTERPRET=1`).

`--attention-backend auto` picks the fastest that works on the device.
"""

from __future__ import annotations

import torch

from iris_serve.scheduler.attention.base import (
    AttentionBackend,
    PageRun,
    SequenceChunk,
    new_token_slots,
    page_runs,
)
from iris_serve.scheduler.kv_cache import KVCache

BACKEND_NAMES = ("auto", "sdpa")

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "PageRun",
    "SequenceChunk",
    "create_backend",
    "new_token_slots",
    "page_runs",
    "resolve_backend_name",
]


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The backend `name` stands for on `device` ("auto" resolved); raises ValueError
    for a backend that cannot run there."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKEND_NAMES}")
    return "sdpa" if name == "auto" else name


def create_backend(name: str, kv_cache: KVCache, device: torch.device) -> AttentionBackend:
    resolve_backend_name(name, device)
    from iris_serve.scheduler.attention.sdpa import SdpaBackend

    return SdpaBackend(kv_cache, device)
