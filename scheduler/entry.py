"""The scheduler's process entry points, light to import.

The launcher hands these to `multiprocessing` (spawn), which pickles a target by its
module's name, so the launcher imports the module that defines it. Here that costs
nothing: the engine (torch, transformers, the model code; ~2 s of a core) is imported
inside the spawned process only, so the launcher starts every child at once and the
children's imports overlap instead of following the launcher's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iris_serve.scheduler.config import EngineConfig


@dataclass(frozen=True)
class SchedulerProcessConfig:
    engine: EngineConfig
    run_dir: str
    num_workers: int
    # Intra-op threads for torch on CPU (the launcher passes --scheduler-threads, by
    # default every usable core). The scheduler shares the cores with the server and the
    # tokenizer workers: on a machine busy with other work, an oversubscribed OpenMP pool
    # spin-waits (a tiny-model decode step took 1.8 ms with one thread, 23 ms with two).
    torch_threads: int = 1
    replica: int = 0  # the data-parallel replica this scheduler drives
    name: str = "scheduler"  # its process name (followers: `{name}-rank{r}`)


def run_scheduler(config: SchedulerProcessConfig, ready: Any) -> None:
    """The spawned scheduler process (`process.run_scheduler`); reports `(name, ok,
    info)` on `ready`."""
    from iris_serve.scheduler.process import run_scheduler as run

    run(config, ready)


def run_follower(
    engine: EngineConfig,
    run_dir: str,
    rank: int,
    threads: int,
    ready: Any,
    replica: int = 0,
    name: str | None = None,
) -> None:
    """A spawned tensor-parallel rank past the first (`ranks.run_follower`)."""
    from iris_serve.scheduler.ranks import run_follower as run

    run(engine, run_dir, rank, threads, ready, replica, name)
