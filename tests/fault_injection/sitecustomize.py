"""Test-only fault injection for a real `iris serve` (tests/test_server_faults_e2e.py).

Python imports `sitecustomize` at start-up in every process whose PYTHONPATH holds this
folder: the launcher and each spawned child. Nothing outside tests/ reads these variables
or this file.

- `IRIS_TEST_FAULT_SEED`: the model runner raises on every step that holds a request
  sampled with that seed, so a test can fail one request of its choosing.
- `IRIS_TEST_HOLD_SEED` with `IRIS_TEST_HOLD_DIR`: every prompt chunk of the request
  sampled with that seed appends a line to `DIR/chunks`; the step that holds its first
  one writes `DIR/held`, then waits (up to a minute) for the test to write
  `DIR/go`, so the test acts while that request is mid-prefill; each later chunk takes a
  fifth of a second more, so the rest of its prefill outlasts what the test did.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_FAULT_SEED = os.environ.get("IRIS_TEST_FAULT_SEED")
_HOLD_SEED = os.environ.get("IRIS_TEST_HOLD_SEED")
HOLD_SECONDS = 60.0
SLOW_CHUNK_SECONDS = 0.2

if _FAULT_SEED is not None or _HOLD_SEED is not None:
    from iris_serve.scheduler.step.model_runner import ModelRunner

    _run = ModelRunner.run

    def _seeded(plan, seed: str | None) -> list:  # type: ignore[no-untyped-def]
        if seed is None:
            return []
        return [c for c in plan.chunks if c.request.sampling.seed == int(seed)]

    def _hold_mid_prefill(plan) -> None:  # type: ignore[no-untyped-def]
        folder = Path(os.environ["IRIS_TEST_HOLD_DIR"])
        for chunk in _seeded(plan, _HOLD_SEED):
            if chunk.start >= chunk.request.prompt_len:
                continue  # a decode
            with (folder / "chunks").open("a") as chunks:
                chunks.write(f"{chunk.start} {chunk.num_tokens}\n")
            if (folder / "held").exists():
                time.sleep(SLOW_CHUNK_SECONDS)
                continue
            (folder / "held").write_text("")
            deadline = time.monotonic() + HOLD_SECONDS
            while not (folder / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # the test's barrier, bounded

    def _injected_run(self, plan, images):  # type: ignore[no-untyped-def]
        if _seeded(plan, _FAULT_SEED):
            raise RuntimeError("fault injected by tests/fault_injection")
        _hold_mid_prefill(plan)
        return _run(self, plan, images)

    ModelRunner.run = _injected_run  # type: ignore[method-assign]
