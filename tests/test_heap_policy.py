"""A CPU rank's freed tensors stay in the heap for the next forward (`heap_policy`): once
the heap has grown to them, the same allocations again fault in no new pages, where glibc's
defaults fault in every page of every large tensor on every call. Each case runs in a
process of its own, since the policy is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

ROUNDS = 16
TENSOR_PAGES = (48 << 20) // 4096  # one 48 MiB float32 tensor

# A forward's pattern in small: two large activations made, used and freed, round after
# round; the minor page faults of each round.
ROUNDS_CODE = """
import json, resource, sys, torch
from iris_serve.scheduler.heap_policy import hold_freed_heap
applied = hold_freed_heap() if sys.argv[1] == "hold" else None
faults = []
for _ in range({rounds}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = torch.empty(12 << 20).fill_(1.0)
    b = a * 2
    del a, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"applied": applied, "faults": faults}}))
"""


def rounds_faults(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", ROUNDS_CODE.format(rounds=ROUNDS), mode],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_tensors_are_reused_without_new_page_faults() -> None:
    default = rounds_faults("default")["faults"]
    held = rounds_faults("hold")
    assert held["applied"] is True
    # glibc's defaults: both tensors' pages faulted in again in every round
    assert min(default) >= 2 * TENSOR_PAGES * 0.9, default
    # held: the heap grows for the first rounds (how many varies with where glibc's blocks
    # land) to a high-water mark of a few tensors, then the rounds reuse it
    assert sum(held["faults"]) < 12 * TENSOR_PAGES, held["faults"]
    assert sum(held["faults"][-4:]) < TENSOR_PAGES // 20, held["faults"]
