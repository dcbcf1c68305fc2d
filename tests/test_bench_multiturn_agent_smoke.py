"""The multi-turn and agent benchmarks run end to end (`--quick`) and write their table
and plot: each starts its real `iris serve`s, so this is also a test of the bench's
server helper (start, /health, /metrics, SIGTERM) and of the cache metrics it reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Start-up of the servers (2-3 process trees importing torch) dominates: ~30 s on an
# idle 2-core machine, several times that when the cores are shared.
TIMEOUT_SECONDS = 420


def run_quick(module: str, model_dir: Path, tmp_path: Path, *args: str) -> tuple[str, Path]:
    """Runs `module --quick *args` on `model_dir`; returns its result's text and plot."""
    out = tmp_path / "results"
    env = {**os.environ, "IRIS_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", module, "--quick", "--model", str(model_dir)]
    result = subprocess.run(
        [*command, "--out", str(out), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_SECONDS,
        check=False,
    )
    assert result.returncode == 0, f"{module} failed:\n{result.stdout}\n{result.stderr}"
    name = f"{module.removeprefix('bench.')}_{model_dir.name}_quick"
    return (out / f"{name}.md").read_text(), out / f"{name}.png"


def table_rows(text: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    """The header and the data rows of the markdown table whose header starts so."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header_start} |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return header, rows


def check_provenance(text: str) -> None:
    for field in ("- date:", "- machine:", "- command:", "- commit:"):
        assert field in text


def test_multiturn_image_quick(qwen2_5_vl_tiny: Path, tmp_path: Path):
    text, png = run_quick("bench.multiturn_image", qwen2_5_vl_tiny, tmp_path)
    check_provenance(text)
    assert png.stat().st_size > 0

    header, rows = table_rows(text, "round")
    for column in ("TTFT ms", "images encoded", "proc. cache misses", "cached tok", "worker ms"):
        assert column in header
    by = {(row[0], row[2]): dict(zip(header, row, strict=True)) for row in rows}
    variants = ("default", "request-granularity", "caches off")
    assert set(by) == {(r, v) for r in ("1", "2") for v in variants}
    # Round 2 adds one image: per-image caches encode one; per-request keys, or no cache,
    # re-encode both; only the default reuses the KV of the first round's image.
    assert [by["2", v]["images encoded"] for v in variants] == ["1", "2", "2"]
    assert [by["2", v]["images preprocessed"] for v in variants] == ["1", "1", "2"]
    assert by["2", "default"]["proc. cache hits"] == "1"
    assert int(by["2", "default"]["cached tok"]) > int(by["2", "request-granularity"]["cached tok"])
    assert by["2", "caches off"]["cached tok"] == "0"

    header, rows = table_rows(text, "variant")
    assert [row[0] for row in rows] == list(variants)
    assert "÷ default" in header and rows[0][header.index("÷ default")] == "1"
    assert "WARNING" not in text  # same prompts across variants; the probe saw the same misses


def test_agent_repeat_quick_interleaved(qwen2_5_vl_tiny: Path, tmp_path: Path):
    text, png = run_quick("bench.agent_repeat", qwen2_5_vl_tiny, tmp_path, "--interleave")
    check_provenance(text)
    assert png.stat().st_size > 0

    header, rows = table_rows(text, "step")
    for column in ("worker", "proc. cache misses", "worker ms", "→ scheduler bytes", "E2E ms"):
        assert column in header
    by = {(row[0], row[1]): dict(zip(header, row, strict=True)) for row in rows}
    assert set(by) == {(s, v) for s in ("0", "1", "2") for v in ("cache on", "caches off")}
    for step in ("1", "2"):  # 9 of 10 screenshots seen before
        on, off = by[step, "cache on"], by[step, "caches off"]
        assert on["proc. cache misses"] == on["images preprocessed"] == on["images encoded"] == "1"
        assert off["images preprocessed"] == off["images encoded"] == "10"
        # pixels stay in shared memory: the message to the scheduler is a few kB
        assert int(on["→ scheduler bytes"]) < 16_000 < int(on["pixel bytes in shm"])

    assert "requests taken in turns" in text
    header, rows = table_rows(text, "variant")
    assert [row[0] for row in rows] == ["cache on", "caches off"]
    assert header.count("÷ cache on") == 3
    assert "WARNING" not in text
