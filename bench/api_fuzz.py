"""The API fuzzed from its own OpenAPI document, long (issue 47): Schemathesis generates
requests for every operation, valid ones and ones that break the schema, against `iris
serve`, and every answer is held to what a client relies on: a success or an OpenAI-style
4xx naming its field (`openai_error_body`), each status and body as the document says,
never a 5xx or a hang (`--request-timeout`).
Unlike the test (`tests/test_api_fuzz.py`, bounded and derandomized), failures are
counted and the run goes on; afterwards the server must hold nothing (`IDLE`) and stop
leaving no process.

    python -m bench.api_fuzz --examples 2000      # N per operation with inputs: ~5N requests
    python -m bench.api_fuzz --url http://127.0.0.1:8000 --examples 50   # a running server
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import requests  # Schemathesis' transport
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.strategies import SearchStrategy
from schemathesis.core.failures import FailureGroup

from bench.results_io import (
    Checkpoint,
    add_arch_argument,
    add_model_argument,
    markdown_table,
    write_result,
)
from bench.server_process import IrisServer, group_processes, parse_metrics

# A short context keeps every generated request short, whatever max_tokens it asks for.
FUZZED_SERVER_ARGS = ("--max-model-len", "256", "--tokenizer-workers", "1")
# The owners' counts once nothing runs (`/metrics`).
IDLE = {
    "iris_kv_cache_used_pages": 0.0,
    "iris_scheduler_pinned_images": 0.0,
    "iris_shm_arena_pinned_entries": 0.0,
    "iris_num_requests_running": 0.0,
    "iris_linear_state_slots_held": 0.0,
}
# 4xx answers that name no request field: the path's method, the body's size, the key.
NO_FIELD_STATUSES = {401, 405, 413}


@schemathesis.check
def openai_error_body(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                      case: schemathesis.Case) -> bool | None:  # fmt: skip
    """A 4xx is OpenAI's error object (message, type, param, code = the status), and
    names the request field it is about."""
    if not 400 <= response.status_code < 500:
        return None
    error = response.json().get("error")
    assert isinstance(error, dict), f"a {response.status_code} without an error object"
    assert isinstance(error.get("message"), str) and error["message"], "no error.message"
    assert isinstance(error.get("type"), str), "no error.type"
    assert error.get("code") == response.status_code, f"error.code {error.get('code')}"
    if response.status_code not in NO_FIELD_STATUSES:
        assert error.get("param"), f"a {response.status_code} naming no field: {error['message']}"
    return True


CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,  # every status answered is documented
    schemathesis.checks.response_schema_conformance,  # and its body is as documented
    openai_error_body,
]


EXAMPLE_DRAWS = 8  # draws from an operation's documented examples (about one of each)


def strategies(
    operation: schemathesis.APIOperation, examples: int
) -> list[tuple[SearchStrategy[schemathesis.Case], int]]:
    """(strategy, draws) for `operation`: its documented examples (the chat route's real
    media parts: `server/openapi_document.py`), then `examples` generated cases."""
    documented = [(s, EXAMPLE_DRAWS) for s in operation.get_strategies_from_examples()]
    return [*documented, (operation.as_strategy(), examples)]


@dataclass
class Tally:
    """One operation's answers: by status class, hangs, and the first failures' repros."""

    statuses: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())


def fuzz(
    operation: schemathesis.APIOperation, examples: int, timeout: float, run_seed: int
) -> Tally:
    """`examples` generated cases of `operation`, each answer checked; failures counted
    (the first five kept) rather than stopping the run."""
    tally = Tally()
    for strategy, draws in strategies(operation, examples):
        _fuzz_with(strategy, draws, tally, operation.label, timeout, run_seed)
    return tally


def _fuzz_with(
    strategy: SearchStrategy[schemathesis.Case],
    draws: int,
    tally: Tally,
    label: str,
    timeout: float,
    run_seed: int,
) -> None:
    @seed(run_seed)
    @given(case=strategy)
    @settings(max_examples=draws, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    def answer(case: schemathesis.Case) -> None:
        try:
            response = case.call(timeout=timeout)
        except (requests.Timeout, httpx.TimeoutException, TimeoutError):
            tally.statuses["hang"] += 1
            return
        tally.statuses[f"{response.status_code // 100}xx"] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, FailureGroup) as failure:  # counted; the run goes on
            tally.statuses["failed check"] += 1
            if len(tally.failures) < 5:
                tally.failures.append(f"{label}: {failure}"[:2000])

    answer()


def idle_after(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    """The first `/metrics` scrape showing the owners' counts at zero (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = parse_metrics(httpx.get(f"{base_url}/metrics", timeout=10).text)
        if all(seen.get(name) == value for name, value in IDLE.items()):
            return seen
        if time.monotonic() > deadline:
            return {name: seen.get(name, float("nan")) for name in IDLE}
        time.sleep(0.1)  # polling another process, bounded above


def processes_left(group: int, timeout: float = 10.0) -> list[tuple[int, list[str]]]:
    """The server's process group once its launcher has exited, given `timeout` for
    children reparented at the end to finish exiting (bounded)."""
    deadline = time.monotonic() + timeout
    while (left := group_processes(group)) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling /proc, bounded above
    return left


def run(
    base_url: str, examples: int, timeout: float, run_seed: int
) -> tuple[list[list], list[str], dict[str, float]]:
    """Every operation fuzzed in turn: the table's rows, the failures kept, and the owners'
    counts afterwards."""
    api = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    rows, failures = [], []
    for result in api.get_all_operations():
        operation = result.ok()
        started = time.monotonic()
        tally = fuzz(operation, examples, timeout, run_seed)
        s = tally.statuses
        rows.append([operation.label, tally.requests, s["2xx"], s["4xx"], s["5xx"], s["hang"],
                     s["failed check"], time.monotonic() - started])  # fmt: skip
        failures += tally.failures
    return rows, failures, idle_after(base_url)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_argument(parser)
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    add_arch_argument(parser)
    parser.add_argument("--url", help="fuzz this running server instead of starting one")
    parser.add_argument("--examples", type=int, default=2000, help="cases per operation")
    # a valid request may take long: n = 128 answers of a whole context each
    parser.add_argument("--request-timeout", type=float, default=300.0, help="a hang, seconds")
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    if args.url:
        rows, failures, idle = run(args.url, args.examples, args.request_timeout, args.seed)
        served, stopped = f"the server at {args.url}", "(not started here: not stopped)"
        label = "url"
    else:
        checkpoint = Checkpoint.of(args)
        server = IrisServer(checkpoint.model_dir, FUZZED_SERVER_ARGS)
        with server:
            rows, failures, idle = run(server.base_url, args.examples, args.request_timeout,
                                       args.seed)  # fmt: skip
        status = server.stop()
        assert server.process is not None
        left = processes_left(server.process.pid)
        served = f"`iris serve` on the {checkpoint.description} ({' '.join(FUZZED_SERVER_ARGS)})"
        stopped = f"stopped with exit status {status}, leaving {len(left)} processes"
        label = checkpoint.label
    table = markdown_table(
        ["operation", "requests", "2xx", "4xx", "5xx", "hangs", "failed checks", "seconds"], rows
    )
    total = sum(row[1] for row in rows)
    held = ", ".join(f"{name} {value:g}" for name, value in idle.items() if name in IDLE)
    body = (
        f"Schemathesis {schemathesis.__version__} against {served}: {args.examples} "
        f"generated cases per operation, seed {args.seed}, {total} requests. Checks: no 5xx, "
        f"every status and body as documented, a 4xx OpenAI's error object naming its field; "
        f"a request past "
        f"{args.request_timeout:g} s is a hang.\n\n{table}\n\nAfterwards: {held}; the server "
        f"{stopped}.\n" + "".join(f"\n    {line}" for f in failures for line in f.splitlines())
    )
    write_result(f"api_fuzz_{label}", "The API fuzzed from its own OpenAPI document", body,
                 args.out)  # fmt: skip


if __name__ == "__main__":
    main()
