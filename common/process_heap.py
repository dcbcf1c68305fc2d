"""Every process freezes its start-up heap before it serves.

CPython's oldest-generation collection walks every tracked object, and a process that
imported torch and transformers and built its model holds hundreds of thousands of them,
all alive until it exits. A request's garbage then triggers, now and then, a full
collection of all of them, which stalls the process for as long as the walk takes (in
the HTTP server, every stream at once). `gc.freeze()` moves what start-up left into a permanent generation the collector never
walks, so collections cost what the requests allocated (vLLM's engine and API server do
the same after start-up).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collects start-up's garbage once, then exempts the survivors from collection."""
    gc.collect()
    gc.freeze()
