"""Workers' shared-memory segments as pinned host memory on CUDA.

From pageable memory, CUDA copies through a staging buffer and the copy blocks the
calling thread; from memory registered with `cudaHostRegister` it is one asynchronous
DMA. The scheduler registers each segment once, as it maps it (read-only, as the mapping
is), and unregisters it before unmapping. The copy is complete before the entry's pin can
go back to the worker: under the `thread` placement `EncoderThread.submit` waits for it,
under `inline` the step's own sync (its sampled ids) does.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ...ipc.shm_arena import MappingHook

logger = logging.getLogger(__name__)
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the segments are mapped read-only


def cuda_host_registrar(device: torch.device) -> MappingHook | None:
    """The `ShmReader(on_map=...)` hook for `device`: None off CUDA. A segment CUDA
    refuses to register stays pageable (copies still work, synchronously); the refusal
    is logged once."""
    if device.type != "cuda":
        return None
    cudart = torch.cuda.cudart()
    assert cudart is not None  # typed Optional, but it raises rather than return None
    warned = False

    def register(address: int, size: int) -> Callable[[], None]:
        nonlocal warned
        error = cudart.cudaHostRegister(address, size, HOST_REGISTER_READ_ONLY)
        if int(error) != 0:
            clear_last_cuda_error()
            if not warned:
                logger.warning(
                    "cudaHostRegister refused a shared-memory segment (%s): image copies "
                    "to the GPU stay pageable",
                    error,
                )
                warned = True
            return lambda: None
        return lambda: cudart.cudaHostUnregister(address)

    return register


def clear_last_cuda_error() -> None:
    """Reads (and so resets) the CUDA runtime's last error in this thread. A refused
    `cudaHostRegister` leaves its error there, and PyTorch's check after the next kernel
    launch in this thread (the scheduler's step) would raise it as the step's own.
    torch's `cudart()` binding does not expose `cudaGetLastError`: it is called in the
    runtime library this process loaded (none loaded: nothing to clear)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libcudart.so" in path:
            ctypes.CDLL(path).cudaGetLastError()
            return
