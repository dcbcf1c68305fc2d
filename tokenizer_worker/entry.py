"""The tokenizer worker's process entry point, light to import.

The launcher hands it to `multiprocessing` (spawn), which pickles a target by its
module's name, so the launcher imports the module that defines it. Here that costs
nothing: the worker (transformers' processors, torch; seconds of a core) is imported
inside the spawned process only, so the launcher starts every child at once and the
children's imports overlap instead of following the launcher's own.
"""

from __future__ import annotations

from typing import Any

from iris_serve.tokenizer_worker.config import WorkerConfig


def run_worker(config: WorkerConfig, ready: Any) -> None:
    """The spawned worker process (`process.run_worker`); reports `(name, ok, info)` on
    `ready`."""
    from iris_serve.tokenizer_worker.process import run_worker as run

    run(config, ready)
