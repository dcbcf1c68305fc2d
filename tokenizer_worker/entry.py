"""The tokenizer worker's process entry point, light to import (as `scheduler.entry`: the
worker's transformers and torch are imported inside the spawned process only).
"""

from __future__ import annotations

from ..ipc.messages import ReadySink
from .config import WorkerConfig


def run_worker(config: WorkerConfig, ready: ReadySink) -> None:
    """The spawned worker process (`process.run_worker`); reports a `ProcessReady`, or a
    `ProcessFailed`, on `ready`."""
    from .process import run_worker as run

    run(config, ready)
