"""The multi-turn and agent benchmarks run end to end (`--quick`) and write their table
and plot: each starts its real `iris serve`s, so this is also a test of the bench's
server helper (start, /health, /metrics, SIGTERM) and of the cache metrics it reads."""

from __future__ import annotations

from pathlib import Path

from tests.bench_smoke import check_provenance, markdown_tables, run_bench

# Start-up of the servers (2-3 process trees importing torch) dominates: ~30 s on an
# idle 2-core machine, several times that when the cores are shared.
TIMEOUT_SECONDS = 420


def run_quick(module: str, model_dir: Path, tmp_path: Path, *args: str) -> tuple[str, Path]:
    """Runs `module --quick *args` on `model_dir`; returns its result's text and plot."""
    out = tmp_path / "results"
    run_bench(
        module, "--quick", "--model", str(model_dir), "--out", str(out), *args,
        cache_dir=tmp_path / "cache", timeout=TIMEOUT_SECONDS,
    )  # fmt: skip
    name = f"{module.removeprefix('bench.')}_{model_dir.name}_quick"
    return (out / f"{name}.md").read_text(), out / f"{name}.png"


def table_rows(text: str, first_column: str) -> tuple[list[str], list[list[str]]]:
    """The header and the body rows of the first table whose first column is so named."""
    return next(table for table in markdown_tables(text) if table[0][0] == first_column)


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
