"""What the benchmark smoke tests share: running a bench script with `--quick` as a user
would (its own process, a private checkpoint cache, no hub), and reading its result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from iris_serve.scheduler.cpu_kernels.build import cache_dir as kernel_cache_dir

REPO = Path(__file__).resolve().parents[1]


def run_bench(module: str, *args: str, cache_dir: Path, timeout: float) -> str:
    """`python -m module *args` from the repo root; fails the test with the script's
    output if it fails, else returns its stdout."""
    result = bench_process(module, *args, cache_dir=cache_dir, timeout=timeout)
    assert result.returncode == 0, f"{module} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def bench_process(
    module: str, *args: str, cache_dir: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`python -m module *args` from the repo root, as a user would run it (its own
    process, a private checkpoint cache, no hub), whatever its exit status."""
    env = {"IRIS_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "IRIS_KERNEL_CACHE_DIR": str(kernel_cache_dir())}  # built once per machine  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, body rows) of each markdown table in `text`, in order."""
    found: list[list[list[str]]] = []
    previous = ""
    for line in text.splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):
                found.append([])
            found[-1].append([c.strip() for c in line.strip("|").split("|")])
        previous = line
    return [(table[0], table[2:]) for table in found]


def check_provenance(text: str) -> None:
    """A result file says when, where, how and from which commit it was made."""
    for field in ("- date:", "- machine:", "- command:", "- commit:"):
        assert field in text, f"the result has no {field!r} line"
