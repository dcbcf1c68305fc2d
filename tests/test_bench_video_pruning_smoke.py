"""The pruning drift benchmark runs (`--quick`): a server at q = 0 and one at q = 0.5 on
the tiny Qwen2.5-VL checkpoint, the same two video questions to each, its table written."""

from __future__ import annotations

from tests.bench_smoke import check_provenance, markdown_tables, run_bench

TIMEOUT_SECONDS = 240  # two server start-ups dominate


def test_video_pruning_quick(tmp_path):
    run_bench("bench.video_pruning", "--quick", "--out", str(tmp_path),
              cache_dir=tmp_path / "cache", timeout=TIMEOUT_SECONDS)  # fmt: skip
    text = (tmp_path / "video_pruning_tiny_quick.md").read_text()
    check_provenance(text)
    [(header, rows)] = markdown_tables(text)
    assert header[:3] == ["checkpoint", "q", "prompt tok (mean)"]
    assert [(r[0], r[1]) for r in rows] == [("Qwen2.5-VL tiny", "0"), ("Qwen2.5-VL tiny", "0.5")]
    assert rows[0][3:5] == ["1", "1"]  # q = 0 against itself
    assert float(rows[1][2]) < float(rows[0][2])  # fewer video tokens
