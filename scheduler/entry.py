"""The scheduler's process entry points, light to import.

`multiprocessing` (spawn) pickles a target by its module's name, so the launcher imports
this module; the engine (torch, transformers, the model code) is imported inside the
spawned process only, so the children's imports overlap instead of following the
launcher's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ipc.messages import ReadySink
from .config import EngineConfig


@dataclass(frozen=True)
class SchedulerProcessConfig:
    engine: EngineConfig
    run_dir: str
    num_workers: int
    # Intra-op threads for torch on CPU (the launcher passes --scheduler-threads, by
    # default every usable core). The scheduler shares the cores with the server and the
    # tokenizer workers: on a machine busy with other work, an oversubscribed OpenMP pool
    # spin-waits, and a step then takes many times as long.
    torch_threads: int = 1
    replica: int = 0  # the data-parallel replica this scheduler drives
    name: str = "scheduler"  # its process name
    log_level: str = "info"

    def follower_name(self, rank: int) -> str:
        """The process name of this replica's tensor-parallel rank `rank` (> 0)."""
        return f"{self.name}-rank{rank}"


def run_scheduler(config: SchedulerProcessConfig, ready: ReadySink) -> None:
    """The spawned scheduler process (`process.run_scheduler`); reports its
    `SchedulerReady`, or a `ProcessFailed`, on `ready`."""
    from .process import run_scheduler as run

    run(config, ready)


def run_follower(config: SchedulerProcessConfig, rank: int, ready: ReadySink) -> None:
    """A spawned tensor-parallel rank past the first of `config`'s replica
    (`ranks.run_follower`); reports a `ProcessReady`, or a `ProcessFailed`, under its
    name on `ready`."""
    from ..common.logs import configure_logging
    from .ranks import run_follower as run

    name = config.follower_name(rank)
    configure_logging(config.log_level)
    run(config.engine, config.run_dir, rank, config.torch_threads, ready, config.replica, name)
