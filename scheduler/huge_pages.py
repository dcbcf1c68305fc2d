"""Huge pages for what a CPU rank reads on every decode step: its weights and its KV cache.

A decode step reads every weight and its sequences' keys and values, front to back, in
runs that cross a 4 KiB page every 4 KiB: each crossing costs a TLB miss and a page walk,
and the hardware prefetcher stops at the boundary. On Linux with transparent huge pages
(`/sys/kernel/mm/transparent_hugepage/enabled` `always` or `madvise`),
`madvise(MADV_HUGEPAGE)` makes memory not yet touched fault in as 2 MiB pages and
`MADV_COLLAPSE` (Linux 6.1+) turns memory already in use into them at once. Elsewhere
(another OS, THP `never`, an older kernel) the kernel refuses and nothing changes.

- `zeros(*shape, dtype, device)`: a large tensor advised before its first write (the KV
  cache, the linear-attention state slots).
- `collapse_weights(model)`: once loaded and packed. A tensor of `IN_PLACE_BYTES` or more is
  collapsed where it lies; smaller ones (a small model's every layer) are copied side by
  side into arenas of at most `ARENA_BYTES` that are, which bounds the copy's extra memory.

`IRIS_HUGE_PAGES=0` turns both off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
IN_PLACE_BYTES = 4 << 20  # at least half of such a tensor lies on whole huge pages
ARENA_BYTES = 64 << 20
ALIGNMENT = 64  # a tensor's offset in an arena (a cache line: what the kernels load)
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_COLLAPSE = 25
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

_libc: ctypes.CDLL | None = None


def enabled() -> bool:
    """Whether this process may ask for huge pages: Linux, THP `always` or `madvise`, and
    not turned off by `IRIS_HUGE_PAGES=0`."""
    if os.environ.get("IRIS_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        with open(THP_SETTING) as setting:
            chosen = setting.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return False
    return chosen in ("always", "madvise")


def _madvise(start: int, length: int, advice: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0


def _whole_huge_pages(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The start and length of the 2 MiB-aligned stretch inside `tensor`'s bytes, if any."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return (first, last - first) if last > first else None


def advise_huge(tensor: torch.Tensor) -> int:
    """Asks that `tensor`'s memory fault in as huge pages (call it before the first write);
    the bytes asked for, 0 where not."""
    stretch = _whole_huge_pages(tensor) if enabled() else None
    if stretch is None or not _madvise(*stretch, MADV_HUGEPAGE):
        return 0
    return stretch[1]


def zeros(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, on huge pages where this is a CPU that gives them."""
    if device.type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device)
    tensor = torch.empty(*shape, dtype=dtype)
    advise_huge(tensor)
    return tensor.zero_()


def collapse(tensor: torch.Tensor) -> int:
    """Moves `tensor`'s memory, already written, onto huge pages now; the bytes moved, 0
    where the kernel refused (no THP, a kernel before 6.1, no free huge pages)."""
    stretch = _whole_huge_pages(tensor) if enabled() else None
    if stretch is None or not _madvise(*stretch, MADV_HUGEPAGE):
        return 0
    return stretch[1] if _madvise(*stretch, MADV_COLLAPSE) else 0


def _state_tensors(model: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor, bool]]:
    """(module, name, tensor, is_parameter) for every parameter and buffer, shared ones
    once per module that holds them."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name, param, True
        for name, buffer in module._buffers.items():
            if buffer is not None:
                yield module, name, buffer, False


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    nbytes = tensor.numel() * tensor.element_size()
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == nbytes
        and nbytes > 0
    )


def collapse_weights(model: nn.Module) -> int:
    """Puts `model`'s CPU parameters and buffers on huge pages (see the module's docstring);
    the bytes asked for. Values, dtypes, shapes and shared tensors are kept: a parameter
    keeps its object (its `.data` moves), a buffer is replaced in every module holding it."""
    if not enabled():
        return 0
    seen: dict[int, torch.Tensor] = {}
    small: list[torch.Tensor] = []
    moved = 0
    for _, _, tensor, _ in _state_tensors(model):
        if id(tensor) in seen or not _owns_its_storage(tensor):
            continue
        seen[id(tensor)] = tensor
        if tensor.numel() * tensor.element_size() >= IN_PLACE_BYTES:
            moved += collapse(tensor)
        else:
            small.append(tensor)
    replaced, in_arenas = _into_arenas(small)
    for module, name, tensor, is_parameter in _state_tensors(model):
        new = replaced.get(id(tensor))
        if new is None:
            continue
        if is_parameter:
            tensor.data = new
        else:
            module._buffers[name] = new
    return moved + in_arenas


def _into_arenas(tensors: list[torch.Tensor]) -> tuple[dict[int, torch.Tensor], int]:
    """Copies of `tensors`, side by side in arenas on huge pages, by the id of the original;
    and the arenas' bytes on huge pages."""
    copies: dict[int, torch.Tensor] = {}
    batch: list[torch.Tensor] = []
    batch_bytes = moved = 0

    def flush() -> None:
        nonlocal batch, batch_bytes, moved
        if batch:
            pages = -(-batch_bytes // HUGE_PAGE_BYTES)  # whole pages, the last one padded
            whole = torch.empty((pages + 1) * HUGE_PAGE_BYTES, dtype=torch.uint8)
            start = -whole.data_ptr() % HUGE_PAGE_BYTES
            arena = whole[start : start + pages * HUGE_PAGE_BYTES]  # on huge pages' bounds
            advise_huge(arena)
            offset = 0
            for tensor in batch:
                nbytes = tensor.numel() * tensor.element_size()
                view = arena[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor)
                copies[id(tensor)] = view
                offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
            moved += collapse(arena)
        batch, batch_bytes = [], 0

    for tensor in tensors:
        nbytes = -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
        if batch_bytes + nbytes > ARENA_BYTES:
            flush()
        batch.append(tensor)
        batch_bytes += nbytes
    flush()
    return copies, moved
