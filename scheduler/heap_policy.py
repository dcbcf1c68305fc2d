"""A CPU rank keeps the memory one forward frees for the next (glibc's malloc told to).

A forward on the CPU allocates its activations anew on every call; a 1280×720 image's
vision tower makes dozens of tensors of tens of megabytes. By default glibc serves allocations
past its mmap threshold (at most 32 MiB, adjusted as blocks are freed) with fresh mappings
and hands free memory at the top of its heap back to the kernel once it passes the trim
threshold, so each call faults in, and the kernel zeroes, hundreds of megabytes that the
previous call had just given back. With both thresholds raised the freed blocks stay in
the heap and the next call reuses them: resident memory holds at the largest step's
high-water mark, as a GPU's caching allocator holds device memory (`bench.roofline`'s
tower and prefill rows show what the faults cost).

Other C libraries keep their defaults: `hold_freed_heap` says whether it applied.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30  # only a block this large gets a mapping of its own
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # free heap kept at the top before any goes back

_applied = False


def hold_freed_heap() -> bool:
    """Raises glibc's mmap and trim thresholds for this process (once); False where the C
    library is not glibc or refuses."""
    global _applied
    if _applied:
        return True
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    applied = bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD_BYTES))) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD_BYTES))
    )
    if not applied:
        logger.warning("glibc refused the heap thresholds; freed tensors go back to the kernel")
    _applied = applied
    return applied
