"""The scheduler role: owns the device (model code, KV pages, caches, batching, sampling).

Its public entry surface, the only names another role's launcher or CLI may import from
it (`tests/test_import_boundaries.py` holds that):

- `EngineConfig`: the engine's settings; `iris serve` derives its flags from the fields;
- `SchedulerProcessConfig`, `run_scheduler`: the scheduler process, started by the
  launcher; `run_follower`: a tensor-parallel rank past the first, started beside it;
- `main_generate`: `iris generate`, the in-process engine on one prompt;
- `builtin_checkpoint`, `main_tiny_model`: the built-in tiny checkpoint (the default
  model of `iris serve`) and `iris tiny-model`;
- `Engine`: the in-process engine, for benchmarks that measure it without the server
  (`bench.compute_bound`, `bench.gpu_roofline`, `bench.tensor_parallel`);
- `StepBroadcaster`, `join_group`: a tensor-parallel first rank's side, which
  `bench.tensor_parallel` composes in process as `run_scheduler` does.

The names resolve on first use (PEP 562), so importing the package loads nothing: the
server process reads `EngineConfig` without importing torch or the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from iris_serve.scheduler.config import EngineConfig
    from iris_serve.scheduler.engine import Engine
    from iris_serve.scheduler.entry import SchedulerProcessConfig, run_follower, run_scheduler
    from iris_serve.scheduler.generate import main_generate
    from iris_serve.scheduler.ranks import StepBroadcaster, join_group
    from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint, main_tiny_model

__all__ = [
    "Engine",
    "EngineConfig",
    "SchedulerProcessConfig",
    "StepBroadcaster",
    "builtin_checkpoint",
    "join_group",
    "main_generate",
    "main_tiny_model",
    "run_follower",
    "run_scheduler",
]
_HOMES = {
    "Engine": "engine",
    "EngineConfig": "config",
    "StepBroadcaster": "ranks",
    "join_group": "ranks",
    "SchedulerProcessConfig": "entry",
    "run_scheduler": "entry",
    "run_follower": "entry",
    "main_generate": "generate",
    "builtin_checkpoint": "tiny_checkpoint",
    "main_tiny_model": "tiny_checkpoint",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
