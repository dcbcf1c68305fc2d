"""Test-only fault injection for a real `iris serve` (tests/test_server_faults_e2e.py).

Python imports `sitecustomize` at start-up in every process whose PYTHONPATH holds this
folder: the launcher and each spawned child. With `IRIS_TEST_FAULT_SEED` set, the model
runner raises on every step that holds a request sampled with that seed, so a test can
fail one request of its choosing. Nothing outside tests/ reads the variable or this file.
"""

from __future__ import annotations

import os

_SEED = os.environ.get("IRIS_TEST_FAULT_SEED")

if _SEED is not None:
    from iris_serve.scheduler.step.model_runner import ModelRunner

    _run = ModelRunner.run

    def _faulty_run(self, plan, images):  # type: ignore[no-untyped-def]
        if any(chunk.request.sampling.seed == int(_SEED) for chunk in plan.chunks):
            raise RuntimeError("fault injected by tests/fault_injection")
        return _run(self, plan, images)

    ModelRunner.run = _faulty_run  # type: ignore[method-assign]
