"""The API fuzzed from its own OpenAPI document (Schemathesis, the standard OpenAPI fuzzer):
requests generated from the schema, valid ones and ones that break it, against `iris
serve` on the tiny checkpoint. Every answer is a success or an OpenAI-style 4xx whose
error names its field, each status and body as the document says; never a 5xx or a hang; and once the run is over the server holds
nothing of it (no page, pin or request) and stops leaving no process or segment.

Bounded for CI (a fixed number of examples per operation, derandomized so a failure
reproduces); `bench/api_fuzz.py` runs the long, random one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.strategies import SearchStrategy

from bench.api_fuzz import CHECKS, FUZZED_SERVER_ARGS, IDLE, strategies
from tests.bench_smoke import markdown_tables, run_bench
from tests.server_harness import RunningServer, iris_server

EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def fuzzed(
    qwen2_5_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    with iris_server(
        qwen2_5_vl_tiny, *FUZZED_SERVER_ARGS, tmp_path=tmp_path_factory.mktemp("fuzz")
    ) as server:
        yield server


@pytest.fixture(scope="module")
def api(fuzzed: RunningServer) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzzed.base_url}/openapi.json")


def test_every_answer_is_a_success_or_a_4xx_naming_its_field(api: schemathesis.BaseSchema) -> None:
    """Each operation of the document in turn, `EXAMPLES_PER_OPERATION` cases each."""
    fuzzed = []
    for result in api.get_all_operations():
        operation = result.ok()
        for strategy, draws in strategies(operation, EXAMPLES_PER_OPERATION):
            answers_with(strategy, draws)
        fuzzed.append(operation.label)
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= set(fuzzed), fuzzed


def answers_with(strategy: SearchStrategy[schemathesis.Case], draws: int) -> None:
    """`draws` cases from `strategy`, each answer held to `CHECKS` (the first failure
    fails the test, shrunk, with its curl line)."""

    @given(case=strategy)
    @settings(
        max_examples=draws,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def answer(case: schemathesis.Case) -> None:
        response = case.call(timeout=60)
        case.validate_response(response, checks=CHECKS)

    answer()


def test_the_long_fuzzing_benchmark_writes_its_table(fuzzed: RunningServer, tmp_path: Path) -> None:
    """`bench.api_fuzz` against this server, two cases per operation: a row per
    operation, none with a 5xx, a hang or a failed check."""
    run_bench("bench.api_fuzz", "--url", fuzzed.base_url, "--examples", "2",
              "--out", str(tmp_path), cache_dir=tmp_path, timeout=300)  # fmt: skip
    [(header, rows)] = markdown_tables((tmp_path / "api_fuzz_url.md").read_text())
    assert header[:7] == ["operation", "requests", "2xx", "4xx", "5xx", "hangs", "failed checks"]
    assert {"POST /v1/chat/completions", "GET /v1/models"} <= {row[0] for row in rows}, rows
    assert all(row[4] == row[5] == row[6] == "0" for row in rows), rows


def test_after_the_fuzzing_the_server_holds_nothing_of_it(fuzzed: RunningServer) -> None:
    """Runs after the fuzzing (pytest keeps a module's order): every page, pin and
    request given back; the fixture's exit checks no process or segment is left."""
    fuzzed.wait_for_metrics(IDLE)
