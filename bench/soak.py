"""A soak of everything at once (issue 47): several `iris serve`s on one machine, each under
closed-loop users sending `bench.soak_traffic`'s mix (screenshot agents with growing
histories and sliding windows, video questions, tool calls auto and forced, some cut by
`max_tokens`, json_schema, n=2 with logprobs, cancelled streams and slow readers) for
`--minutes`, every cache bounded small so each fills early and then evicts.

    python -m bench.soak --minutes 32          # Qwen2.5-VL, Qwen3.5 with the host tier, TP 2
    python -m bench.soak --minutes 31 --one-at-a-time    # each alone, one after another
    python -m bench.soak --servers qwen2_5_vl --minutes 5

At once, the servers contend for the machine's cores, so their tails measure each other
as much as themselves; `--one-at-a-time` gives each the machine alone for `--minutes`.

Per server and per `--window-minutes`: requests, errors by kind, TTFT / TPOT p50 and p99,
each process's RSS, and the owners' occupancy (KV pages held, the embedding cache, the
arenas' cached pixels, the host tier, Qwen3.5's snapshots, /dev/shm segments). Then the
verdict: unexpected errors, the last full window's p99 TTFT / TPOT over the second's,
each process's RSS growth over the last 15 minutes, the owners' counts back to zero once
the users stop, the exit status and what is left in /dev/shm.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench import soak_traffic
from bench.api_fuzz import IDLE
from bench.results_io import (
    ARCH_TITLES,
    add_common_arguments,
    markdown_table,
    write_result,
)
from bench.server_process import IrisServer, Metrics, group_processes

# Small bounds, so every cache is full within minutes and evicts from then on; the tool
# calls `tool_choice: auto` reads (as vLLM, only when asked for).
BOUNDS = (
    "--kv-cache-memory", "4MiB", "--mm-embedding-cache-gb", "0.002",
    "--mm-processor-cache-gb", "0.02", "--max-model-len", "8192",
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
)  # fmt: skip
SERVERS = {  # name: (architecture, flags beyond BOUNDS)
    "qwen2_5_vl": ("qwen2_5_vl", ()),
    "qwen3_5-host-tier": ("qwen3_5", ("--kv-offload-gib", "0.004")),
    "qwen2_5_vl-tp2": ("qwen2_5_vl", ("--tensor-parallel-size", "2")),
}
SAMPLE_SECONDS = 20.0
RSS_SPAN_MINUTES = 15.0  # the bar: RSS growth over the last 15 minutes
RSS_GROWTH_BAR = 0.02
P99_BAR = 1.2  # the last full window's p99 over the second's
DRAIN_SECONDS = 120.0  # the users' last requests after the deadline
OCCUPANCY = {  # column: (metric, unit)
    "KV pages held": ("iris_kv_cache_used_pages", 1),
    "embedding cache MiB": ("iris_mm_embedding_cache_usage_bytes", 1 << 20),
    "arena MiB": ("iris_shm_arena_usage_bytes", 1 << 20),
    "host tier MiB": ("iris_host_tier_usage_bytes", 1 << 20),
    "snapshots": ("iris_linear_state_snapshots", 1),
}


@dataclass
class Sample:
    at: float  # seconds into the run
    rss: dict[str, int]  # process name -> bytes
    metrics: Metrics
    shm_segments: int


@dataclass
class Soaked:
    """One server's run: its outcomes and samples, and how it ended."""

    name: str
    server: IrisServer
    outcomes: list[soak_traffic.Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    idle_after: str = "not checked"
    exit_status: int | None = None
    shm_left: int = 0


def process_rss(server: IrisServer) -> dict[str, int]:
    """RSS of each live process of the server's group, by its name (`/proc/PID/comm`: the
    children name themselves; the launcher, which serves HTTP too, is `server`)."""
    assert server.process is not None
    found = {}
    for pid, fields in group_processes(server.process.pid):
        if fields[0] == "Z":
            continue
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        name = "server" if pid == server.process.pid else name
        if name.startswith("python"):
            continue  # multiprocessing's resource tracker
        found[name] = int(fields[21]) * 4096
    return found


def shm_segments(launcher_pid: int) -> int:
    """The /dev/shm segments of the server whose launcher is `launcher_pid`."""
    return len(list(Path("/dev/shm").glob(f"iris-{launcher_pid}-*")))


def sample(soaked: Soaked, started: float) -> None:
    try:
        metrics = soaked.server.metrics()
    except httpx.HTTPError:
        metrics = {}
    rss = process_rss(soaked.server)
    at = time.monotonic() - started
    assert soaked.server.process is not None
    soaked.samples.append(Sample(at, rss, metrics, shm_segments(soaked.server.process.pid)))


async def drive(soaked: list[Soaked], users: int, seconds: float, period: float) -> None:
    """Every server's users at once, and a sample of each server every `period` seconds."""
    started = time.monotonic()
    deadline = started + seconds
    clips = soak_traffic.clip_pool(seed=4200)
    limits = httpx.Limits(max_connections=4 * users)
    timeout = httpx.Timeout(soak_traffic.REQUEST_TIMEOUT_SECONDS)

    async def sampler() -> None:
        while time.monotonic() < deadline:
            for run in soaked:
                await asyncio.to_thread(sample, run, started)
            await asyncio.sleep(period)  # the sampling period

    async def one(run: Soaked, index: int, client: httpx.AsyncClient) -> None:
        user = soak_traffic.User(index, run.server.model_name(), clips)

        def record(outcome: soak_traffic.Outcome) -> None:
            ended = outcome.ended - started  # seconds into the run
            run.outcomes.append(dataclasses.replace(outcome, ended=ended))

        await user.run(client, run.server.base_url, lambda: time.monotonic() > deadline, record)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = [one(run, i, client) for run in soaked for i in range(users)]
        await asyncio.wait_for(asyncio.gather(sampler(), *tasks), seconds + DRAIN_SECONDS + period)
    for run in soaked:
        sample(run, started)  # the end of the last window


def settle(run: Soaked) -> None:
    """The owners' counts back to zero once nothing runs (bounded)."""
    try:
        run.server.wait_for_metrics(
            lambda m: all(m.get(name, 0.0) == value for name, value in IDLE.items()), 60.0
        )
        run.idle_after = "yes"
    except TimeoutError:
        seen = run.server.metrics()
        run.idle_after = ", ".join(f"{n}={seen.get(n)}" for n in IDLE if seen.get(n) != IDLE[n])


# -- the report ------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile as `bench.load_client` takes it (numpy's); None without values."""
    return float(np.percentile(values, 100 * q)) if values else None


def ms(value: float | None) -> str:
    return "–" if value is None else f"{1000 * value:.0f}"


def windows(run: Soaked, window: float, total: float) -> list[tuple[float, float]]:
    edges = [i * window for i in range(int(total // window) + 1)]
    if total - edges[-1] > 1e-6:
        edges.append(total)
    return list(itertools.pairwise(edges))


def window_rows(run: Soaked, spans: list[tuple[float, float]]) -> list[list[object]]:
    rows = []
    names = sorted({n for s in run.samples for n in s.rss})
    for start, end in spans:
        done = [o for o in run.outcomes if start <= o.ended < end]
        errors = Counter(o.error for o in done if o.error is not None)
        ttft = [o.ttft for o in done if o.ttft is not None]
        tpot = [o.tpot for o in done if o.tpot is not None]
        last = max((s for s in run.samples if s.at <= end + 1), key=lambda s: s.at)
        rss = " / ".join(f"{last.rss.get(n, 0) >> 20}" for n in names)
        occupancy = [
            f"{last.metrics.get(metric, 0.0) / unit:.3g}" for metric, unit in OCCUPANCY.values()
        ]
        rows.append([
            f"{start / 60:.3g}-{end / 60:.3g}", len(done),
            ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "–",
            ms(pct(ttft, 0.5)), ms(pct(ttft, 0.99)), ms(pct(tpot, 0.5)), ms(pct(tpot, 0.99)),
            rss, *occupancy, last.shm_segments,
        ])  # fmt: skip
    return rows


def rss_growth(run: Soaked) -> dict[str, tuple[float, float]]:
    """Each process's RSS growth over the run's last `RSS_SPAN_MINUTES` (in a shorter run,
    its second half), as a share of its mean there: `(trend, endpoints)`. The trend is the
    least-squares slope through every sample of the span times its length, which the
    allocator's swings of a few MiB either way do not move as they move two single samples.
    """
    end = run.samples[-1].at
    span = min(RSS_SPAN_MINUTES * 60, end / 2)
    kept = [s for s in run.samples if s.at >= end - span]
    growth = {}
    for name in kept[0].rss:
        points = [(s.at, s.rss[name]) for s in kept if name in s.rss]
        mean = statistics.fmean(rss for _, rss in points)
        if len(points) < 2 or not mean:
            continue
        slope = statistics.linear_regression(*zip(*points, strict=True)).slope
        growth[name] = (slope * span / mean, (points[-1][1] - points[0][1]) / mean)
    return growth


def verdict_rows(run: Soaked, spans: list[tuple[float, float]], window: float) -> list[list]:
    unexpected = Counter(
        o.error for o in run.outcomes if o.error not in (None, soak_traffic.EXPECTED)
    )
    full = [span for span in spans if span[1] - span[0] >= window - 1e-6]

    def p99(span: tuple[float, float], metric: str) -> float | None:
        values = [getattr(o, metric) for o in run.outcomes if span[0] <= o.ended < span[1]]
        return pct([v for v in values if v is not None], 0.99)

    def ratio(metric: str) -> str:
        if len(full) < 2:
            return "– (fewer than two full windows)"
        second, last = p99(full[1], metric), p99(full[-1], metric)
        if not second or last is None:
            return "–"
        return f"{last / second:.2f} ({'ok' if last / second <= P99_BAR else 'over'} {P99_BAR})"

    growth = rss_growth(run)
    worst = max(growth, key=lambda n: growth[n][0])
    trend, endpoints = growth[worst]
    cancelled = sum(o.error == soak_traffic.EXPECTED for o in run.outcomes)
    return [
        [run.name, "requests (cancelled on purpose)", f"{len(run.outcomes)} ({cancelled})"],
        [run.name, "unexpected errors", sum(unexpected.values())],
        [run.name, "p99 TTFT, last full window / second", ratio("ttft")],
        [run.name, "p99 TPOT, last full window / second", ratio("tpot")],
        [run.name, "largest RSS growth, last 15 min: trend (endpoints)",
         f"{worst} {100 * trend:+.1f}% ({100 * endpoints:+.1f}%), "
         f"{'ok' if trend <= RSS_GROWTH_BAR else 'over'} {100 * RSS_GROWTH_BAR:.0f}%"],
        [run.name, "owners' counts zero when idle", run.idle_after],
        [run.name, "exit status; /dev/shm segments left", f"{run.exit_status}; {run.shm_left}"],
    ]  # fmt: skip


def report(runs: list[Soaked], args: argparse.Namespace, seconds: float) -> str:
    window = args.window_minutes * 60
    verdicts = [
        row for run in runs for row in verdict_rows(run, windows(run, window, seconds), window)
    ]
    together = "one after another, each alone" if args.one_at_a_time else "all at once"
    parts = [
        f"{len(runs)} server(s) on the generated `{args.size}` checkpoints, {together} on this "
        f"machine, each under {args.users} closed-loop users cycling through "
        f"{', '.join(soak_traffic.KINDS)} for {seconds / 60:.1f} min; every cache bounded "
        f"small (`{' '.join(BOUNDS)}`). TTFT / TPOT from the streamed requests; RSS in MiB "
        "per process at each window's end; occupancy the gauges then.",
        "## Verdict",
        markdown_table(["server", "check", "result"], verdicts),
    ]
    for run in runs:
        names = sorted({n for s in run.samples for n in s.rss})
        header = [
            "minutes",
            "requests",
            "errors",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "TPOT p50 ms",
            "TPOT p99 ms",
            f"RSS MiB ({' / '.join(names)})",
            *OCCUPANCY,
            "shm segments",
        ]
        parts += [
            f"## {run.name}",
            f"`iris serve MODEL {' '.join(run.server.flags)}`",
            markdown_table(header, window_rows(run, windows(run, window, seconds))),
        ]
        kinds = Counter(o.kind for o in run.outcomes)
        parts.append("Requests by kind: " + ", ".join(f"{k} {kinds[k]}" for k in kinds))  # fmt: skip
    return "\n\n".join(parts)


def soak(runs: list[Soaked], users: int, seconds: float, period: float) -> None:
    """Start `runs`' servers, drive them together for `seconds`, settle and stop them."""
    try:
        for run in runs:
            run.server.launch()
        for run in runs:
            run.server.wait_ready()
        asyncio.run(drive(runs, users, seconds, period))
        threads = [threading.Thread(target=settle, args=(run,)) for run in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for run in runs:
            pid = run.server.process.pid if run.server.process else None
            run.exit_status = run.server.stop()
            run.shm_left = shm_segments(pid) if pid else 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A soak of everything at once.")
    add_common_arguments(parser, quick_help="one server, one user, 12 seconds (smoke test)")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"of {', '.join(SERVERS)}")
    parser.add_argument("--minutes", type=float, default=32.0)
    parser.add_argument("--window-minutes", type=float, default=5.0)
    parser.add_argument("--users", type=int, default=3, help="closed-loop users per server")
    parser.add_argument("--name", default=None, help="result file name")
    parser.add_argument(
        "--one-at-a-time", action="store_true", help="each server alone for --minutes, in turn"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.servers, args.users, args.minutes, args.window_minutes = "qwen2_5_vl", 1, 0.2, 0.07
    from iris_serve.tiny_checkpoint import builtin_checkpoint

    runs = []
    for name in args.servers.split(","):
        arch, flags = SERVERS[name]
        model = builtin_checkpoint(arch=arch, size=args.size)
        runs.append(Soaked(name, IrisServer(model, [*BOUNDS, *flags], stop_timeout=60)))
    seconds = args.minutes * 60
    for group in [[run] for run in runs] if args.one_at_a_time else [runs]:
        soak(group, args.users, seconds, min(SAMPLE_SECONDS, args.window_minutes * 60 / 3))
    text = report(runs, args, seconds)
    name = args.name or f"soak_{args.size}" + ("_quick" if args.quick else "")
    title = f"Soak: {', '.join(ARCH_TITLES[SERVERS[r.name][0]] for r in runs)} ({args.size})"
    path = write_result(name, title, text, args.out)
    samples = {run.name: [{"at": x.at, "rss": x.rss, "shm_segments": x.shm_segments,
                           **{m: x.metrics.get(m, 0.0) for m, _ in OCCUPANCY.values()}}
                          for x in run.samples] for run in runs}  # fmt: skip
    path.with_suffix(".json").write_text(json.dumps(samples, indent=1))


if __name__ == "__main__":
    main()
