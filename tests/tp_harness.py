"""Runs the engine as a tensor-parallel group of spawned CPU processes (gloo), as
`iris serve --tensor-parallel-size N` does: rank 0 is an `Engine` with a
`StepBroadcaster`, the other ranks run `run_follower` unchanged.

`generate_tp(model_dir, size, rounds, **engine_overrides)` runs each round's prompts to
completion (all added at once) on one group and returns, per round, the outputs and the
engine's stats after it, plus the largest step message rank 0 sent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling

RESULT_TIMEOUT_SECONDS = 300.0


@dataclass
class TPRun:
    outputs: list[list[list[int]]]  # per round, per prompt
    stats: list[Any]  # EngineSnapshot after each round
    max_message_bytes: int  # the largest RankStep rank 0 sent


class _Ready:
    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def put(self, item: Any) -> None:
        self.connection.send(("ready", item))


def _rank_main(
    rank: int,
    size: int,
    run_dir: str,
    engine_kwargs: dict[str, Any],
    rounds: list[list[PromptInput]],
    sampling: Sampling,
    connection: Any,
) -> None:
    import torch

    from iris_serve.scheduler.config import EngineConfig
    from iris_serve.scheduler.ranks import StepBroadcaster, join_group, run_follower
    from iris_serve.scheduler.step.engine import Engine

    torch.set_num_threads(1)
    config = EngineConfig(tensor_parallel_size=size, **engine_kwargs)
    if rank > 0:
        run_follower(config, run_dir, rank, 1, _Ready(connection))  # exits the process
    tp = join_group(Path(run_dir), 0, size, config)
    broadcaster = StepBroadcaster(Path(run_dir), tp)
    try:
        engine = Engine(config, tp, broadcaster)
        outputs, stats = [], []
        for prompts in rounds:
            outputs.append(engine.generate(prompts, sampling))
            stats.append(engine.stats())
        connection.send(("result", TPRun(outputs, stats, broadcaster.max_message_bytes)))
        status = 0
    except BaseException as error:
        connection.send(("error", f"{type(error).__name__}: {error}"))
        status = 1
    finally:
        broadcaster.close()
    os._exit(status)  # as the scheduler process: no teardown of the process group


def generate_tp(
    model_dir: str | Path,
    size: int,
    rounds: list[list[PromptInput]],
    sampling: Sampling,
    **engine_overrides: Any,
) -> TPRun:
    engine_kwargs = {
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_memory": 16 << 20,
        "max_itl_stretch": 0,  # plans that do not depend on the machine (as `cpu_engine`)
        **engine_overrides,
    }
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="iris-tp-") as run_dir:
        pipes = [context.Pipe(duplex=False) for _ in range(size)]
        processes = [
            context.Process(
                target=_rank_main,
                args=(rank, size, run_dir, engine_kwargs, rounds, sampling, pipes[rank][1]),
                name=f"tp-rank{rank}",
            )
            for rank in range(size)
        ]
        for process in processes:
            process.start()
        try:
            kind, value = _rank0_result(pipes[0][0], processes)
            if kind != "result":
                raise AssertionError(f"rank 0 failed: {value}")
            for process in processes:
                process.join(30)
                assert process.exitcode == 0, f"{process.name} exited with {process.exitcode}"
            return value
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()


def _rank0_result(reader: Any, processes: list[Any]) -> tuple[str, Any]:
    """Rank 0's `(kind, value)`, skipping the followers' ready reports; fails as soon as a
    rank dies without one, or after `RESULT_TIMEOUT_SECONDS`."""
    deadline = time.monotonic() + RESULT_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if reader.poll(1.0):
            return reader.recv()
        dead = [p for p in processes if p.exitcode is not None]
        if dead:
            raise AssertionError(f"{dead[0].name} died (exit {dead[0].exitcode}) before a result")
    raise AssertionError(f"rank 0 gave no result in {RESULT_TIMEOUT_SECONDS:.0f} s")
