"""Every process freezes its start-up heap before it serves.

A process that imported torch and transformers and built its model holds hundreds of
thousands of tracked objects, all alive until it exits; a full collection, which a
request's garbage triggers now and then, walks them all and stalls the process (in the
HTTP server, every stream at once). `gc.freeze()` moves them into a generation the
collector never walks (vLLM's engine and API server do the same after start-up).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collects start-up's garbage once, then exempts the survivors from collection."""
    gc.collect()
    gc.freeze()
