"""The scheduler role: owns the device (model code, KV pages, caches, batching, sampling).

Its public surface (`docs/design.md`, "Packages and seams"), resolved on first use, so
the server reads `EngineConfig` without importing torch or the model code:

- `EngineConfig`: the engine's settings; `iris serve` derives its flags from the fields;
- `SchedulerProcessConfig`, `run_scheduler`: the scheduler process, started by the
  launcher; `run_follower`: a tensor-parallel rank past the first, started beside it;
- `Engine`: the in-process engine (`iris generate`; the benchmarks that measure it
  without the server: `bench.compute_bound`, `bench.roofline`, `bench.tensor_parallel`);
- `StepBroadcaster`, `join_group`: a tensor-parallel first rank's side, which
  `bench.tensor_parallel` composes in process as `run_scheduler` does;
- `hybrid_footprint`: a hybrid checkpoint's state per request beside its KV per token
  (the served-load reports); `matmul_weights`, `decode_weight_bytes`: what a model's
  matmuls multiply by and a decode step reads (`bench.roofline`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .config import EngineConfig
    from .entry import SchedulerProcessConfig, run_follower, run_scheduler
    from .hybrid.state_pool import hybrid_footprint
    from .models.footprint import decode_weight_bytes, matmul_weights
    from .ranks import StepBroadcaster, join_group
    from .step.engine import Engine

__all__ = [
    "Engine",
    "EngineConfig",
    "SchedulerProcessConfig",
    "StepBroadcaster",
    "decode_weight_bytes",
    "hybrid_footprint",
    "join_group",
    "matmul_weights",
    "run_follower",
    "run_scheduler",
]
_HOMES = {
    "Engine": "step.engine",
    "EngineConfig": "config",
    "StepBroadcaster": "ranks",
    "join_group": "ranks",
    "hybrid_footprint": "hybrid.state_pool",
    "matmul_weights": "models.footprint",
    "decode_weight_bytes": "models.footprint",
    "SchedulerProcessConfig": "entry",
    "run_scheduler": "entry",
    "run_follower": "entry",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
