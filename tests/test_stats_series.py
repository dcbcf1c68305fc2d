"""`ipc.stats`: each figure of `EngineStats` / `WorkerStats` is declared once, as a row,
and reaches /metrics (`server.metrics`) and the throughput line (`server.stats_log`) from
that row alone; every figure a message carries has its row."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

import iris_serve.server.metrics as metrics_module
import iris_serve.server.stats_log as stats_log_module
from iris_serve.ipc.messages import EngineStats, WorkerStats
from iris_serve.ipc.stats import (
    ENGINE_SERIES,
    NOT_FIGURES,
    WORKER_SERIES,
    Series,
    Window,
    difference,
    level,
    total,
)
from iris_serve.server.metrics import MetricsBoard
from iris_serve.server.stats_log import throughput_line

MODEL = "m"


def distinct(cls: type[EngineStats] | type[WorkerStats], **fixed: int) -> msgspec.Struct:
    """A message whose every figure has a value of its own (7, 14, 21, ...)."""
    values = {
        field.name: (i + 1) * 7 if field.type is int else (i + 1) * 1.5
        for i, field in enumerate(msgspec.structs.fields(cls))
        if field.name not in NOT_FIGURES
    }
    return cls(**{**values, **fixed})


ENGINE = distinct(EngineStats, kv_pages_total=10_000)
WORKERS = [distinct(WorkerStats, worker_id=0), distinct(WorkerStats, worker_id=1)]


def families(board: MetricsBoard) -> dict[str, tuple[str, str, dict[tuple[str, ...], float]]]:
    """Each family's (type, help, {sorted label items: value}), `_created` samples left out."""
    found = {}
    for family in text_string_to_metric_families(board.render().decode()):
        samples = {
            tuple(sorted(s.labels.items())): s.value
            for s in family.samples
            if not s.name.endswith("_created")
        }
        found[family.name] = (family.type, family.documentation, samples)
    return found


def scraped(series: Series, name: str) -> str:
    """The family name the text format gives a row (a counter's drops `_total`)."""
    return name.removesuffix("_total") if series.kind == "counter" else name


def fed_board() -> MetricsBoard:
    board = MetricsBoard(model_name=MODEL)
    for stats in (ENGINE, *WORKERS):
        board.update(stats)
    return board


def test_every_declared_engine_figure_is_on_metrics_as_declared():
    found = families(fed_board())
    for series in ENGINE_SERIES:
        kind, help_text, samples = found[scraped(series, series.name)]
        assert (kind, help_text) == (series.kind, series.help), series.name
        assert samples == {(("model_name", MODEL),): series.value(ENGINE)}, series.name
        if series.vllm is not None:
            kind, help_text, samples = found[scraped(series, series.vllm)]
            assert (kind, help_text) == (series.kind, series.help), series.vllm
            engine_label = (("engine", "0"), ("model_name", MODEL))
            assert samples == {engine_label: series.value(ENGINE)}, series.vllm


def test_every_declared_worker_figure_is_on_metrics_summed_over_workers():
    found = families(fed_board())
    for series in WORKER_SERIES:
        kind, help_text, samples = found[scraped(series, series.name)]
        assert (kind, help_text) == (series.kind, series.help), series.name
        expected = sum(series.value(w) for w in WORKERS)
        assert samples == {(("model_name", MODEL),): expected}, series.name


def test_every_logged_figure_is_in_the_throughput_line():
    before = EngineStats(0, 0, 0, 10_000, 0)
    line = throughput_line([before], [ENGINE], seconds=2.0)
    assert line is not None
    window = Window(ENGINE, difference(ENGINE, before), 2.0)
    logged = [s for s in ENGINE_SERIES if s.log is not None and s.log.shown(window)]
    assert len(logged) >= 9  # tokens/s, requests, KV, the caches, the host tier
    for series in logged:
        assert series.log is not None
        assert series.log.text.format(series.log.number(series.value, window)) in line


@pytest.mark.parametrize("cls", [EngineStats, WorkerStats])
def test_every_figure_a_message_carries_is_declared(cls: type[EngineStats] | type[WorkerStats]):
    """Changing any one figure changes /metrics: a field added without its row fails here."""
    base = ENGINE if cls is EngineStats else WORKERS[0]
    board = fed_board()
    reference = families(board)
    for field in msgspec.structs.fields(cls):
        if field.name in NOT_FIGURES:
            continue
        changed = msgspec.structs.replace(base, **{field.name: getattr(base, field.name) + 1000})
        board.update(changed)
        assert families(board) != reference, f"{cls.__name__}.{field.name} has no row"
        board.update(base)
    assert families(board) == reference


def test_a_new_figure_is_one_row_and_reaches_metrics_and_the_log(
    monkeypatch: pytest.MonkeyPatch,
):
    """One row, and nothing else, puts a figure on /metrics and in the throughput line."""
    new = Series(
        "iris_test_pinned_now", "gauge", "A figure declared by this test.",
        lambda e: e.pinned_images, log=level("pinned {} (test)"),
    )  # fmt: skip
    rows = (*ENGINE_SERIES, new)
    for module in (metrics_module, stats_log_module):  # where the declaration is read
        monkeypatch.setattr(module, "ENGINE_SERIES", rows)
    found = families(fed_board())
    assert found["iris_test_pinned_now"] == (
        "gauge",
        "A figure declared by this test.",
        {(("model_name", MODEL),): ENGINE.pinned_images},
    )
    line = throughput_line([ENGINE], [ENGINE], seconds=1.0)
    assert line is not None and line.endswith(f", pinned {ENGINE.pinned_images} (test)")


def test_the_line_sums_replicas_field_by_field():
    one, two = distinct(EngineStats, replica=0), distinct(EngineStats, replica=1)
    summed = total([one, two])
    assert summed.prompt_tokens == one.prompt_tokens + two.prompt_tokens
    assert summed.host_tier_copy_seconds == one.host_tier_copy_seconds * 2
    assert difference(summed, one) == msgspec.structs.replace(two, replica=0)
