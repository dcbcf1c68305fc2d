"""`/metrics` in the Prometheus text format: the other processes' totals and gauges, and
the histograms the server observes. Iris's own series are `iris_*`; next to them, the
`vllm:*` series a vLLM Grafana dashboard and the Kubernetes inference gateway read, with
vLLM's names, buckets and meaning (`vllm/v1/metrics/loggers.py`).

The board keeps the latest `EngineStats` / `WorkerStats` of each process, read by a
collector at scrape time, so a scrape never waits on another process. Their gauges and
totals are the rows of `ipc.stats` (`ENGINE_SERIES`, `WORKER_SERIES`), each with its name,
kind and help; nothing here names one. Their counters are
totals since start, exposed as they are (worker totals summed): nothing is added up
here, so nothing is counted twice. Histograms are observed here: the encoder timings
each `EngineStats` carries, and per request, by the HTTP handlers, the time to first
token (`observe_first_token`) and the rest at a finish reason (`observe_finished`); a
request whose client left, or that failed, counts in the time to first token only; one
the server aborted because its client left counts in `iris_requests_abandoned_total`.

Every series is labelled `model_name` (the first served name, vLLM's label). With
data-parallel replicas every `iris_*` engine metric has one sample per replica,
`replica="r"`; a single scheduler's carry none. The `vllm:*` engine series always carry
vLLM's `engine="r"`. Per-request series cover all replicas: the server does not know
which replica ran a request. `vllm:request_queue_time_seconds` is the scheduler's own
figure, carried by the first output; vLLM's prefill, decode and inference times are not
exposed.

Every board has its own `CollectorRegistry`, so several apps in one process (tests)
never clash. Before the first stats arrive, every value reads zero.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from ..ipc.messages import EngineStats, FinishReason, RequestOutput, WorkerStats
from ..ipc.stats import ENGINE_SERIES, WORKER_SERIES, Series
from .responses import Usage

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes

ENCODER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (
    *(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0),
)
# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read alike
VLLM_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
VLLM_ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
VLLM_REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
    *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
DEFAULT_MAX_MODEL_LEN = 32768  # sizes the token-count buckets until `serve_model`


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to `max_model_len`."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


_NO_ENGINE = EngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=0,
                         pinned_images=0)  # fmt: skip


class MetricsBoard:
    """The latest stats of every process, and the server's own series, in one registry."""

    def __init__(
        self,
        num_replicas: int = 1,
        model_name: str = "",
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    ) -> None:
        self.num_replicas = num_replicas
        self.engines: dict[int, EngineStats] = {}  # the latest of each replica
        self.workers: dict[int, WorkerStats] = {}
        self.serve_model(model_name, max_model_len)

    def serve_model(self, model_name: str, max_model_len: int) -> None:
        """Labels every series `model_name` and sizes the token-count buckets by
        `max_model_len` (as vLLM does). The app calls it before the server starts: the
        server's own series start again, empty."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_LatestStats(self))
        self.observed = _ServerSeries(self.registry, model_name, max_model_len)

    def update(self, stats: EngineStats | WorkerStats) -> None:
        if isinstance(stats, EngineStats):
            self.engines[stats.replica] = stats
            for seconds in stats.encoder_seconds:
                self.observed.encoder_seconds.observe(seconds)
        else:
            self.workers[stats.worker_id] = stats

    def observe_first_token(self, seconds: float) -> None:
        """A request's first generated token reached the server `seconds` after it did."""
        self.observed.iris_first_token.observe(seconds)
        self.observed.first_token.observe(seconds)

    def observe_before_first_token(self, first: RequestOutput) -> None:
        """A request's first output: how long it waited in the scheduler before its first
        step, and how long its prefill took (its steps' share apart)."""
        for series, seconds in (
            (self.observed.queue_time, first.queue_seconds),
            (self.observed.prefill_time, first.prefill_seconds),
            (self.observed.prefill_steps, first.prefill_step_seconds),
        ):
            if seconds is not None:
                series.observe(seconds)

    def observe_finished(
        self,
        finish_reason: str,
        usage: Usage,
        arrival: float,
        received: Sequence[tuple[float, int]],
    ) -> None:
        """A request ended with `finish_reason` now: its token counts, its arrival, and
        `(when, how many tokens)` of each of its outputs that carried tokens (`perf_counter`).

        One inter-token latency per token after the first, as vLLM observes one per engine step.
        An output of k tokens (merged while the server was busy) splits its gap from the previous
        output into k equal latencies; tokens that came with the first token count 0."""
        series = self.observed
        series.success.labels(self.model_name, finish_reason).inc()
        series.e2e.observe(time.perf_counter() - arrival)
        series.prompt_tokens.observe(usage.prompt_tokens)
        series.generation_tokens.observe(usage.completion_tokens)
        for _ in range(received[0][1] - 1 if received else 0):
            series.inter_token.observe(0.0)
        for (before, _), (at, tokens) in itertools.pairwise(received):
            for _ in range(tokens):
                series.inter_token.observe((at - before) / tokens)

    def observe_abandoned(self) -> None:
        """A request left the server before the engine finished it (aborted there)."""
        self.observed.abandoned.labels(self.model_name).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ServerSeries:
    """The series the server observes itself, for one served model."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        def histogram(name: str, help_text: str, buckets: Sequence[float]) -> Histogram:
            family = Histogram(name, help_text, ["model_name"], buckets=buckets, registry=registry)
            return family.labels(model_name)  # exposed (empty) before the first observation

        first_token = (
            "From a request's arrival at the server to the server's receipt of its first "
            "generated token (each of n choices is a request)."
        )
        finished = "requests that ended with a finish reason"
        self.encoder_seconds = histogram(
            "iris_mm_encoder_seconds", "Duration of one vision-encoder call.", ENCODER_BUCKETS
        )
        self.iris_first_token = histogram(
            "iris_time_to_first_token_seconds", first_token, TTFT_BUCKETS
        )
        self.first_token = histogram(
            "vllm:time_to_first_token_seconds", first_token, VLLM_TTFT_BUCKETS
        )
        self.inter_token = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between a request's successive generated tokens as the server receives "
            "them, one per token after the first (outputs that queued up and arrived "
            f"merged share their gap evenly); {finished}.",
            VLLM_ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            f"From a request's arrival at the server to its last output; {finished}.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "From the scheduler's admission of a request to its first step (waiting for a "
            "batch slot and KV pages); observed with its first token.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "From a request's first step to its first token: its images' encoding and its "
            "prompt's chunks; observed with its first token.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_steps = histogram(
            "iris_request_prefill_step_seconds",
            "Of a request's prefill time, the wall time of the steps that computed its "
            "prompt (whole steps, shared with what else they ran); with its first token.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = histogram(
            "vllm:request_prompt_tokens",
            f"Prompt tokens of each request, image tokens included; {finished}.",
            token_buckets(max_model_len),
        )
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens",
            f"Tokens the engine generated for each request; {finished}.",
            token_buckets(max_model_len),
        )
        self.success = Counter(
            "vllm:request_success",
            "Requests that ended with a finish reason, by reason: stop (an end-of-sequence "
            "or stop token, or a stop string), length (max_tokens or the context length), "
            "abort (the engine ended it, as the server's shutdown does). Requests whose "
            "client left, or that failed, are not counted.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        for reason in get_args(FinishReason):
            self.success.labels(model_name, reason)  # every reason reads 0 from the start
        self.abandoned = Counter(
            "iris_requests_abandoned",
            "Requests the server aborted in the engine before they finished there: their "
            "client left (a cancelled stream, a closed connection), or another choice of "
            "the same request (n > 1) failed.",
            ["model_name"],
            registry=registry,
        )
        self.abandoned.labels(model_name)


class _LatestStats:
    """A collector over the board's latest stats (read at scrape time)."""

    def __init__(self, board: MetricsBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        board = self.board
        model = board.model_name
        engines = [board.engines.get(r, _NO_ENGINE) for r in range(board.num_replicas)]
        single = board.num_replicas == 1
        labels = ["model_name"] if single else ["model_name", "replica"]
        rows = [[model] if single else [model, str(r)] for r in range(board.num_replicas)]
        vllm_rows = [[model, str(r)] for r in range(board.num_replicas)]
        for series in ENGINE_SERIES:
            values = [series.value(e) for e in engines]
            yield _family(series.name, series, labels, rows, values)
            if series.vllm is not None:
                vllm_labels = ["model_name", "engine"]
                yield _family(series.vllm, series, vllm_labels, vllm_rows, values)
        workers = list(board.workers.values())
        for worker_series in WORKER_SERIES:
            total = sum(worker_series.value(w) for w in workers)
            yield _family(worker_series.name, worker_series, ["model_name"], [[model]], [total])


def _family(
    name: str,
    series: Series[Any],
    labels: list[str],
    rows: list[list[str]],
    values: list[float],
) -> Metric:
    """`series`' gauge or counter family, as `name`, with one sample per row of label values."""
    family: CounterMetricFamily | GaugeMetricFamily
    if series.kind == "counter":  # named without `_total`: the family adds it to the sample
        family = CounterMetricFamily(name.removesuffix("_total"), series.help, labels=labels)
    else:
        family = GaugeMetricFamily(name, series.help, labels=labels)
    for row, value in zip(rows, values, strict=True):
        family.add_metric(row, value)
    return family
