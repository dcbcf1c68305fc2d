"""What the HTTP scenario benchmarks (`multiturn_image`, `agent_repeat`) share: the
cache-off flags, the smoke-test flags, the request body, the warm-up, one measured
request, the in-process worker replay, the command line and where the results go."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.images import image_part
from bench.results_io import (
    RESULTS_DIR,
    Checkpoint,
    add_arch_argument,
    add_common_arguments,
    add_model_argument,
    write_result,
)
from bench.server_process import (
    IrisServer,
    StreamedChat,
    delta,
    run_each,
    run_interleaved,
    stream_chat,
)
from bench.worker_probe import ProbeResult, WorkerProbe

CACHES_OFF = [
    "--disable-mm-processor-cache",
    "--disable-mm-embedding-cache",
    "--disable-prefix-caching",
]
# --quick: the fewest processes and the smallest reservations a server can start with.
QUICK_FLAGS = [
    "--tokenizer-workers", "1", "--kv-cache-memory", "64MiB", "--mm-processor-cache-gb", "0.125",
]  # fmt: skip
WARM_UP = [  # small images the workloads never send, each its own first image
    [{"role": "user", "content": [image_part(96, 64, seed=9000 + seed)]}] for seed in range(4)
]


def warm_up(client: httpx.Client, server: IrisServer, body: dict[str, Any]) -> None:
    """First-call costs out of the measurement: `body` with each of `WARM_UP`'s messages
    (different first images, so every tokenizer worker gets some). For Iris, returns
    once their counts are in /metrics, so none lands in the first measured request's
    deltas (a peer without Iris's /metrics returns once it answered them)."""
    before = server.metrics() if server.iris_metrics else {}
    generated = 0
    for messages in WARM_UP:
        generated += stream_chat(
            client, server.base_url, {**body, "messages": messages}
        ).completion_tokens
    if server.iris_metrics:
        server.metrics_after(before, requests=len(WARM_UP), generated_tokens=generated)


def client_costs(answer: StreamedChat) -> dict[str, Any]:
    """What the client sees of one streamed answer: the row any server gets."""
    return {
        "prompt_tokens": answer.prompt_tokens,
        "cached_tokens": answer.cached_tokens,
        "completion_tokens": answer.completion_tokens,
        "ttft_ms": 1e3 * answer.ttft,
        "e2e_ms": 1e3 * answer.latency,
    }


def measured_chat(
    client: httpx.Client, server: IrisServer, body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """One streamed request: its answer text and a row of what it cost, from the client
    (TTFT, end to end) and, for Iris, from /metrics deltas once its counts are in."""
    if not server.iris_metrics:
        answer = stream_chat(client, server.base_url, body)
        return answer.text, client_costs(answer)
    before = server.metrics()
    answer = stream_chat(client, server.base_url, body)
    after = server.metrics_after(before, generated_tokens=answer.completion_tokens)

    def counted(name: str) -> float:
        return delta(after, before, name)

    return answer.text, {
        **client_costs(answer),
        "hits": int(counted("iris_mm_processor_cache_hits_total")),
        "misses": int(counted("iris_mm_processor_cache_misses_total")),
        "processed": int(counted("iris_tokenizer_images_total")),
        "encoded": int(counted("iris_mm_images_encoded_total")),
        "vit_ms": 1e3 * counted("iris_mm_encoder_seconds_sum"),
        "server_ttft_ms": 1e3 * counted("iris_time_to_first_token_seconds_sum"),
    }


def replay_through_workers(
    model_dir: Path,
    flags: Sequence[str],
    max_pixels: int | None,
    requests: Iterable[list[dict[str, Any]]],
) -> Iterator[ProbeResult]:
    """A server's requests (each its chat messages), warm-up first as `warm_up` sent it,
    through the tokenizer-worker code in this process (`WorkerProbe`), in order: the
    workers' time and wire sizes, which /metrics does not have."""
    with WorkerProbe(model_dir, flags) as probe:
        for messages in WARM_UP:
            probe.run(messages, max_pixels=max_pixels)
        for messages in requests:
            yield probe.run(messages, max_pixels=max_pixels)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    add_arch_argument(parser)
    add_model_argument(parser)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every variant's server at once and take their requests in turns (fair "
        "on a shared machine); default: one server after another",
    )


@dataclass(frozen=True)
class Target:
    model_dir: Path
    label: str  # in file names and titles
    description: str  # in the result's first sentence
    out_dir: Path
    name: str  # of the result file, without its extension

    @property
    def png(self) -> str:
        return f"{self.name}.png"


def target(benchmark: str, args: argparse.Namespace) -> Target:
    """The checkpoint to serve and where the result goes, from `add_arguments`' flags."""
    checkpoint = Checkpoint.of(args)
    model_dir, label, description = checkpoint.model_dir, checkpoint.label, checkpoint.description
    out_dir = args.out or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{benchmark}_{label}" + ("_quick" if args.quick else "")
    return Target(model_dir, label, description, out_dir, name)


def run_variants(
    model_dir: Path,
    variants: Sequence[tuple[str, Sequence[str]]],
    steps: Callable[[str, IrisServer], Iterator[dict[str, Any]]],
    *,
    flags: Sequence[str],
    quick: bool,
    interleave: bool,
) -> dict[str, list[dict[str, Any]]]:
    """Each variant's rows (`steps` yields one per request): servers one after another,
    or all at once with their requests in turns (`interleave`). `quick` starts the
    sequential servers side by side, since start-up dominates a smoke test."""
    if interleave:
        return run_interleaved(model_dir, variants, steps, common_flags=flags)
    return run_each(
        model_dir,
        variants,
        lambda name, server: list(steps(name, server)),
        common_flags=flags,
        overlap_start=quick,
    )


def order_note(interleave: bool) -> str:
    """How the variants ran, for the result's first paragraph."""
    if interleave:
        return (
            "All variants' servers up at once, their requests taken in turns (one at a "
            "time: variant A's request k, B's, C's, then k+1), so load from outside hits "
            "them alike"
        )
    return "Each variant on its own `iris serve`, one after another"


def load_average() -> float:
    """The 1-minute load average (the machine may be shared: it goes in the result)."""
    return os.getloadavg()[0]


Rows = dict[str, list[dict[str, Any]]]  # each variant's rows, one per request


def scenario_main(
    benchmark: str,
    doc: str,
    count_flag: str,
    count_help: str,
    variants: Sequence[tuple[str, Sequence[str]]],
    *,
    setting: Callable[[str, int | None, bool], Any],
    requests: Callable[[Any, str, IrisServer], Iterator[dict[str, Any]]],
    probe_worker: Callable[[Path, list[dict[str, Any]], Any, list[str]], None],
    plot: Callable[[Rows, Path, str], None],
    report: Callable[[Any, str, Rows, str, tuple[float, float], str], str],
    title: str,
    plot_title: str,
) -> None:
    """A scenario benchmark's command line, end to end: `setting(size, count, quick)`
    gives the run (with its `flags`); every variant is served (`requests(run, name,
    server)` yields a row per request), each variant's requests are replayed through the
    tokenizer-worker code in process (`probe_worker`, for what /metrics lacks), then the
    plot and the result file are written."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument(count_flag, type=int, default=None, help=count_help)
    add_arguments(parser)
    args = parser.parse_args()
    run = setting(args.size, getattr(args, count_flag.removeprefix("--")), args.quick)
    out = target(benchmark, args)
    load_before = load_average()
    results = run_variants(
        out.model_dir, variants, lambda name, server: requests(run, name, server),
        flags=run.flags, quick=args.quick, interleave=args.interleave,
    )  # fmt: skip
    load = (load_before, load_average())
    for name, variant_flags in variants:
        probe_worker(out.model_dir, results[name], run, [*run.flags, *variant_flags])
    plot(results, out.out_dir / out.png, f"{plot_title} ({out.label})")
    body = report(run, out.description, results, out.png, load, order_note(args.interleave))
    write_result(out.name, f"{title} (HTTP, {out.label})", body, out.out_dir)


def setup_sentences(flags: Sequence[str], load: tuple[float, float]) -> str:
    """The end of a result's first paragraph: warm-up, server flags, machine load."""
    return (
        f"each server got a warm-up of {len(WARM_UP)} small-image requests. Server flags "
        f"for all: `{' '.join(flags) or '(defaults)'}`. Load average (1 min) before / after "
        f"the servers: {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores."
    )


def probe_warnings(results: Rows, position: str) -> list[str]:
    """A note where the in-process replay processed other images than the server did
    (then its worker times describe another workload)."""
    mismatched = [
        (r["variant"], r[position])
        for rows in results.values()
        for r in rows
        if r["probe_processed"] != r["processed"]
    ]
    if not mismatched:
        return []
    return [f"- WARNING: the in-process workers processed other images at {mismatched}"]
