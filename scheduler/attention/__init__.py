"""Paged attention backends behind one interface (`base.AttentionBackend`):

- `sdpa`: torch's scaled_dot_product_attention reading the paged cache in place; the
  CPU default and the reference the other backends are tested against.
- `triton`: our own Triton kernels (CUDA; tested on the CPU under `TRITON_INTERPRET=1`),
  imported only when this backend is created, so the CPU path never needs the package.

`--attention-backend auto` picks `triton` on CUDA when the package is installed, `sdpa`
otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..kv.kv_cache import KVCache
from .base import (
    AttentionBackend,
    PageRun,
    SequenceChunk,
    StaticDecode,
    new_token_slots,
    page_runs,
)

BACKEND_NAMES = ("auto", "sdpa", "triton")

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "PageRun",
    "SequenceChunk",
    "StaticDecode",
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
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton else "sdpa"
    if name == "triton":
        if not has_triton:
            raise ValueError(
                "attention backend 'triton' needs the triton package (pip install triton)"
            )
        if device.type != "cuda" and not _triton_interpreted():
            raise ValueError(
                f"attention backend 'triton' runs on CUDA, not {device.type}; set "
                "TRITON_INTERPRET=1 to run its kernels on the CPU under the interpreter (slow)"
            )
    return name


def create_backend(name: str, kv_cache: KVCache, device: torch.device) -> AttentionBackend:
    if resolve_backend_name(name, device) == "triton":
        from .triton_backend import TritonBackend

        return TritonBackend(kv_cache, device)
    from .sdpa import SdpaBackend

    return SdpaBackend(kv_cache, device)


def _triton_interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (the values triton's knobs accept)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
