"""The data-parallel benchmark runs end to end (`--quick`) and writes its tables and plot:
a one-scheduler and a `--data-parallel-size 2` server, so this is also a test of the
bench's /metrics reading of per-replica samples (summed under the unlabelled names)."""

from __future__ import annotations

from pathlib import Path

from tests.bench_smoke import check_provenance
from tests.test_bench_multiturn_agent_smoke import run_quick, table_rows

VARIANTS = ("default", "data-parallel 2")


def test_data_parallel_quick(qwen2_5_vl_tiny: Path, tmp_path: Path):
    text, png = run_quick("bench.data_parallel", qwen2_5_vl_tiny, tmp_path)
    check_provenance(text)
    assert png.stat().st_size > 0
    assert "not a speed claim" in text

    header, rows = table_rows(text, "round")
    for column in ("TTFT ms", "TTFT ÷ default", "images encoded", "encoded on replica"):
        assert column in header
    by = {(row[0], row[2]): dict(zip(header, row, strict=True)) for row in rows}
    assert set(by) == {(r, v) for r in ("1", "2") for v in VARIANTS}
    # One new image per round, encoded once, on whichever replica holds the conversation.
    assert all(row["images encoded"] == "1" for row in by.values())
    assert {by[r, "default"]["encoded on replica"] for r in ("1", "2")} == {"0"}
    home = {by[r, "data-parallel 2"]["encoded on replica"] for r in ("1", "2")}
    assert len(home) == 1 and home <= {"0", "1"}, home
    assert int(by["2", "data-parallel 2"]["cached tok"]) > 0  # the replica's prefix cache

    header, rows = table_rows(text, "variant")
    assert [row[0] for row in rows] == list(VARIANTS)
    assert rows[0][header.index("÷ default")] == "1"

    header, rows = table_rows(text, "conversation")  # independent ones, DP=2 only
    assert len(rows) == 8
    assert all(row[header.index("images encoded")] == "1" for row in rows)
    assert all(row[header.index("encoded on replica")] in ("0", "1") for row in rows)
    assert "WARNING" not in text
