"""Tokenizer workers in-process for tests: a factory of workers with their own arenas,
each closed at the end with its shared memory gone (checked)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from iris_serve.ipc.shm_arena import ShmArena
from iris_serve.ipc.shm_names import instance_prefix, segment_name, sweep
from iris_serve.tokenizer_worker.config import WorkerConfig
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from iris_serve.tokenizer_worker.worker import TokenizerWorker

MiB = 1 << 20


@contextmanager
def worker_factory(
    builder: PromptBuilder, instance: str, run_dir: Path, **defaults: Any
) -> Iterator[Callable[..., TokenizerWorker]]:
    """`make(arena_bytes=64 MiB, **config)` builds a worker (WorkerConfig fields in
    `config`, over `defaults`); on exit every worker is closed, its arena unlinked, and
    anything left under `instance` swept."""
    workers: list[TokenizerWorker] = []

    def make(arena_bytes: int = 64 * MiB, **config: Any) -> TokenizerWorker:
        fields = {**defaults, **config}
        cfg = WorkerConfig(0, str(builder.model_dir), str(run_dir), instance, arena_bytes, **fields)
        arena = ShmArena(segment_name(instance, len(workers)), arena_bytes, worker_id=0)
        workers.append(TokenizerWorker(cfg, builder, arena))
        return workers[-1]

    try:
        yield make
        for worker in workers:
            worker.close()
            assert not worker.arena.path.exists()
    finally:
        sweep(instance_prefix(instance))
