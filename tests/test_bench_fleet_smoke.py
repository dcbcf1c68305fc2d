"""`bench.fleet_routing` runs end to end (two Dynamo frontends, three Iris workers) and
writes its table: its smoke test, with `--quick`."""

from __future__ import annotations

from pathlib import Path

from tests.bench_smoke import run_bench


def test_the_fleet_routing_benchmark_writes_its_table(tmp_path: Path) -> None:
    out = run_bench(
        "bench.fleet_routing", "--quick", "--results-dir", str(tmp_path),
        cache_dir=tmp_path / "cache", timeout=600,
    )  # fmt: skip
    table = (tmp_path / "fleet_routing_tiny.md").read_text()
    for row in ("one Iris node", "2 nodes, KV router", "2 nodes, round-robin"):
        assert row in table and row in out
    assert "round-robin / KV router" in table
