"""The structured-output benchmark runs end to end (`--quick`: the tiny checkpoint, one
short round) and writes its three tables: every variant's batch stayed whole through its
window (the script fails otherwise), and the grammar timers saw the constrained rows."""

from __future__ import annotations

from pathlib import Path

from tests.bench_smoke import check_provenance, markdown_tables, run_bench

TIMEOUT_SECONDS = 300  # ~10 s alone; generous for a loaded CI machine
VARIANTS = [
    "(a) 8 free",
    "(b) 4 free + 4 json_schema",
    "(c) 8 json_schema",
    "(d) 4 free + 4 regex",
]


def test_structured_output_quick(tmp_path: Path):
    out = tmp_path / "results"
    run_bench(
        "bench.structured_output", "--quick", "--out", str(out),
        cache_dir=tmp_path / "cache", timeout=TIMEOUT_SECONDS,
    )  # fmt: skip
    text = (out / "structured_output_tiny_quick.md").read_text()
    check_provenance(text)
    steps, costs, once = markdown_tables(text)

    header, rows = steps
    assert [row[0] for row in rows] == VARIANTS
    by = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert by["(a) 8 free"]["step ÷ (a), p50"] == "1.000"
    assert by["(c) 8 json_schema"]["free tok/s"] == "-"
    assert all(float(row["tok/s"]) > 0 for row in by.values())

    header, rows = costs
    assert [row[0] for row in rows] == VARIANTS
    by = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert float(by["(a) 8 free"]["mask fill"]) == 0  # no grammar, no mask row
    for variant in VARIANTS[1:]:
        assert float(by[variant]["mask fill"]) > 0, variant
        assert float(by[variant]["accept"]) > 0, variant

    header, rows = once
    kinds = [row[0] for row in rows]
    assert kinds[0].startswith("first constrained request")
    assert {f"compile per request: {k}" for k in ("json_schema", "regex")} <= set(kinds)
    assert all(float(row[header.index("ms (median)")]) > 0 for row in rows)
